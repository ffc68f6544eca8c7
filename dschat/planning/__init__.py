"""Planning before a run: ``make_plan`` (per-GPU memory by model and phase, a verdict with the cheapest change
that fits, a time estimate) from the stage's flags and the models' config files alone; nothing here loads
weights or imports torch. See docs/planning.md."""

from dschat.planning.gpus import GPUS, parse_bytes
from dschat.planning.plan import Plan, make_plan
from dschat.planning.shapes import ModelShape, model_shape

__all__ = ["GPUS", "ModelShape", "Plan", "make_plan", "model_shape", "parse_bytes"]
