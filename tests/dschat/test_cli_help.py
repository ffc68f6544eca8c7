"""Every command's ``--help`` is quick: built in a fresh interpreter, it imports none of the training stack
(torch, DeepSpeed, transformers), and its own CPU time stays under a second.

The CPU time of the child process (``time.process_time``) is measured rather than the wall clock, so a loaded
machine slows the check without failing it; the wall bound is only there to keep a hung child from hanging the
suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dschat.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "deepspeed", "transformers")
HELP_CPU_SECONDS = 1.0
WALL_SECONDS = 60

# In the child: build the help as `dschat ARGS` would, then report what it printed, what it imported, and its time.
CHILD = f"""
import contextlib, io, json, sys, time
start_cpu = time.process_time()
import click
from dschat.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main.main(args=sys.argv[1:], standalone_mode=False)
    except (SystemExit, click.exceptions.Exit):
        pass
print(json.dumps({{"cpu": time.process_time() - start_cpu, "text": out.getvalue(),
                  "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""

STAGED = [[cmd, "--step", str(step), "--help"] for cmd in ("train", "doctor", "plan") for step in (1, 2, 3)]
PLAIN = [[cmd, "--help"] for cmd in sorted(COMMANDS) if cmd != "train"]
SUBCOMMANDS = [["data", "inspect", "--help"], ["data", "balance", "--help"]]
CASES = [["--help"], *STAGED, *PLAIN, *SUBCOMMANDS]


def _help(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=WALL_SECONDS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", CASES, ids=" ".join)
def test_help_imports_no_training_stack_and_takes_under_a_second(argv):
    got = _help(argv)
    assert "Usage:" in got["text"], got["text"][:500]
    assert got["heavy"] == [], f"dschat {' '.join(argv)} imported {got['heavy']} to show its help"
    assert got["cpu"] < HELP_CPU_SECONDS, f"dschat {' '.join(argv)}: {got['cpu']:.2f} s of CPU for its help"


@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_stage_help_lists_its_own_flags(step):
    """The stage's flags are really there (a help without them would pass the timing for the wrong reason)."""
    text = _help(["train", "--step", str(step), "--help"])["text"]
    own = {1: "--teacher-model", 2: "--rm-loss", 3: "--actor-model"}[step]
    assert own in text and "--output-dir" in text


def _backend_choices(text: str) -> list[str]:
    m = re.search(r"--generation-backend(?:, --generation_backend)? \[([a-z|]+)\]", text)
    assert m, text[:2000]
    return m.group(1).split("|")


@pytest.mark.parametrize("argv, fallback", [(["chat"], "else hf (dschat's loop with --tools or --env)."),
                                            (["judge"], "else hf."),
                                            (["eval"], "else dschat (--judge: hf).")])
def test_sampling_commands_offer_stage_3_s_backends_and_say_what_auto_picks(argv, fallback):
    """--generation-backend is one declaration: the same choices as stage 3's (graph among them), and a help that
    says what auto picks in that command."""
    stage3 = _backend_choices(_help(["train", "--step", "3", "--help"])["text"])
    text = _help([*argv, "--help"])["text"]
    assert "graph" in stage3 and _backend_choices(text) == stage3
    flat = re.sub(r"(\w)- (\w)", r"\1-\2", " ".join(text.split()))  # the help's line breaks undone
    assert "auto = vllm on a GPU where it is installed and runs the model, else graph on a GPU for a " \
           "Llama-architecture model" in flat
    assert fallback in flat


def test_chat_takes_every_agent_flag():
    text = _help(["chat", "--help"])["text"]
    for flag in ("--tools", "--env", "--env-column", "--max-turns", "--tool-timeout", "--tool-max-output"):
        assert f"{flag} " in text or f"{flag}," in text, flag


def test_the_stage_scripts_import_without_the_training_stack():
    """``python stepN/main.py --help`` imports the stage module itself: it declares its flags without torch."""
    code = ("import sys\nimport step1_sft.main, step2_reward.main, step3_rlhf.main\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=WALL_SECONDS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
