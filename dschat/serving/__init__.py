"""The reward/judge server (``dschat serve``, docs/serving.md): ``service`` (what it computes, no HTTP),
``parser`` (the parsing stage: bodies to jobs in bounded steps), ``batcher`` (the queue and the worker that packs
requests), ``guard`` (the connection cap and header deadline), ``server`` (the FastAPI app), ``config`` (its
flags). Importing this package imports none of them."""

__all__ = ["batcher", "config", "guard", "parser", "server", "service"]
