"""Evaluation shared by the stages and ``dschat eval``: language-model perplexity (``lm``, stage 1), reward models
(``reward_model``, stage 2), the policy on held-out prompts (``policy``, stage 3's before and after;
``saved_policy``, ``dschat eval --step 3`` against a baseline) and generative judges (``judge``)."""
