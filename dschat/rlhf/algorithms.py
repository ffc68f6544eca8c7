"""The registry of stage-3 algorithms: ``--algo NAME`` -> its class. Adding an algorithm is a file holding its
class and this one entry.

An algorithm class has: ``name``; ``help`` (for ``--help``); ``uses`` (the stage-config groups of its own flags, or
single flags as ``"group.field"`` where it reads part of another algorithm's group, e.g.
``grpo_flags("scale_rewards")``: every other algorithm's flag is refused under it); ``output_name`` and
``demo_data`` (the default output folder, and the demo file used without ``--data``); ``needs(cfg)`` (which of
'reference' and 'critic' to load); ``reward_func_names(cfg)`` (its default reward sources; none: no scorer is
built); ``inert_flags(cfg)`` (flags that do nothing under it, beyond other algorithms' groups);
``check_config(cfg)``; ``tokenize_as`` and ``collator`` (the phase-3 part of --data is tokenized as that phase's
rows, 3 prompts or 2 pairs, and batched by that collator); ``batch_size(cfg)`` (rows per update, per device);
``plan(cfg, batches)`` (updates per epoch, micro-batches per update). Per run: ``__init__(cfg, models, hybrid,
scorer, gen, shuffle, ema, state)``, ``describe()``, ``evaluate(eval_loader)`` (the before/after evaluation),
``summary(before, after)`` (its own eval.json fields), ``state()`` (what a resumable state keeps) and
``step(stream)`` (one update: its metrics and the answers dropped as too short).
"""

from __future__ import annotations

from dschat.rlhf.dpo import DPO
from dschat.rlhf.grpo import GRPO
from dschat.rlhf.online_dpo import OnlineDPO
from dschat.rlhf.ppo import PPO
from dschat.rlhf.reinforce_pp import ReinforcePP, ReinforcePPBaseline
from dschat.rlhf.remax import ReMax
from dschat.rlhf.rloo import RLOO

ALGORITHMS = {a.name: a for a in (PPO, GRPO, RLOO, ReinforcePP, ReinforcePPBaseline, ReMax, DPO, OnlineDPO)}
OWNED_GROUPS = frozenset(u.split(".")[0] for a in ALGORITHMS.values() for u in a.uses)
