"""The reward/judge server (``dschat serve``, docs/serving.md): ``service`` (what it computes, no HTTP),
``batcher`` (the queue and the worker that packs requests), ``server`` (the FastAPI app), ``config`` (its flags).
Importing this package imports none of them."""

__all__ = ["batcher", "config", "server", "service"]
