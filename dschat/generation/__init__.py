"""Sampling: the one decode path every caller goes through (``decode``: backends dschat, compiled, hf), the hybrid
engine that flips the actor between training and generation (``hybrid_engine``), best-of-n sampling (``best_of_n``,
the body of ``dschat generate``) and chat sessions (``chat``). See docs/generation.md."""
