"""An exponential moving average of the actor's weights (``--enable-ema``; DeepSpeed-Chat's ``actor_ema``)."""

from __future__ import annotations

from typing import Any

import torch

from dschat import engine as E


class ActorEMA:
    """The average of the actor's full weights, kept on CPU (gathered under ZeRO-3), updated after each actor
    optimizer step: ``ema = decay * ema + (1 - decay) * weights``."""

    def __init__(self, actor: Any, decay: float):
        self.decay = decay
        self.state = E.full_state_dict(actor)

    @torch.no_grad()
    def update(self, actor: Any) -> None:
        current = E.full_state_dict(actor)
        for k, v in current.items():
            if v.is_floating_point():
                self.state[k].mul_(self.decay).add_(v, alpha=1.0 - self.decay)


def step_actor(actor: Any, loss: torch.Tensor, ema: ActorEMA | None) -> None:
    """Backward and step the actor engine; the EMA follows each step that was an optimizer step (not one inside
    a gradient-accumulation window)."""
    steps_before = actor.global_steps
    actor.backward(loss)
    actor.step()
    if ema is not None and actor.global_steps != steps_before:
        ema.update(actor)
