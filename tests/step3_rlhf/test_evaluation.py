"""Stage 3's held-out evaluation with several answers per prompt (``--eval-samples``), worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dschat.rlhf import evaluation


class _Loader:
    """What ``evaluate`` reads of an ``EvalLoader`` besides its batches: this rank's rows."""

    class loader:  # noqa: N801 - stands in for the DataLoader attribute
        dataset = [0, 1, 2]


def _fake_runs(monkeypatch, per_seed):
    """``_sample_once`` returning ``per_seed[seed]`` (a dict of per-prompt lists) and ticking once per prompt."""
    seeds = []

    def once(models, hybrid, loader, gen, temperature, seed, scorer, detail, tick, keep=0):
        seeds.append(seed)
        if tick is not None:
            tick(3)
        return {k: torch.tensor(v) for k, v in per_seed[seed].items()}, {"prompts": [], "completions": []}, []

    monkeypatch.setattr(evaluation, "_sample_once", once)
    return seeds


class _Scorer:
    """What ``evaluate`` reads of a ``Scorer`` besides scoring (done in the faked ``_sample_once``): its sources."""

    class mixer:  # noqa: N801 - stands in for the RewardMixer attribute
        names = ["fmt", "acc"]


def test_several_samples_average_per_prompt_by_hand(monkeypatch, capsys):
    stride = evaluation.SAMPLE_SEED_STRIDE
    before_runs = {
        7: {"scores": [1.0, 2.0, 6.0], "kl": [0.1, 0.2, 0.3], "length": [4.0, 5.0, 6.0], "eos": [1.0, 1.0, 0.0],
            "fmt": [1.0, 1.0, 1.0], "acc": [0.0, 1.0, 5.0]},
        7 + stride: {"scores": [3.0, 2.0, 0.0], "kl": [0.5, 0.2, 0.1], "length": [2.0, 3.0, 4.0],
                     "eos": [1.0, 0.0, 0.0], "fmt": [1.0, 0.0, 0.0], "acc": [2.0, 2.0, 0.0]},
    }
    seeds = _fake_runs(monkeypatch, before_runs)
    before = evaluation.evaluate(None, None, _Loader(), None, 1.0, 7, _Scorer(), num_samples=2, progress=True)
    assert seeds == [7, 7 + stride]  # sample j: the batch seeds plus j * stride, as dschat eval --num-samples
    # per prompt: (1+3)/2, (2+2)/2, (6+0)/2 = 2, 2, 3; mean 7/3; std over prompts sqrt(1/3); s.e. std / sqrt(3)
    assert before["scores"] == [2.0, 2.0, 3.0]
    assert before["reward"] == pytest.approx(7 / 3)
    assert before["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert before["reward_se"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))
    # each source per prompt too: fmt (1+1)/2, (1+0)/2, (1+0)/2; acc (0+2)/2, (1+2)/2, (5+0)/2
    assert before["source_scores"] == {"fmt": [1.0, 0.5, 0.5], "acc": [1.0, 1.5, 2.5]}
    assert before["reward/fmt"] == pytest.approx(2 / 3) and before["reward/acc"] == pytest.approx(5 / 3)
    # KL, length, EOS: means over all six answers
    assert before["kl"] == pytest.approx(1.4 / 6)
    assert before["answer_length"] == pytest.approx(24 / 6)
    assert before["eos_rate"] == pytest.approx(3 / 6)
    assert before["eval_prompts"] == 3 and before["eval_samples"] == 2
    err = capsys.readouterr().err  # a bar of this rank's 3 rows x 2 samples, cleared when done (under training's)
    assert "eval:" in err and "0/6" in err

    after_runs = {7: {**before_runs[7], "scores": [4.0, 1.0, 6.0]},  # prompt means 3, 2, 5 after
                  7 + stride: {**before_runs[7 + stride], "scores": [2.0, 3.0, 4.0]}}
    _fake_runs(monkeypatch, after_runs)
    after = evaluation.evaluate(None, None, _Loader(), None, 1.0, 7, _Scorer(), num_samples=2)
    # gains per prompt 1, 0, 2: mean 1, unbiased std 1, paired s.e. 1 / sqrt(3). Over the six answers instead the
    # differences 3, -1, 0, -1, 1, 4 would give std 2.098 and s.e. 2.098 / sqrt(6) = 0.856, not 0.577.
    summary = evaluation.summarize(before, after)
    assert summary["reward_gain"] == pytest.approx(1.0)
    assert summary["reward_gain_se"] == pytest.approx(1 / math.sqrt(3), rel=1e-6)
    assert summary["eval_samples"] == 2


def test_one_sample_is_the_run_itself(monkeypatch):
    per_seed = {3: {"scores": [1.0, 4.0], "kl": [], "length": [2.0, 2.0], "eos": [1.0, 1.0]}}
    _fake_runs(monkeypatch, per_seed)
    out = evaluation.evaluate(None, None, _Loader(), None, 1.0, 3, None)
    assert out["scores"] == [1.0, 4.0] and out["kl"] is None and out["eval_prompts"] == 2
    with pytest.raises(ValueError, match="one sample per prompt"):
        evaluation.evaluate(None, None, _Loader(), None, 1.0, 3, None, detail=True, num_samples=2)
