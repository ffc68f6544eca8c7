"""Whole jobs a command runs, assembled from the library's packages: best-of-n generation (``best_of_n``, the body
of ``dschat generate``) and a saved policy's evaluation (``saved_policy``, ``dschat eval --step 3``).

A job here may import any package of the library (stage 3's engines, rollout and scoring, the data, the decode
path) and none imports it back; the CLI layer parses a command's flags and calls its job. What is a building
block of the stages (sampling, scoring, the held-out evaluation) stays in its package below, so the lower
packages never reach up to ``rlhf`` for it (docs/architecture.md, Import rules)."""
