"""Sampling: the one entry every caller samples through (``backends.generate``) over the backends (``decode``:
dschat's loop, compiled, graph, hf; ``vllm_engine``), the hybrid engine that flips the actor between training and
generation (``hybrid_engine``), chat sessions (``chat``), and a sampler in a process of its own with its checked
weight updates (``sampler``, ``weight_link``). Best-of-n generation, which also scores with stage 3's reward
sources, is a job above the library's packages (``dschat.apps.best_of_n``). See docs/generation.md."""
