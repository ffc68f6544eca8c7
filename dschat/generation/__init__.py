"""Sampling: the one decode path every caller goes through (``decode``: backends dschat, compiled, hf), the hybrid
engine that flips the actor between training and generation (``hybrid_engine``) and chat sessions (``chat``).
Best-of-n generation, which also scores with stage 3's reward sources, is a job above the library's packages
(``dschat.apps.best_of_n``). See docs/generation.md."""
