"""LoRA through PEFT (dschat.models.lora): only adapters (and a v_head) train, saves merge into plain HF folders that
load without peft, and ``--save-adapter`` folders load back onto the base model with peft."""

import dataclasses
import json

import pytest
import torch

from dschat import engine as E
from dschat.config import EngineArgs, LoraArgs, OptimArgs, flag_specs
from dschat.errors import UserError
from dschat.models.loading import create_causal_lm, create_reward_model, load_tokenizer, resolve_model
from dschat.models.lora import ADAPTER_DIR, lora_param_groups, merged_state_dict, target_module_names
from dschat.models.reward_model import hf_model
from dschat.training.checkpoint import save_hf

LR = 1e-2
IDS = torch.randint(4, 100, (2, 8), generator=torch.Generator().manual_seed(0))  # no pad (3) inside: ids >= 4


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny")
    return path, load_tokenizer(path)


def _is_lora(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _train(model, stage: int, steps: int, loss_fn, lora_lr: float | None = None):
    """``steps`` AdamW steps through dschat's DeepSpeed engine with dschat's LoRA parameter groups."""
    E.setup_distributed()
    optim = OptimArgs(learning_rate=LR, per_device_train_batch_size=2, num_warmup_steps=0,
                      lr_scheduler_type="constant")
    eng = E.build_train_engine(model, engine=EngineArgs(zero_stage=stage), optim=optim, dtype=torch.float32,
                               total_steps=steps, lr=LR, param_groups=lora_param_groups(model, 0.0, LR, lora_lr))
    for _ in range(steps):
        loss = loss_fn(eng)
        assert torch.isfinite(loss)
        eng.backward(loss)
        eng.step()
    return eng


def _assert_only_changed(before: dict, after: dict, trainable: set[str]) -> None:
    assert set(after) >= set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == trainable  # every trained tensor moved; every base weight is bit-identical


def _plain_folder_keys(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("stage", [0, 3])
def test_causal_lm_trains_adapters_only_and_saves_merged_and_adapter(tiny, tmp_path, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    torch.manual_seed(0)
    model = create_causal_lm(path, lora=LoraArgs(lora_dim=8, save_adapter=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora_keys = {k for k in before if _is_lora(k)}
    assert len(lora_keys) == 2 * 2 * 7  # 2 layers x (q, k, v, o, gate, up, down) x (A, B); no lm_head
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_keys

    eng = _train(model, stage, 2, lambda e: e(input_ids=IDS, labels=IDS).loss)  # 2: A moves once B != 0
    _assert_only_changed(before, E.full_state_dict(eng), lora_keys)
    eng.eval()
    with torch.no_grad():
        adapted = eng(input_ids=IDS).logits

    save_hf(eng, tok, tmp_path / "model")
    out = tmp_path / "model"
    # A plain HF folder: the base model's own names and config, no adapter config where transformers looks.
    assert not (out / "adapter_config.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    base = AutoModelForCausalLM.from_pretrained(path)
    assert _plain_folder_keys(out) == set(base.state_dict())
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not hasattr(merged, "peft_config")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, adapted, atol=1e-5, rtol=0)

    reloaded = PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, adapted, atol=1e-5, rtol=0)


def test_reward_model_lora_zero3_trains_adapters_and_v_head(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    path, tok = tiny
    torch.manual_seed(0)
    lora = LoraArgs(lora_dim=8, lora_module_name="q_proj,v_proj", save_adapter=True, lora_learning_rate=2e-2)
    rm = create_reward_model(path, pad_token_id=tok.pad_token_id, lora=lora)
    before = {k: v.clone() for k, v in rm.state_dict().items()}
    trainable = {k for k in before if _is_lora(k)} | {"model.score.weight"}
    assert len(trainable) == 2 * 2 * 2 + 1  # 2 layers x (q, v) x (A, B) + v_head
    assert {n for n, p in rm.named_parameters() if p.requires_grad} == trainable
    groups = lora_param_groups(rm, 0.0, LR, lora.lora_learning_rate)
    assert [(len(g["params"]), g["lr"]) for g in groups] == [(1, LR), (8, 2e-2)]  # v_head first, at the main lr

    mask = torch.ones_like(IDS)
    eng = _train(rm, 3, 2, lambda e: -e(IDS, mask)[:, -1].mean(), lora_lr=lora.lora_learning_rate)
    _assert_only_changed(before, E.full_state_dict(eng), trainable)
    eng.eval()
    with torch.no_grad():
        scores = eng(IDS, mask)[:, -1]  # (B,) value at the last token

    save_hf(eng, tok, tmp_path / "rm")
    out = tmp_path / "rm"
    assert _plain_folder_keys(out) == set(AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1).state_dict())
    plain = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS, attention_mask=mask).logits.squeeze(-1), scores,
                                   atol=1e-5, rtol=0)

    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=tok.pad_token_id)
    reloaded = PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS, attention_mask=mask).logits.squeeze(-1), scores,
                                   atol=1e-5, rtol=0)


def test_gradient_checkpointing_with_lora_gives_the_same_gradients_and_trains(tiny):
    path, _ = tiny

    def lora_grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # same adapter init in both models
        m = create_causal_lm(path, gradient_checkpointing=checkpointing, lora=LoraArgs(lora_dim=8))
        with torch.no_grad():  # B = 0 at init would leave every A without gradient
            for n, p in m.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.02)
        m.train()
        m(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
        return {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    plain, ckpt = lora_grads(False), lora_grads(True)
    assert set(plain) == set(ckpt) and all(g is not None and g.abs().sum() > 0 for g in ckpt.values())
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], atol=1e-6, rtol=1e-5)

    torch.manual_seed(0)
    model = create_causal_lm(path, gradient_checkpointing=True, lora=LoraArgs(lora_dim=8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = _train(model, 0, 2, lambda e: e(input_ids=IDS, labels=IDS, use_cache=False).loss)
    after = E.full_state_dict(eng)
    assert any(not torch.equal(before[k], after[k]) for k in before if ".lora_B." in k)
    assert all(torch.equal(before[k], after[k]) for k in before if not _is_lora(k))


def test_module_selection_trainability_and_flags(tiny):
    path, _ = tiny
    lm = create_causal_lm(path)
    all_linear = target_module_names(lm, "all-linear")
    assert len(all_linear) == 14 and "lm_head" not in all_linear
    assert target_module_names(lm, "q_proj, v_proj") == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1)
                                                         for p in ("q", "v")]
    assert len(target_module_names(lm, "layers.1.")) == 7  # DeepSpeed-Chat style substring
    with pytest.raises(UserError, match="matches no linear layer"):
        target_module_names(lm, "decoder.layers.")
    assert not hasattr(create_causal_lm(path, lora=LoraArgs(lora_dim=0)), "peft_config")

    both = create_causal_lm(path, lora=LoraArgs(lora_dim=4, only_optimize_lora=False))
    assert all(p.requires_grad for p in both.parameters())  # base weights train next to the adapters
    groups = lora_param_groups(both, 0.1, 1e-3, 5e-4)
    # decay split as dschat.engine.optimizer_groups: norms (1-D) without decay; adapters in their own group
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.1), (1e-3, 0.0), (5e-4, 0.1)]

    @dataclasses.dataclass
    class Cfg:
        lora: LoraArgs = dataclasses.field(default_factory=LoraArgs)

    flags = {s.name: s.default for s in flag_specs(Cfg)}
    assert flags == {"lora_dim": 0, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_module_name": "all-linear",
                     "only_optimize_lora": True, "lora_learning_rate": None, "save_adapter": False}


def _random_lora_b(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)


def test_merge_handles_gpt2_conv1d_and_a_peft_model_wrapper():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    from dschat.models.lora import apply_lora
    from dschat.models.tiny import tiny_model_config

    # GPT-2's Conv1D stores (in, out): the update must be transposed (PEFT's fan_in_fan_out).
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    gpt2 = apply_lora(GPT2LMHeadModel(cfg), LoraArgs(lora_dim=4)).eval()
    _random_lora_b(gpt2)
    plain = GPT2LMHeadModel(cfg).eval()
    plain.load_state_dict(merged_state_dict(gpt2, gpt2.state_dict()))
    x = IDS % 100
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits, gpt2(input_ids=x).logits, atol=1e-5, rtol=0)

    # A get_peft_model wrapper: keys carry base_model.model. and .base_layer.; hf_model strips the first.
    config = tiny_model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    peft_lm = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _random_lora_b(peft_lm)
    target, prefix = hf_model(peft_lm)
    assert prefix == "base_model.model."
    state = {k[len(prefix):]: v for k, v in merged_state_dict(peft_lm, peft_lm.state_dict()).items()}
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS).logits, peft_lm.eval()(input_ids=IDS).logits, atol=1e-5,
                                   rtol=0)
