"""With ``--env`` and no ``--reward-funcs`` the environments' reward is the default everywhere a policy's answers are
scored: stage 3, ``dschat eval --step 3`` and ``dschat generate`` (``rewards.names.given_or_default``)."""

from __future__ import annotations

import json

from dschat.apps.best_of_n import GenerateConfig
from dschat.config import AgentArgs
from dschat.rewards.names import given_or_default
from tests.helpers import run_cli

ENV = '''class Guess:
    def reset(self, row):
        return None

    def step(self, text):
        return "again", 1.5, True
'''


def test_the_environments_own_the_reward_unless_reward_funcs_are_given():
    assert given_or_default([], ["e.py:Guess"], ["rm"]) == ["env"]
    assert given_or_default(["format"], ["e.py:Guess"], ["rm"]) == ["format"]
    assert given_or_default([], [], ["rm"]) == ["rm"]


def test_eval_and_generate_default_to_the_environments_reward():
    from dschat.apps.saved_policy import reward_sources
    from dschat.rlhf.config import RewardArgs

    assert reward_sources(RewardArgs(), AgentArgs(env=["e.py:Guess"])) == ["env"]
    assert reward_sources(RewardArgs(reward_model="rm/model"), AgentArgs(env=["e.py:Guess"])) == ["env"]
    assert reward_sources(RewardArgs(reward_model="rm/model"), AgentArgs()) == ["rm"]
    cfg = GenerateConfig()
    cfg.agent.env = ["e.py:Guess"]
    assert cfg.reward_func_names() == ["env"]


def test_eval_step3_with_an_environment_and_no_reward_funcs_scores_with_it(tmp_path):
    (tmp_path / "envs.py").write_text(ENV, encoding="utf-8")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "guess my number", "answer": str(i)}) + "\n" for i in range(4)))
    proc = run_cli("eval", "--step", "3", "--model", "tiny", "--data", str(data), "--data-split", "0,0,1",
                   "--eval-fraction", "1", "--env", f"{tmp_path / 'envs.py'}:Guess", "--max-new-tokens", "4",
                   "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rewards:  1*env" in proc.stderr + proc.stdout
