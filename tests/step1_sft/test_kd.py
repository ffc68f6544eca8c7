"""Knowledge distillation in stage 1 (docs/algorithms.md, Distillation): the loss of a micro-batch is the mix it
claims to be, a short run moves the student towards its teacher, and a teacher with another tokenizer or a KD flag
without a teacher stops with one line."""

from pathlib import Path

import pytest
import torch

from dschat.config import EngineArgs, KDArgs, SFTConfig, build_config, refuse_inert
from dschat.errors import UserError
from tests.helpers import read_json, read_jsonl
from tests.helpers import run_stage as run


def make_teacher(folder: Path, seed: int = 7) -> Path:
    """The tiny preset's architecture and tokenizer with other (seeded) random weights: a teacher the student
    starts far from."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dschat.models.loading import resolve_model

    tiny = resolve_model("tiny")
    if not (folder / "config.json").exists():
        rng = torch.random.get_rng_state()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
        torch.random.set_rng_state(rng)
        with torch.no_grad():  # sharper than a fresh init, so the teacher has preferences to pass on
            model.lm_head.weight.mul_(8.0)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return folder


def test_step1_loss_with_a_teacher_is_the_hand_assembled_mix(tmp_path):
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model
    from dschat.training.distill import Distiller

    a, T = 0.3, 2.0
    tiny = resolve_model("tiny")
    student = create_causal_lm(tiny)
    distiller = Distiller(KDArgs(teacher_model=str(make_teacher(tmp_path / "teacher")), kd_coef=a, kd_temperature=T),
                          EngineArgs())
    distiller.load(tiny, load_tokenizer(tiny), torch.float32)
    ids = torch.tensor([[1, 50, 60, 70, 80, 2, 0], [1, 90, 91, 92, 93, 94, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, 60, 70, 80, 2, -100], [-100, -100, -100, 92, 93, 94, 2]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    out = distiller.loss(student, batch)

    # By hand: the plain SFT loss (the model's own CE over the 8 answer tokens) and the KL of the student to the
    # teacher at temperature T at the same 8 positions, times T^2.
    ce = student(**batch, use_cache=False).loss
    s_logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1]
    t_logits = distiller.teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
    keep = labels[:, 1:] != -100
    p = torch.softmax(t_logits[keep] / T, -1)  # (8, V)
    kl = (p * (torch.log(p) - torch.log_softmax(s_logits[keep] / T, -1))).sum(-1)
    assert keep.sum() == 8 and torch.isfinite(kl).all() and (kl > 0).all()
    want = (1 - a) * ce + a * T**2 * kl.mean()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.ce.item() == pytest.approx(ce.item(), rel=1e-5)
    assert out.kd.item() == pytest.approx((T**2 * kl.mean()).item(), rel=1e-5)
    out.loss.backward()  # the teacher's side carries no gradient
    assert all(q.grad is None for q in distiller.teacher.parameters())
    assert any(q.grad is not None for q in student.parameters())


def test_sft_with_a_teacher_moves_the_student_towards_it(tmp_path):
    out = tmp_path / "kd"
    teacher = make_teacher(tmp_path / "teacher")
    metrics = run(build_config(SFTConfig, {"model": "tiny", "output_dir": str(out), "max_steps": 12,
                                           "teacher_model": str(teacher), "kd_coef": 0.9, "kd_temperature": 2.0,
                                           "per_device_train_batch_size": 8, "max_eval_rows": 32,
                                           "progress": False}))
    assert metrics["kd"] < 0.9 * metrics["kd_before"], metrics  # a short run clears this margin comfortably
    assert metrics["top1_agreement"] > metrics["top1_agreement_before"]
    assert metrics["teacher_model"] == str(teacher) and metrics["kd_coef"] == 0.9
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 12
    for r in rows:  # the logged loss is the logged mix
        assert r["train/loss"] == pytest.approx(0.1 * r["train/ce"] + 0.9 * r["train/kd"], rel=1e-5)
    assert rows[-1]["train/kd"] < rows[0]["train/kd"]
    ev = read_json(out / "eval.json")
    assert ev["kd_before"] > ev["kd"] and ev["perplexity"] is not None


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    from tests.families import build_family

    other = build_family("gpt2", tmp_path)
    cfg = build_config(SFTConfig, {"model": "tiny", "output_dir": str(tmp_path / "o"), "max_steps": 1,
                                   "teacher_model": str(other), "progress": False})
    with pytest.raises(UserError) as e:
        run(cfg)
    text = str(e.value)
    assert "\n" not in text and "different tokenizers" in text
    assert str(other) in text and "tiny" in text  # names both models


def test_kd_flags_need_a_teacher_and_a_coefficient_in_range():
    for flag, value in (("kd_coef", 0.3), ("kd_temperature", 2.0)):
        with pytest.raises(UserError, match=f"--{flag.replace('_', '-')} has no effect without --teacher-model"):
            refuse_inert(build_config(SFTConfig, {flag: value}), {flag})
    refuse_inert(build_config(SFTConfig, {"teacher_model": "tiny", "kd_coef": 0.3}), {"teacher_model", "kd_coef"})
    with pytest.raises(UserError, match="must be <= 1"):
        build_config(SFTConfig, {"teacher_model": "tiny", "kd_coef": 1.5})
    with pytest.raises(UserError, match="must be > 0"):
        build_config(SFTConfig, {"teacher_model": "tiny", "kd_temperature": 0})
    from dschat.config import RewardConfig, flag_specs

    assert "teacher_model" not in {s.name for s in flag_specs(RewardConfig)}  # stage 2 has no teacher


@pytest.mark.slow
def test_the_teacher_under_zero3_gives_the_same_numbers(tmp_path):
    """The teacher's frozen engine at the student's ZeRO stage: under ZeRO-3 (parameters sharded and gathered per
    forward) the distillation term before training equals the ZeRO-0 one, and training runs."""
    teacher = make_teacher(tmp_path / "teacher")
    common = {"model": "tiny", "max_steps": 2, "teacher_model": str(teacher), "max_eval_rows": 16,
              "per_device_train_batch_size": 4, "progress": False}
    z0 = run(build_config(SFTConfig, {**common, "output_dir": str(tmp_path / "z0")}))
    z3 = run(build_config(SFTConfig, {**common, "output_dir": str(tmp_path / "z3"), "zero_stage": 3}))
    assert z3["kd_before"] == pytest.approx(z0["kd_before"], rel=1e-4)
    assert z3["kd"] == pytest.approx(z0["kd"], rel=1e-2)
