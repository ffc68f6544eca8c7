"""The actor EMA against the implementation it replaced, on one process or under the launcher.

``python -m deepspeed.launcher.runner --num_gpus 2 tests/step3_rlhf/ema_check.py STAGE OUT.json`` (or
``compare(stage)`` in-process): a tiny actor takes three optimizer steps; ``ActorEMA`` (each rank averages its own
share) runs beside the former implementation (gather the whole state to CPU after every step, average there).
Rank 0 writes both averages' largest difference and whether they are equal, and whether a fresh EMA restored
from the saved whole state (as ``--resume`` does) gives it back.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a script by the launcher: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from dschat import engine as E
from dschat.config import EngineArgs, OptimArgs
from dschat.models.tiny import tiny_model_config
from dschat.rlhf.ema import ActorEMA, step_actor

DECAY = 0.75


class GatheredEMA:
    """The former ``ActorEMA``: the whole state on CPU (rank 0), re-gathered after every optimizer step."""

    def __init__(self, actor):
        self.state = E.full_state_dict(actor)

    @torch.no_grad()
    def update(self, actor):
        for k, v in E.full_state_dict(actor).items():
            if v.is_floating_point():
                self.state[k].mul_(DECAY).add_(v, alpha=1.0 - DECAY)


def compare(stage: int) -> dict:
    from transformers import LlamaForCausalLM

    E.setup_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=2, hidden_size=48, intermediate_size=80))
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=stage), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0), dtype=torch.float32, total_steps=3)
    ema, old = ActorEMA(eng, DECAY), GatheredEMA(eng)
    first = E.full_state_dict(eng)
    for i in range(3):
        g = torch.Generator().manual_seed(100 * E.rank() + i)  # each rank its own data, as in training
        x = torch.randint(4, 100, (2, 8), generator=g)
        step_actor(eng, eng(input_ids=x, labels=x).loss, ema)
        old.update(eng)
    new = ema.full_state()
    saved = E.broadcast_object(ema.full_state(as_model=False))  # every rank reads tensors.pt on --resume
    restored = ActorEMA(eng, DECAY)
    restored.load_full_state(saved)
    again = restored.full_state()
    last = E.full_state_dict(eng)
    result = {}
    if E.is_main():
        result = {
            "world": E.world_size(), "keys_equal": sorted(new) == sorted(old.state),
            "max_abs_diff": max((new[k] - old.state[k]).abs().max().item() for k in old.state),
            "all_equal": all(torch.equal(new[k], old.state[k]) for k in old.state),
            "restored_equal": all(torch.equal(again[k], new[k]) for k in new),
            # the average is neither the first nor the last weights: it really averaged
            "between": sum(not torch.equal(new[k], first[k]) and not torch.equal(new[k], last[k]) for k in new),
            "tensors": len(new),
        }
    return result


if __name__ == "__main__":
    stage, path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
    out = compare(int(stage))
    if E.is_main():
        with open(path, "w") as fh:
            json.dump(out, fh)
    E.teardown_distributed()
