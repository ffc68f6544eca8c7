"""Every row's environment is checked before anything trains or samples: a row naming no --env stops stage 3 at
its start, naming the file and line, not at the step that first draws it."""

from __future__ import annotations

import json

import pytest

from dschat.agents.agent import build_agent
from dschat.config import AgentArgs
from dschat.errors import UserError
from tests.helpers import read_jsonl, run_cli

ENVS = '''class Guess:
    def reset(self, row):
        return None

    def step(self, text):
        return None, 1.0, True


class Forever(Guess):
    pass
'''


def _rows(names):
    return [{"extra": {"env": n}, "where": f"rows.jsonl:{i + 1}"} for i, n in enumerate(names)]


def test_a_row_naming_no_environment_is_refused_naming_its_line(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS, encoding="utf-8")
    agent = build_agent(AgentArgs(env=[f"guess={tmp_path / 'envs.py'}:Guess",
                                       f"forever={tmp_path / 'envs.py'}:Forever"]))
    try:
        agent.check_rows(_rows(["guess", "forever", "guess"]))
        with pytest.raises(UserError, match=r"^rows.jsonl:3: data column 'env': 'gues' names no --env "
                                            r"\(environments: guess, forever\)"):
            agent.check_rows(_rows(["guess", "forever", "gues"]))
        with pytest.raises(UserError, match=r"rows.jsonl:1: data column 'env': 'None' names no --env"):
            agent.check_rows([{"extra": {}, "where": "rows.jsonl:1"}])
        with pytest.raises(UserError, match=r"rows.jsonl:1: data column 'env': .* names no --env"):
            agent.check_rows(_rows([["guess"]]))  # not a name at all
    finally:
        agent.close()
    one = build_agent(AgentArgs(env=[f"{tmp_path / 'envs.py'}:Guess"]))
    one.check_rows(_rows(["anything"]))  # one environment serves every row whatever the column says
    one.close()


def test_stage3_stops_at_its_start_on_a_bad_row(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS, encoding="utf-8")
    data = tmp_path / "rows.jsonl"
    names = ["guess" if i % 2 else "forever" for i in range(12)]
    names[9] = "gues"
    data.write_text("".join(json.dumps({"prompt": "guess my number", "answer": "3", "env": n}) + "\n" for n in names))
    out = tmp_path / "out"
    proc = run_cli("train", "--step", "3", "--algo", "grpo", "--actor-model", "tiny", "--data", str(data),
                   "--data-split", "0,0,1", "--env", f"guess={tmp_path / 'envs.py'}:Guess",
                   "--env", f"forever={tmp_path / 'envs.py'}:Forever", "--max-answer-seq-len", "8",
                   "--num-generations", "2", "--per-device-generation-batch-size", "2",
                   "--per-device-training-batch-size", "4", "--max-steps", "4", "--max-eval-rows", "2",
                   "--output-dir", str(out), "--no-progress", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{data}:10: data column 'env': 'gues' names no --env" in proc.stderr
    assert "Traceback" not in proc.stderr
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or not [r for r in read_jsonl(metrics) if "train/actor_loss" in r]
