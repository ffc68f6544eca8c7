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

    def once(models, hybrid, loader, gen, temperature, seed, scorer, detail, tick):
        seeds.append(seed)
        if tick is not None:
            tick(3)
        return {k: torch.tensor(v) for k, v in per_seed[seed].items()}, {"prompts": [], "completions": []}

    monkeypatch.setattr(evaluation, "_sample_once", once)
    return seeds


def test_several_samples_average_per_prompt_by_hand(monkeypatch, capsys):
    stride = evaluation.SAMPLE_SEED_STRIDE
    per_seed = {
        7: {"scores": [1.0, 2.0, 6.0], "kl": [0.1, 0.2, 0.3], "length": [4.0, 5.0, 6.0], "eos": [1.0, 1.0, 0.0]},
        7 + stride: {"scores": [3.0, 2.0, 0.0], "kl": [0.5, 0.2, 0.1], "length": [2.0, 3.0, 4.0],
                     "eos": [1.0, 0.0, 0.0]},
    }
    seeds = _fake_runs(monkeypatch, per_seed)
    out = evaluation.evaluate(None, None, _Loader(), None, 1.0, 7, None, num_samples=2, progress=True)
    assert seeds == [7, 7 + stride]  # sample j: the batch seeds plus j * stride, as dschat eval --num-samples
    # per prompt: (1+3)/2, (2+2)/2, (6+0)/2 = 2, 2, 3; mean 7/3; std over prompts sqrt(1/3); s.e. std / sqrt(3)
    assert out["scores"] == [2.0, 2.0, 3.0]
    assert out["reward"] == pytest.approx(7 / 3)
    assert out["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert out["reward_se"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))
    # KL, length, EOS: means over all six answers
    assert out["kl"] == pytest.approx(1.4 / 6)
    assert out["answer_length"] == pytest.approx(24 / 6)
    assert out["eos_rate"] == pytest.approx(3 / 6)
    assert out["eval_prompts"] == 3 and out["eval_samples"] == 2
    err = capsys.readouterr().err  # the bar counts this rank's 3 rows x 2 samples
    assert "eval: 100%" in err and "6/6" in err

    # the paired standard error of the gain is over the prompts' means
    after = evaluation.evaluate(None, None, _Loader(), None, 1.0, 7, None, num_samples=2)
    assert evaluation.summarize(out, after)["reward_gain_se"] == 0.0
    assert evaluation.summarize(out, after)["eval_samples"] == 2


def test_one_sample_is_the_run_itself(monkeypatch):
    per_seed = {3: {"scores": [1.0, 4.0], "kl": [], "length": [2.0, 2.0], "eos": [1.0, 1.0]}}
    _fake_runs(monkeypatch, per_seed)
    out = evaluation.evaluate(None, None, _Loader(), None, 1.0, 3, None)
    assert out["scores"] == [1.0, 4.0] and out["kl"] is None and out["eval_prompts"] == 2
    with pytest.raises(ValueError, match="one sample per prompt"):
        evaluation.evaluate(None, None, _Loader(), None, 1.0, 3, None, detail=True, num_samples=2)
