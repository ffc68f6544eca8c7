"""The registry of stage-3 algorithms: ``--algo NAME`` -> its spec (``dschat.rlhf.specs``), which names the
run-time class that ``spec.load()`` imports. Reading the registry imports neither torch nor DeepSpeed.

An algorithm is two classes. Its spec, in ``dschat/rlhf/specs.py`` beside its ``*Args`` flags, answers from the
flags alone: ``name``; ``help`` (for ``--help``); ``uses`` (the stage-config groups of its own flags, or single
flags as ``"group.field"`` where it reads part of another algorithm's group, e.g. ``grpo_flags("scale_rewards")``:
every other algorithm's flag is refused under it); ``output_name`` and ``demo_data`` (the default output folder,
and the demo file used without ``--data``); ``tokenize_as`` (the phase-3 part of --data is tokenized as that
phase's rows, 3 prompts or 2 pairs); ``needs(cfg)`` (which of 'reference' and 'critic' to load);
``reward_func_names(cfg)`` (its default reward sources; none: no scorer is built); ``inert_flags(cfg)`` (flags
that do nothing under it, beyond other algorithms' groups); ``check_config(cfg)``; ``batch_size(cfg)`` (rows per
update, per device); ``plan(cfg, batches)`` (updates per epoch, micro-batches per update); ``runtime``
(``"module:Class"`` of the run-time class).

Its run-time class, in ``dschat/rlhf/<name>.py``, inherits the spec and adds a run: ``collator`` (batches the
rows ``tokenize_as`` makes); ``__init__(cfg, models, hybrid, scorer, gen, shuffle, ema, loop)`` (``loop``: the
stage's ``ResumableLoop``, whose ``state`` is the resumed state and in whose ``micro_batch`` each training
micro-batch runs), ``describe()``, ``evaluate(eval_loader)`` (the before/after evaluation), ``summary(before,
after)`` (its own eval.json fields), ``state()`` (what a resumable state keeps) and ``step(stream)`` (one update:
its metrics and the answers dropped as too short).

Adding an algorithm: its spec (and ``*Args``, as a piece of ``RLHFConfig``, if it has flags of its own) in
``specs.py``, its run-time class in a file of its own, and its spec in ``ALGORITHMS`` here.
"""

from __future__ import annotations

from dschat.rlhf.specs import (
    AlgorithmSpec,
    DPOSpec,
    GRPOSpec,
    OnlineDPOSpec,
    PPOSpec,
    ReinforcePPBaselineSpec,
    ReinforcePPSpec,
    ReMaxSpec,
    RLOOSpec,
)

ALGORITHMS: dict[str, type[AlgorithmSpec]] = {a.name: a for a in (
    PPOSpec, GRPOSpec, RLOOSpec, ReinforcePPSpec, ReinforcePPBaselineSpec, ReMaxSpec, DPOSpec, OnlineDPOSpec)}
OWNED_GROUPS = frozenset(u.split(".")[0] for a in ALGORITHMS.values() for u in a.uses)
