"""Each reward source has a short, stable label that names its metrics: the function's name (unique when two collide)
or LABEL=SOURCE; a path or URL never lands in a metric name."""

from __future__ import annotations

import pytest

from dschat.errors import UserError
from dschat.rewards.functions import RewardMixer
from dschat.rewards.names import reward_labels, reward_sources, source_label, split_label

REWARD = "def fn(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"


def test_labels_are_short_unique_and_chosen_by_label_equals():
    entries = ["/abs/path/rewards.py:fn", "format", "/other/rewards.py:fn", "mine=/x/rewards.py:fn",
               "http://127.0.0.1:8000/score", "http://127.0.0.1:8001", "rm", "fn=accuracy"]
    # an entry's label never depends on the entries after it, except a LABEL= that claims a name outright
    assert reward_labels(entries) == ["fn_2", "format", "fn_3", "mine", "score", "remote", "rm", "fn"]
    assert reward_labels(entries[:3]) == ["fn", "format", "fn_2"]
    assert reward_sources(entries)[3] == "/x/rewards.py:fn" and reward_sources(entries)[:3] == entries[:3]
    assert split_label("http://h:1/score?a=b") == (None, "http://h:1/score?a=b")  # a URL is never a label
    assert split_label("acc=accuracy") == ("acc", "accuracy")
    assert source_label("rules.py:my-reward") == "my-reward"
    with pytest.raises(UserError, match="--reward-funcs gives the label a to two sources"):
        reward_labels(["a=format", "a=accuracy"])


def test_the_mixer_names_values_by_label_and_calls_by_source(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARD)
    sources = [f"{path}:fn", "rm"]
    mixer = RewardMixer(sources, [1.0, 2.0], labels=reward_labels(sources))
    out = mixer(["p", "p"], ["ab", "abcd"], external={"rm": [0.5, 1.0]})
    assert sorted(out.per_func) == ["fn", "rm"]  # no path in a metric name
    assert out.per_func["fn"].tolist() == [2.0, 4.0]
    assert out.total.tolist() == [2.0 + 2 * 0.5, 4.0 + 2 * 1.0]
    assert mixer.external == ["rm"]


def test_stage3_labels_its_reward_metrics(tmp_path):
    """The stage-3 config strips the labels for every check that reads sources; the scorer names by label."""
    from dschat.config import build_config
    from dschat.rlhf.config import RLHFConfig
    from dschat.rlhf.scoring import build_scorer

    path = tmp_path / "rewards.py"
    path.write_text(REWARD)
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny",
                                    "reward_funcs": [f"{path}:fn", f"len={path}:fn", "format"]})
    assert cfg.reward_func_names() == [f"{path}:fn", f"{path}:fn", "format"]
    with pytest.raises(UserError, match="lists a function twice"):  # the same source twice stays refused
        build_scorer(cfg, None)
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny",
                                    "reward_funcs": [f"len={path}:fn", "format"]})
    scorer = build_scorer(cfg, None)
    assert scorer.mixer.names == ["len", "format"] and scorer.mixer.sources == [f"{path}:fn", "format"]
