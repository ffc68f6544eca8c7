"""Tool use and multi-turn environments (docs/tools.md): the model acts, a tool or an environment answers, and the
episode earns the reward.

- ``tools``: tools from Python functions (their signature and docstring are the schema), the built-in
  ``calculator``, and the runner that calls them under a timeout and an output cap;
- ``calls``: how a call and its result look in the text (the tokenizer's chat template where it renders tools,
  else the plain format) and how a call is parsed;
- ``env``: the environment interface (an episode from a data row; the assistant's turn in, the next observation,
  a reward and whether it is done out), its shapes checked at load;
- ``worker``: a user's tool or environment in worker processes of its own (plain JSON over pipes, a deadline per
  call, the process group killed on a fault and at the run's end), and the checks of what user code returns;
- ``episode``: the rollout of a batch of episodes, rows advancing independently inside the decode loop, and the
  policy mask that keeps tool and environment tokens out of every loss.
"""
