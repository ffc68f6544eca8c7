"""Evaluation shared by the stages and ``dschat eval``: language-model perplexity (``lm``, stage 1), reward models
(``reward_model``, stage 2) and generative judges (``judge``). The policy's held-out evaluation is stage 3's own
(``dschat.rlhf.evaluation``), and a saved policy's, ``dschat eval --step 3``, is a job built on it
(``dschat.apps.saved_policy``)."""
