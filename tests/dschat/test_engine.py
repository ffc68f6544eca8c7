"""DeepSpeed configs and engines on CPU (gloo): ZeRO 0 and 3, schedules, gathering."""

import math

import pytest
import torch

from dschat import engine as E
from dschat.config import EngineArgs, OptimArgs
from dschat.models.tiny import tiny_model_config


def test_lr_schedule_warmup_then_cosine():
    f = E.lr_lambda(total_steps=10, warmup_steps=2, kind="cosine")
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)  # (step+1)/warmup
    # step 6: progress (6-2)/(10-2) = 0.5 -> 0.5*(1+cos(pi/2)) = 0.5
    assert f(6) == pytest.approx(0.5)
    assert f(10) == pytest.approx(0.0)
    lin = E.lr_lambda(10, 0, "linear")
    assert lin(5) == pytest.approx(0.5)
    assert E.lr_lambda(10, 0, "constant")(7) == 1.0


def test_ds_config_shapes():
    cfg = E.ds_config(micro_batch=4, grad_accum=2, zero_stage=3, offload=True, dtype=torch.bfloat16,
                      max_grad_norm=1.0, optim=OptimArgs(learning_rate=1e-4))
    assert cfg["train_batch_size"] == 8 * E.world_size()
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["bf16"]["enabled"] and cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"]["lr"] == 1e-4
    frozen = E.ds_config(micro_batch=1, grad_accum=1, zero_stage=3, offload=False, dtype=torch.float32,
                         inference=True)
    assert "optimizer" not in frozen


def test_hybrid_engine_is_recognised_by_its_class_not_its_name():
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    class Subclass(DeepSpeedHybridEngine):
        pass

    assert E.is_hybrid_engine(DeepSpeedHybridEngine.__new__(DeepSpeedHybridEngine))
    assert E.is_hybrid_engine(Subclass.__new__(Subclass))  # a class-name comparison missed this one
    lookalike = type("DeepSpeedHybridEngine", (), {})()
    assert not E.is_hybrid_engine(lookalike) and not E.is_hybrid_engine(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("stage", [0, 3])
def test_train_engine_steps_and_full_state_dict(stage):
    from transformers import LlamaForCausalLM

    E.setup_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=stage), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0), dtype=torch.float32, total_steps=3)
    x = torch.randint(4, 100, (2, 8))
    losses = []
    for _ in range(3):
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    state = E.full_state_dict(eng)
    assert set(state) >= {k for k in before if "rotary" not in k}
    changed = [k for k in before if k in state and not torch.equal(before[k], state[k])]
    assert len(changed) >= len(before) - 2  # every weight moved (rotary buffers aside)
    assert all(math.isfinite(v.float().sum().item()) for v in state.values())
    assert not E.is_hybrid_engine(eng) and not E.is_hybrid_engine(E.unwrap(eng))
    with E.gathered_parameters(E.unwrap(eng)):
        out = E.unwrap(eng).generate(x[:, :3], attention_mask=torch.ones_like(x[:, :3]), max_new_tokens=4,
                                     do_sample=False)
    assert out.shape == (2, 7)


def test_a_one_process_run_builds_no_deepspeed_op(tmp_path):
    """DeepSpeed's comm wrapper JIT-compiles its CPU shared-memory all-reduce op when it is created (about a
    minute of two cores per extensions folder); no run of ours uses it, so a fresh folder must stay empty."""
    from tests.helpers import run_cli

    ext = tmp_path / "torch_extensions"
    proc = run_cli("train", "--step", "1", "--model", "tiny", "--zero-stage", "3", "--max-steps", "1",
                   "--max-eval-rows", "16", "--output-dir", str(tmp_path / "out"), "--no-progress",
                   env={"TORCH_EXTENSIONS_DIR": str(ext)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not ext.exists() or not any(ext.iterdir()), sorted(p.name for p in ext.iterdir())
    assert "shm_comm" not in proc.stdout + proc.stderr


def test_zero3_gathers_outside_a_forward_settle_prefetches_in_flight():
    """ZeRO-3 prefetches parameters along the order it recorded; a forward that ends off that order leaves some
    gathers in flight, and a gather outside a forward (saving, generating) then failed with "Cannot partition a
    param in flight" (a ~110M model saving at the end of a packed two-rank run). The prefetcher's state is
    planted here: three parameters in flight, registered as it registers them."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers import LlamaForCausalLM

    E.setup_distributed()
    torch.manual_seed(0)
    # hidden 128: every matrix is over the persistence threshold (1e4 elements), so partitioned
    model = LlamaForCausalLM(tiny_model_config(num_hidden_layers=2, hidden_size=128, intermediate_size=256))
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=3), optim=OptimArgs(
        learning_rate=1e-2, per_device_train_batch_size=2, num_warmup_steps=0), dtype=torch.float32, total_steps=1)
    x = torch.randint(4, 100, (2, 8))
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()
    module = E.unwrap(eng)

    def plant() -> list[torch.nn.Parameter]:
        ahead = [p for p in module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE][:3]
        handle = ahead[0].all_gather_coalesced(ahead)
        for p in ahead:
            module.ds_inflight_param_registry[p] = handle
        assert all(p.ds_status == ZeroParamStatus.INFLIGHT for p in ahead)
        return ahead

    ahead = plant()
    state = E.full_state_dict(eng)  # the engine: settled first
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in ahead)
    assert set(state) >= {n for n, _ in module.named_parameters()}
    assert torch.equal(E.full_state_dict(eng)["lm_head.weight"], state["lm_head.weight"])
    plant()
    with E.gathered_parameters(eng):
        out = module.generate(x[:, :3], attention_mask=torch.ones_like(x[:, :3]), max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 5)
    plant()
    with pytest.raises(AssertionError, match="in flight"):  # the module alone cannot settle: the failure itself
        E.full_state_dict(module)
    E.settle_partitions(eng)
