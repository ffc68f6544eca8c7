"""Stage 2 end to end on the tiny preset: the reward model learns, saves as a plain HF sequence classifier that
scores exactly like dschat, trains the same under ZeRO 0 and 3, reads conversational pairs, and `dschat eval`
scores a saved model."""

import json
import math

import pytest
import torch

from dschat.config import OptimArgs, RewardConfig, build_config
from dschat.data import DataCollatorReward
from dschat.demo import demo_data, generate_pairwise
from dschat.demo.corpus import prompt_question
from dschat.training.stage import DEFAULT_LR, TINY_LR, eval_loader, learning_rate
from tests.helpers import read_json, read_jsonl, run_cli
from tests.helpers import run_stage as run


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _reward_run(out, **flags):
    # fp32 everywhere (auto would be bf16 on CUDA), so the tolerances below hold on any device.
    values = {"model": "tiny", "output_dir": str(out), "progress": False, "per_device_train_batch_size": 8,
              "dtype": "fp32", **flags}
    return run(build_config(RewardConfig, values))


def _scores(model_dir, rows):
    """HF logits and dschat end scores of right-padded (chosen..., rejected...) batches of ``rows``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dschat.models.loading import create_reward_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = DataCollatorReward(tok.pad_token_id)(rows)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    ours = create_reward_model(str(model_dir), pad_token_id=tok.pad_token_id).eval()
    with torch.no_grad():
        logits = hf(**batch).logits.squeeze(-1)  # (2B,)
        values = ours(batch["input_ids"], batch["attention_mask"])  # (2B, T)
    return logits, ours.end_scores(values, batch["attention_mask"]), batch


@pytest.fixture(scope="module")
def demo_rows():
    """Tokenized demo pairs of varied lengths, for scoring saved models."""
    from dschat.config import DataArgs
    from dschat.data import load_phase
    from dschat.models.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("tiny"))
    data = load_phase(DataArgs(), 2, tok, 1234, log=lambda _: None, default_data=demo_data)
    return data.eval[:12]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "run"
    metrics = _reward_run(out, max_steps=20, eval_interval=10)
    return out, metrics


def test_learning_rate_rule_for_small_models():
    assert learning_rate(OptimArgs(learning_rate=3e-4), "tiny", 10) == 3e-4  # an explicit rate always wins
    assert learning_rate(OptimArgs(), "tiny") == TINY_LR
    assert learning_rate(OptimArgs(), "/out/step1/model", n_params=1_400_000) == TINY_LR  # step-1 output of tiny
    assert learning_rate(OptimArgs(), "/models/llama", n_params=7_000_000_000) == DEFAULT_LR
    assert learning_rate(OptimArgs(), "/models/llama") == DEFAULT_LR


def test_evaluate_reward_hand_worked():
    """A stand-in model whose value at every token is the token id, so each end score is the last real id."""
    from dschat.evaluation.reward_model import evaluate_reward

    class IdValues(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids.float()

    rows = [  # chosen end 5 vs rejected end 3: win; 4 vs 4: tie; 2 vs 6: loss
        {"chosen_input_ids": [9, 5], "rejected_input_ids": [9, 7, 3]},
        {"chosen_input_ids": [9, 8, 4], "rejected_input_ids": [9, 4]},
        {"chosen_input_ids": [9, 2], "rejected_input_ids": [9, 6]},
    ]
    ev = evaluate_reward(IdValues(), eval_loader(rows, 2, DataCollatorReward(0)))
    assert ev.accuracy == pytest.approx((1 + 0.5 + 0) / 3)  # ties count half
    assert ev.ties == 1 and ev.pairs == 3
    assert ev.chosen_score == pytest.approx((5 + 4 + 2) / 3)
    assert ev.rejected_score == pytest.approx((3 + 4 + 6) / 3)
    assert ev.margin == pytest.approx((2 + 0 - 4) / 3)
    # All six end scores 5, 4, 2, 3, 4, 6: mean 4, population variance (1+0+4+1+0+4)/6 = 10/6.
    assert ev.score_mean == pytest.approx(4.0)
    assert ev.score_std == pytest.approx(math.sqrt(10 / 6))


def test_reward_model_learns(trained):
    out, metrics = trained
    # A fresh v_head is zero: no preference before training.
    assert metrics["accuracy_before"] == 0.5 and metrics["margin_before"] == 0.0
    assert metrics["accuracy"] >= 0.9
    assert metrics["margin"] > 0.5
    assert metrics["chosen_score"] > metrics["rejected_score"]
    assert metrics["train_loss_last"] < metrics["train_loss_first"] - 0.3
    ev = read_json(out / "eval.json")
    for key in ("accuracy", "accuracy_before", "chosen_score", "chosen_score_before", "rejected_score",
                "rejected_score_before", "margin", "margin_before", "train_rows", "eval_rows", "sources"):
        assert key in ev, key
    assert ev["sources"][0]["format"] == "pairwise"
    steps = read_jsonl(out / "metrics.jsonl")
    train = [r for r in steps if "train/loss" in r]
    assert len(train) == 20
    assert all(k in train[0] for k in ("train/accuracy", "train/chosen_score", "train/rejected_score", "train/lr"))
    assert [r["step"] for r in steps if "eval/accuracy" in r] == [0, 10, 20]  # before, --eval-interval, after
    assert read_json(out / "args.json")["rm_loss"] == "pairwise"


def test_saved_model_loads_with_auto_class_and_scores_the_same(trained, demo_rows):
    out, metrics = trained
    logits, ours, batch = _scores(out / "model", demo_rows)
    lengths = batch["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # right padding is really exercised
    torch.testing.assert_close(logits, ours, atol=1e-5, rtol=0)
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["reward_mean"] == pytest.approx(metrics["reward_mean"])
    assert config["reward_std"] == pytest.approx(metrics["reward_std"]) and config["reward_std"] > 0
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "model").num_labels == 1


def test_stats_sample_is_capped_and_spans_the_rows():
    from dschat.evaluation.reward_model import stats_sample

    rows = [{"i": i} for i in range(200)]
    sample = [r["i"] for r in stats_sample(rows, 64)]
    # every 200/64 = 3.125th row: 0, 3, 6, 9, 12, 15, 18, 21, 25, ...; the last is floor(63 * 200 / 64) = 196
    assert len(sample) == 64 == len(set(sample))
    assert sample[:9] == [0, 3, 6, 9, 12, 15, 18, 21, 25] and sample[-1] == 196
    assert [r["i"] for r in stats_sample(rows[:5], 64)] == [0, 1, 2, 3, 4]  # fewer rows than the cap: all


def test_reward_stats_without_eval_rows_come_from_a_small_training_sample(tmp_path, trained):
    """No held-out pairs: reward_mean/std are the saved model's end scores on STATS_PAIRS evenly spaced training
    pairs (one short pass, not --max-eval-rows of them); with held-out pairs, the eval pairs' own scores."""
    from dschat.config import DataArgs
    from dschat.data import load_phase
    from dschat.evaluation.reward_model import STATS_PAIRS, evaluate_reward, stats_sample
    from dschat.models.loading import create_reward_model, load_tokenizer

    _, with_eval = trained
    assert with_eval["reward_stats_pairs"] == with_eval["eval_pairs"] > 0

    out = tmp_path / "noeval"
    metrics = _reward_run(out, max_steps=2, eval_fraction=0.0)
    assert metrics["eval_pairs"] == 0 and metrics["reward_stats_pairs"] == STATS_PAIRS
    tok = load_tokenizer(str(out / "model"))
    rows = load_phase(DataArgs(eval_fraction=0.0), 2, tok, 1234, log=lambda _: None, default_data=demo_data).train
    assert len(rows) > STATS_PAIRS
    rm = create_reward_model(str(out / "model"), pad_token_id=tok.pad_token_id)
    ev = evaluate_reward(rm, eval_loader(stats_sample(rows), 16, DataCollatorReward(tok.pad_token_id)))
    assert metrics["reward_mean"] == pytest.approx(ev.score_mean, abs=1e-5)
    assert metrics["reward_std"] == pytest.approx(ev.score_std, abs=1e-5) and ev.score_std > 0


def test_zero0_and_zero3_train_the_same(tmp_path, demo_rows):
    scores = []
    for stage in (0, 3):
        out = tmp_path / f"z{stage}"
        _reward_run(out, max_steps=5, zero_stage=stage, max_eval_rows=8, seed=7)
        logits, ours, _ = _scores(out / "model", demo_rows)
        torch.testing.assert_close(logits, ours, atol=1e-5, rtol=0)
        scores.append(logits)
    assert scores[0].abs().max() > 1e-3  # the head moved away from its zero init
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=0)


def test_resume_continues_exactly(tmp_path, demo_rows):
    """A run resumed from its step-3 state ends with the same model as the uninterrupted 6-step run."""
    import shutil

    full = tmp_path / "full"
    _reward_run(full, max_steps=6, save_interval=3, max_eval_rows=8)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoints", resumed / "checkpoints")
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-00000006"  # the final state
    (resumed / "checkpoints" / "latest").write_text("step-00000003\n")  # as if killed after step 3
    metrics = _reward_run(resumed, max_steps=6, save_interval=3, max_eval_rows=8, resume=True)
    assert metrics["steps"] == 6
    assert metrics["accuracy_before"] == read_json(full / "eval.json")["accuracy_before"]  # restored, not re-run
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if "train/loss" in r] == [4, 5, 6]
    a, _, _ = _scores(full / "model", demo_rows)
    b, _, _ = _scores(resumed / "model", demo_rows)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_conversational_pairs_train_and_identical_pairs_are_counted(tmp_path):
    rows = []
    for i, r in enumerate(generate_pairwise(160, seed=11)):
        user = {"role": "user", "content": prompt_question(r["prompt"])}
        if i % 2:  # chosen/rejected as whole conversations sharing the prompt messages
            rows.append({"chosen": [user, {"role": "assistant", "content": r["chosen"].strip()}],
                         "rejected": [user, {"role": "assistant", "content": r["rejected"].strip()}],
                         "margin": 1.0})
        else:  # prompt as messages, answers as assistant turns
            rows.append({"prompt": [user], "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
                         "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]})
    same = {"role": "assistant", "content": "好的"}
    rows += [{"prompt": [{"role": "user", "content": f"问题{i}"}], "chosen": [same], "rejected": [same]}
             for i in range(3)]
    path = _write_jsonl(tmp_path / "conv_pairs.jsonl", rows)
    out = tmp_path / "conv"
    metrics = _reward_run(out, data=[str(path)], data_split="0,1,0", eval_fraction=0.1, max_steps=10,
                          rm_loss="last-token", rm_center_coef=0.01)
    ev = read_json(out / "eval.json")
    assert ev["sources"][0]["format"] == "conversational_pairwise"
    assert ev["dropped_identical_pair"] == 3
    assert ev["train_rows"] + ev["eval_rows"] == 160
    assert ev["eval_pairs"] == ev["eval_rows"] > 0
    assert math.isfinite(metrics["train_loss_last"]) and metrics["train_loss_last"] < metrics["train_loss_first"]
    assert metrics["accuracy"] > metrics["accuracy_before"] == 0.5


def test_dschat_eval_step2(trained, tmp_path):
    out, _ = trained
    pairs = generate_pairwise(40, seed=5)
    path = _write_jsonl(tmp_path / "pairs.jsonl", pairs + [{**pairs[0], "rejected": pairs[0]["chosen"]}])
    report = tmp_path / "report.json"
    proc = run_cli("eval", "--step", "2", "--model", str(out), "--data", str(path), "--output", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accuracy:" in proc.stdout and "identical_pair=1" in proc.stdout
    result = read_json(report)
    assert result["pairs"] == 40 and result["dropped_identical_pair"] == 1
    assert result["accuracy"] >= 0.9 and result["margin"] > 0
    assert result["model"] == str(out / "model")

    proc = run_cli("eval", "--step", "2", "--model", str(out), "--data", str(path), "--baseline", str(out))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        "dschat: error: --baseline has no effect with --step 2"


@pytest.mark.slow
def test_two_ranks_zero3_exact_eval_with_uneven_shards(tmp_path):
    """Two CPU ranks under the launcher, ZeRO-3, 9 eval pairs in batches of 2: shards of 5 and 4 pairs give the
    ranks 3 and 2 forward passes (a ZeRO-3 gather would hang without the padding forward), and the summed
    metrics equal one process scoring all 9 pairs."""
    from dschat.config import DataArgs
    from dschat.data import load_phase
    from dschat.evaluation.reward_model import evaluate_reward
    from dschat.models.loading import create_reward_model, load_tokenizer

    out = tmp_path / "z3"
    proc = run_cli("train", "--step", "2", "--num-gpus", "2", "--model", "tiny", "--zero-stage", "3",
                   "--output-dir", str(out), "--max-steps", "4", "--max-eval-rows", "9",
                   "--per-device-eval-batch-size", "2", "--no-progress", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = read_json(out / "eval.json")
    assert ev["eval_pairs"] == 9 and read_json(out / "args.json")["world_size"] == 2

    tok = load_tokenizer(str(out / "model"))
    rows = load_phase(DataArgs(max_eval_rows=9), 2, tok, 1234, log=lambda _: None, default_data=demo_data).eval
    rm = create_reward_model(str(out / "model"), pad_token_id=tok.pad_token_id)
    single = evaluate_reward(rm, eval_loader(rows, 4, DataCollatorReward(tok.pad_token_id)))
    assert single.pairs == 9
    for key in ("accuracy", "chosen_score", "rejected_score", "margin"):
        assert ev[key] == pytest.approx(getattr(single, key), abs=1e-4), key
    assert ev["reward_mean"] == pytest.approx(single.score_mean, abs=1e-4)
    assert ev["reward_std"] == pytest.approx(single.score_std, abs=1e-4)
