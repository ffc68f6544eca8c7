"""One gradient norm per optimizer step: on ZeRO 0 in float32 with --max-grad-norm the norm DeepSpeed's clipping
computes is the one logged (``E.optimizer_step``), not a second pass over the gradients."""

from __future__ import annotations

import math

import pytest
import torch

from dschat import engine as E
from dschat.config import EngineArgs, OptimArgs
from dschat.models.tiny import tiny_model_config


def _engine(max_grad_norm: float):
    from transformers import LlamaForCausalLM

    E.setup_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    optim = OptimArgs(learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0,
                      max_grad_norm=max_grad_norm)
    return E.build_train_engine(model, engine=EngineArgs(zero_stage=0), optim=optim, dtype=torch.float32,
                                total_steps=3)


def _backward(eng) -> float:
    """One micro-batch's backward; the gradients' 2-norm, by hand in float64."""
    x = torch.arange(4, 20).reshape(2, 8)
    eng.backward(eng(input_ids=x, labels=x).loss)
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in eng.module.parameters() if p.grad is not None))


class NormCalls:
    """Counts the gradient norms taken (``Tensor.norm`` and ``torch.linalg.vector_norm``), a norm called inside
    another (``Tensor.norm`` goes through ``vector_norm``) counting once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls, self._depth = 0, 0
        for owner, name in ((torch.Tensor, "norm"), (torch.linalg, "vector_norm")):
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, fn):
        def wrapper(*args, **kwargs):
            self.calls += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper


def test_zero0_fp32_clipping_takes_the_norm_once_and_clips_as_deepspeed_does(monkeypatch):
    max_norm = 0.05
    ours, reference = _engine(max_norm), _engine(max_norm)
    by_hand = _backward(ours)
    assert _backward(reference) == by_hand
    assert by_hand > 10 * max_norm  # the clipping binds: the update depends on it
    grads = sum(p.grad is not None for p in ours.module.parameters())
    counter = NormCalls(monkeypatch)
    E.optimizer_step(ours)
    # one norm per gradient tensor, each taken once (the old path took them twice, plus the norm of the norms)
    assert counter.calls == grads
    monkeypatch.undo()
    reference.step()  # DeepSpeed's own clip_fp32_gradients
    for a, b in zip(ours.module.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(a, b)  # the same clipped update, bit for bit
    assert E.take_grad_norms(ours) == [pytest.approx(by_hand, rel=1e-4)]  # before clipping, in float32


def test_zero0_fp32_without_clipping_still_logs_the_norm():
    eng = _engine(0.0)
    by_hand = _backward(eng)
    E.optimizer_step(eng)
    assert E.take_grad_norms(eng) == [pytest.approx(by_hand, rel=1e-4)]
    assert E.take_grad_norms(eng) == []  # read once
