"""Models: resolving ``--model`` and building causal LMs and reward models (``loading``), the reward/critic module
(``reward_model``), LoRA (``lora``), the ``tiny`` preset (``tiny``) and the output layer only where a loss reads it
(``logits``). See docs/models.md."""
