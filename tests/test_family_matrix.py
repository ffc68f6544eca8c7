"""The model families users bring, end to end (docs/models.md, Aliases and families): for each tiny family of
``tests/families.py``, stage 1, stage 2 (its saved folder scores as HF's ``AutoModelForSequenceClassification``
does, and ``dschat eval --step 2`` reports what HF's scores give), PPO and GRPO for a step, ``dschat chat`` and
``dschat export``; each family also as its ``-tight`` variant, without spare embedding rows (``tests/families.py``).

Commands run in-process through the ``dschat`` entry point (as a user types them), a few rows and one or two
steps each; one module-scoped run per family serves all its checks. ``llama_sp-bf16`` runs every stage, eval,
chat and export of the ``tiny`` family in bf16 on the CPU, the closest this machine gets to the GPU default.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.families import FAMILIES, TIGHT_FAMILIES, build_family, pairwise_rows, write_rows
from tests.helpers import read_json

pytestmark = pytest.mark.slow

COMMON = ["--no-progress", "--seed", "1", "--max-seq-len", "96"]


def dschat(*args: str) -> str:
    """``dschat ARGS`` in this process; returns stdout, fails the test on a non-zero exit."""
    from dschat.cli.main import cli

    out, argv = io.StringIO(), sys.argv
    sys.argv = ["dschat", *args]
    try:
        with contextlib.redirect_stdout(out):
            cli()
    except SystemExit as e:
        if e.code:
            raise AssertionError(f"dschat {' '.join(args)} exited {e.code}") from None
    finally:
        sys.argv = argv
    return out.getvalue()


def hf_scores(model_dir: Path, rows: list[list[int]], side: str) -> torch.Tensor:
    """HF's scores of token rows padded by the saved tokenizer itself (``side`` padding), as a user would. Left
    padding passes position ids from the mask: models with absolute positions (GPT-2) need them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = side
    batch = tok.pad({"input_ids": rows}, return_tensors="pt")
    if side == "left":
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).logits.squeeze(-1)


def dschat_scores(model_dir: Path, rows: list[list[int]]) -> torch.Tensor:
    from dschat.data import DataCollatorReward
    from dschat.models.loading import create_reward_model, load_tokenizer

    tok = load_tokenizer(str(model_dir))
    rm = create_reward_model(str(model_dir), pad_token_id=tok.pad_token_id).eval()
    half = [{"chosen_input_ids": r, "rejected_input_ids": r} for r in rows]
    batch = DataCollatorReward(tok.pad_token_id)(half)
    n = len(rows)
    with torch.no_grad():
        return rm.end_scores(rm(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])[:n]


@pytest.fixture(scope="module", params=[*FAMILIES, "llama_sp-bf16", *(f"{f}-tight" for f in TIGHT_FAMILIES)])
def family(request, tmp_path_factory):
    """Stages 1 and 2 of one family (``-bf16``: in bf16; ``-tight``: without spare embedding rows), with their
    folders and the pairs file."""
    name, _, variant = request.param.partition("-")
    dtype = "bf16" if variant == "bf16" else "fp32"
    root = tmp_path_factory.mktemp(request.param)
    base = build_family(request.param if variant == "tight" else name, root)
    data = write_rows(root / "pairs.jsonl", pairwise_rows(48))
    flags = [*COMMON, "--dtype", dtype]
    run = {"name": name, "base": base, "data": data, "root": root, "dtype": dtype, "flags": flags}
    d = ["--data", str(data)]
    dschat("train", "--step", "1", "--model", str(base), *d, "--output-dir", str(root / "s1"), "--max-steps", "2",
           "--per-device-train-batch-size", "4", "--no-save-final-state", *flags)
    dschat("train", "--step", "2", "--model", str(root / "s1" / "model"), *d, "--output-dir", str(root / "s2"),
           "--max-steps", "2", "--per-device-train-batch-size", "4", *flags)
    return run


def test_stage1_and_stage2_ran(family):
    from dschat.models.loading import load_tokenizer

    for stage in ("s1", "s2"):
        assert (family["root"] / stage / "model" / "config.json").exists()
    # Actor and reward model share one vocabulary (pad included): stage 3 scores the actor's ids as they are.
    s1, s2 = (load_tokenizer(str(family["root"] / s / "model")) for s in ("s1", "s2"))
    assert s1.get_vocab() == s2.get_vocab() and s1.pad_token_id == s2.pad_token_id != s2.eos_token_id
    ev = read_json(family["root"] / "s2" / "eval.json")
    assert ev["eval_pairs"] > 0 and ev["steps"] == 2
    saved = read_json(family["root"] / "s2" / "model" / "config.json")
    assert saved.get("dtype", saved.get("torch_dtype")) == {"fp32": "float32", "bf16": "bfloat16"}[family["dtype"]]


def test_saved_reward_model_scores_as_hf_does(family):
    """AutoModelForSequenceClassification on the saved folder, padded left or right by its own tokenizer, or one
    row at a time, equals dschat's end score to 1e-5."""
    from transformers import AutoModelForSequenceClassification

    from dschat.config import DataArgs
    from dschat.data import load_phase
    from dschat.models.loading import load_tokenizer

    model_dir = family["root"] / "s2" / "model"
    tok = load_tokenizer(str(model_dir))
    assert tok.pad_token_id != tok.eos_token_id
    pd = load_phase(DataArgs(data=[str(family["data"])], data_split="0,1,0", eval_fraction=0, max_seq_len=96), 2,
                    tok, 0, use_cache=False, log=lambda _: None)
    rows = [r["chosen_input_ids"] for r in pd.train[:6]] + [r["rejected_input_ids"] for r in pd.train[:6]]
    assert all(r[-1] == tok.eos_token_id for r in rows)
    ours = dschat_scores(model_dir, rows)
    for side in ("right", "left"):
        torch.testing.assert_close(hf_scores(model_dir, rows, side), ours, atol=1e-5, rtol=0)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        single = torch.stack([hf(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
    torch.testing.assert_close(single, ours, atol=1e-5, rtol=0)


def test_dschat_eval_reports_what_hf_scores_give(family, tmp_path):
    from dschat.evaluation.reward_model import load_all_pairs
    from dschat.models.loading import load_tokenizer

    model_dir = family["root"] / "s2" / "model"
    out = tmp_path / "m.json"
    dschat("eval", "--step", "2", "--model", str(model_dir), "--data", str(family["data"]), "--max-seq-len", "96",
           "--output", str(out))
    got = json.loads(out.read_text())
    pairs = load_all_pairs([str(family["data"])], load_tokenizer(str(model_dir)), 96).train
    c = hf_scores(model_dir, [p["chosen_input_ids"] for p in pairs], "right").double()
    x = hf_scores(model_dir, [p["rejected_input_ids"] for p in pairs], "right").double()
    assert got["pairs"] == len(pairs)
    assert got["accuracy"] == pytest.approx(((c > x).double() + 0.5 * (c == x).double()).mean().item(), abs=1e-9)
    assert got["chosen_score"] == pytest.approx(c.mean().item(), abs=1e-5)
    assert got["rejected_score"] == pytest.approx(x.mean().item(), abs=1e-5)
    if family["dtype"] == "bf16":  # and in bf16 on the CPU, within bf16's precision
        half = dschat("eval", "--step", "2", "--model", str(model_dir), "--data", str(family["data"]),
                      "--max-seq-len", "96", "--dtype", "bf16")
        assert float(re.search(r"chosen_score: (\S+)", half).group(1)) == pytest.approx(c.mean().item(), abs=0.02)


def test_export_of_the_reward_state_scores_the_same(family, tmp_path):
    model_dir = family["root"] / "s2" / "model"
    dschat("export", "--checkpoint", str(family["root"] / "s2"), "--output", str(tmp_path / "exp"))
    rows = [[*r] for r in _some_rows(model_dir)]
    torch.testing.assert_close(hf_scores(tmp_path / "exp", rows, "right"), dschat_scores(model_dir, rows),
                               atol=1e-5, rtol=0)


def _some_rows(model_dir: Path) -> list[list[int]]:
    from dschat.models.loading import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    texts = ["Hello, my parcel is late.", "谢谢你的帮助！ The refund was cancelled."]
    return [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_stage3_runs(family, algo, tmp_path):
    root = family["root"]
    out = tmp_path / algo
    extra = ["--num-generations", "2", "--per-device-generation-batch-size", "2"] if algo == "grpo" else \
        ["--per-device-generation-batch-size", "2"]
    dschat("train", "--step", "3", "--algo", algo, "--actor-model", str(root / "s1" / "model"),
           "--reward-model", str(root / "s2" / "model"), "--data", str(family["data"]), "--output-dir", str(out),
           "--max-steps", "1", "--per-device-training-batch-size", "2", "--max-prompt-seq-len", "64",
           "--max-answer-seq-len", "8", "--max-eval-rows", "2", "--no-save-final-state", *extra, *COMMON)
    assert (out / "actor" / "config.json").exists()
    ev = read_json(out / "eval.json")
    assert ev["steps"] == 1


def test_chat_answers(family):
    text = dschat("chat", "--model", str(family["root"] / "s1" / "model"), "--prompt", "Hello, my parcel is late.",
                  "--greedy", "--max-new-tokens", "6", "--dtype", family["dtype"])
    assert isinstance(text, str)
