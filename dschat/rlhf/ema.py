"""An exponential moving average of the actor's weights (``--enable-ema``; DeepSpeed-Chat's ``actor_ema``)."""

from __future__ import annotations

from typing import Any

import torch

from dschat import engine as E


class ActorEMA:
    """``ema = decay * ema + (1 - decay) * weights`` after each actor optimizer step.

    Each rank averages only its own share of the weights (``engine.own_shards``: under ZeRO-3 its partition, read
    in place; otherwise a 1/world slice of every tensor), in float32, on the device the share lives on. No step
    gathers or copies the model: the whole average is assembled (``full_state``) only to save it. Under ZeRO-3 on
    a 7B actor that is one full gather and copy to CPU per save instead of per optimizer step. The average is
    kept in float32 whatever the weights' dtype: in bf16, a step of ``1 - decay`` = 0.008 of the difference is
    below the format's resolution and the average would barely move.
    """

    def __init__(self, actor: Any, decay: float):
        self.decay = decay
        self.actor = actor
        self.average = {k: s.live.to(torch.float32 if s.live.is_floating_point() else s.live.dtype, copy=True)
                        for k, s in E.own_shards(actor).items()}

    @torch.no_grad()
    def update(self, actor: Any) -> None:
        for k, s in E.own_shards(actor).items():
            if s.live.is_floating_point():
                self.average[k].mul_(self.decay).add_(s.live, alpha=1.0 - self.decay)

    def full_state(self, as_model: bool = True) -> dict[str, torch.Tensor]:
        """The whole average on rank 0 (``{}`` elsewhere; collective): in the weights' dtypes for a model folder,
        or float32 (``as_model=False``) for a resumable state."""
        return E.gather_shards(self.average, E.own_shards(self.actor), as_model=as_model)

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's share of a whole average (``full_state`` of a saved run, any world size)."""
        for k, s in E.own_shards(self.actor).items():
            part = state[k].reshape(-1)[s.start: s.start + s.live.numel()]
            self.average[k].copy_(part.to(self.average[k].device))


def step_actor(actor: Any, loss: torch.Tensor, ema: ActorEMA | None) -> None:
    """Backward and step the actor engine; the EMA follows each step that was an optimizer step (not one inside
    a gradient-accumulation window)."""
    steps_before = actor.global_steps
    actor.backward(loss)
    E.optimizer_step(actor)
    if ema is not None and actor.global_steps != steps_before:
        ema.update(actor)
