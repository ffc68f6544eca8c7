"""`dschat report`: PNGs and one self-contained page from output folders (synthetic ones, written here), a
pipeline's folder, a comparison, a running job's folder; the pipeline draws it and never fails on it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dschat.errors import UserError
from dschat.training.report import PLOTS, key_figures, read_jsonl_rows, sections_of, write_report
from tests.helpers import run_cli

STOP_RGB, WARN_RGB = (0xD5, 0x5E, 0x00), (0xE6, 0x9F, 0x00)  # ACTION_COLOURS["stop"], ["warn"]


def _rows(steps: int, seed: float = 0.0, grad_key: str = "train/actor_grad_norm") -> list[dict]:
    rows = [{"step": 0, "time": 0.1, "eval/reward": 1.0 + seed, "eval/reward_se": 0.1, "eval/kl": 0.0,
             "eval/answer_length": 20.0, "eval/eos_rate": 1.0, "eval/reward/format": 0.4}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "time": 0.5 * s, "train/reward": 1.0 + seed + s / steps + 0.2 * math.sin(s),
                     "train/kl": 0.01 * s, "train/entropy": 2.0 - s / steps, "train/answer_length": 20 + s % 7,
                     "train/eos_rate": 1.0 - 0.002 * s, grad_key: 1.0 + (30.0 if s == steps // 2 else 0.1 * (s % 3)),
                     "train/critic_grad_norm": 0.5, "train/actor_loss": 0.01 * math.cos(s), "train/critic_loss":
                     3.0 / s, "train/reward/format": 0.4 + 0.4 * s / steps, "train/lr": 1e-4,
                     "train/kl_unused_string": "n/a"})
    rows.append({"step": steps, "time": 0.5 * steps + 1, "eval/reward": 1.8 + seed, "eval/reward_se": 0.08,
                 "eval/kl": 0.9, "eval/answer_length": 24.0, "eval/eos_rate": 0.95, "eval/reward/format": 0.8})
    return rows


def make_rl_run(folder: Path, steps: int = 40, seed: float = 0.0, finished: bool = True, alarms: bool = True,
                half_line: bool = False) -> Path:
    """A stage-3 output folder as a run leaves it: metrics.jsonl, args.json, eval.json, health.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in _rows(steps, seed))
    if half_line:  # a running job: its last line is being written
        text += '{"step": 41, "time": 20.9, "train/rew'
    (folder / "metrics.jsonl").write_text(text)
    (folder / "args.json").write_text(json.dumps({"stage": "step3_rlhf", "algo": "grpo"}))
    if finished:
        (folder / "eval.json").write_text(json.dumps({
            "algo": "grpo", "reward_before": 1.0 + seed, "reward_after": 1.8 + seed, "reward_before_se": 0.1,
            "reward_after_se": 0.08, "reward_gain": 0.8, "reward_gain_se": 0.07, "kl_before": 0.0, "kl_after": 0.9,
            "reward_funcs": ["format"], "reward_format_before": 0.4, "reward_format_after": 0.8,
            "reward_format_gain_se": 0.05, "steps": steps, "sources": [{"name": "x.jsonl", "rows": 3}]}))
    if alarms:
        (folder / "health.jsonl").write_text("".join(json.dumps(a) + "\n" for a in [
            {"step": steps // 2, "check": "grad_spike", "metric": "train/actor_grad_norm", "value": 31.0,
             "threshold": 10.0, "action": "stop", "message": "gradient norm 30x its running median", "since": 10},
            {"step": steps // 4, "check": "kl_max", "metric": "train/kl", "value": 0.1, "threshold": 0.05,
             "action": "warn", "message": "KL to the reference above its ceiling", "since": 10},
        ]))
    return folder


def make_pipeline(folder: Path) -> Path:
    """A finished `dschat pipeline all` folder: stages 1 and 2 with their metrics, stage 3 as above."""
    sft = folder / "step1_sft"
    sft.mkdir(parents=True)
    rows = [{"step": 0, "time": 0.1, "eval/perplexity": 4000.0, "eval/loss": 8.3}]
    rows += [{"step": s, "time": s, "train/loss": 8.3 * math.exp(-s / 10) + 1, "train/lr": 1e-3} for s in range(1, 31)]
    rows += [{"step": 30, "time": 31, "eval/perplexity": 9.0, "eval/loss": 2.2}]
    (sft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (sft / "eval.json").write_text(json.dumps({"perplexity": 9.0, "perplexity_before": 4000.0, "steps": 30}))
    rm = folder / "step2_reward"
    rm.mkdir()
    rows = [{"step": s, "time": s, "train/loss": 0.7 / s, "train/accuracy": min(1.0, 0.5 + s / 20),
             "train/chosen_score": s / 5, "train/rejected_score": -s / 5} for s in range(1, 21)]
    rows += [{"step": 20, "time": 21, "eval/accuracy": 1.0, "eval/chosen_score": 4.0, "eval/rejected_score": -4.0,
              "eval/margin": 8.0}]
    (rm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rm / "eval.json").write_text(json.dumps({"accuracy": 1.0, "accuracy_before": 0.5, "steps": 20}))
    make_rl_run(folder / "step3_rlhf")
    (folder / "pipeline.json").write_text(json.dumps({"seconds": {"sft": 5.0, "rm": 4.0, "ppo": 9.0}}))
    return folder


def colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 20) or [])


def has_colour(png: Path, rgb: tuple[int, int, int], tol: int = 24, min_pixels: int = 40) -> bool:
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        pixels = np.asarray(im.convert("RGB"), dtype=int)
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tol).sum()) >= min_pixels


def assert_self_contained(page: Path, pngs: int) -> str:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "<script" not in text.lower() and "<link" not in text.lower() and "@import" not in text
    sources = re.findall(r'<img[^>]*src="([^"]*)"', text)
    assert len(sources) == pngs and all(s.startswith("data:image/png;base64,") for s in sources)
    return text


def test_report_of_a_stage_folder_draws_each_plot_with_its_alarms(tmp_path):
    run = make_rl_run(tmp_path / "grpo")
    page = write_report([run])
    assert page == run / "report" / "report.html"
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    assert pngs == sorted(["actor_loss.png", "answer_length.png", "critic_loss.png", "entropy.png", "eos_rate.png",
                           "grad_norm.png", "kl.png", "lr.png", "reward.png", "reward_before_after.png",
                           "reward_sources.png"])
    for name in pngs:
        png = run / "report" / name
        assert png.stat().st_size > 8000 and colours(png) > 50, name
    # the stop alarm (grad_spike on train/actor_grad_norm) is marked on the grad-norm plot, not on the KL plot,
    # which carries the kl_max warning instead
    assert has_colour(run / "report" / "grad_norm.png", STOP_RGB)
    assert not has_colour(run / "report" / "kl.png", STOP_RGB) and has_colour(run / "report" / "kl.png", WARN_RGB)
    assert not has_colour(run / "report" / "reward.png", WARN_RGB)
    text = assert_self_contained(page, len(pngs))
    assert "grad_spike" in text and "gradient norm 30x its running median" in text and "kl_max" in text
    assert "Final figures (eval.json)" in text and "1 ± 0.1 → 1.8 ± 0.08 (gain +0.8 ± 0.07)" in text
    assert "x.jsonl" not in text  # the data sources' records stay out of the table


def test_a_running_jobs_folder_half_written_line_and_no_eval_json(tmp_path):
    run = make_rl_run(tmp_path / "running", finished=False, alarms=False, half_line=True)
    rows, bad = read_jsonl_rows(run / "metrics.jsonl")
    assert bad == 1 and rows[-1]["step"] == 40
    page = write_report([run], tmp_path / "pictures")
    text = assert_self_contained(page, len(list((tmp_path / "pictures").glob("*.png"))))
    assert "1 unreadable line(s)" in text and "no eval.json" in text and "Final figures" not in text
    assert not (tmp_path / "pictures" / "reward_before_after.png").exists()  # no eval.json: no bars
    assert (tmp_path / "pictures" / "reward.png").exists()


def test_a_resumed_runs_repeated_steps_keep_the_later_values_and_nan_is_a_gap(tmp_path):
    run = tmp_path / "resumed"
    run.mkdir()
    lines = [{"step": s, "time": s, "train/loss": 5.0} for s in range(1, 6)]
    lines += [{"step": s, "time": s, "train/loss": 1.0} for s in range(4, 8)]  # resumed from the state of step 3
    lines += [{"step": 8, "time": 8, "train/loss": float("nan")}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    [section] = sections_of([run])
    loss = section.runs[0].series["train/loss"]
    assert [loss[s] for s in range(1, 8)] == [5.0] * 3 + [1.0] * 4 and math.isnan(loss[8])
    text = write_report([run]).read_text()
    assert "1 non-finite value(s)" in text


@pytest.fixture(scope="module")
def pipeline_report(tmp_path_factory) -> Path:
    """The page of a synthetic pipeline folder (drawn once for the tests that read it)."""
    return write_report([make_pipeline(tmp_path_factory.mktemp("report") / "pipe")])


def test_a_pipeline_folder_has_a_section_per_stage(pipeline_report):
    page = pipeline_report
    out = page.parent
    assert out.name == "report" and (out.parent / "pipeline.json").exists()
    assert (out / "step1_sft" / "perplexity.png").exists() and (out / "step1_sft" / "loss.png").exists()
    assert (out / "step2_reward" / "accuracy.png").exists() and (out / "step2_reward" / "scores.png").exists()
    assert (out / "step3_rlhf" / "reward_before_after.png").exists()
    text = assert_self_contained(page, len(list(out.rglob("*.png"))))
    assert [m for m in re.findall(r"<h2>(.*?)</h2>", text)] == ["step1_sft", "step2_reward", "step3_rlhf"]
    assert "sft 5s, rm 4s, ppo 9s" in text and "4000 → 9" in text and "0.5 → 1" in text


def test_several_folders_are_compared_one_line_per_folder(tmp_path):
    a = make_rl_run(tmp_path / "a" / "step3_rlhf")
    b = make_rl_run(tmp_path / "b" / "step3_rlhf", seed=0.5, alarms=False)
    with pytest.raises(UserError, match="needs --out"):
        write_report([a, b])
    [section] = sections_of([a, b])
    assert [r.label for r in section.runs] == ["a/step3_rlhf", "b/step3_rlhf"]  # the same name told apart
    page = write_report([a, b], tmp_path / "cmp")
    text = assert_self_contained(page, len(list((tmp_path / "cmp").glob("*.png"))))
    assert text.count("<th>a/step3_rlhf</th>") == 1 and "<th>b/step3_rlhf</th>" in text  # the figures' columns
    assert (tmp_path / "cmp" / "reward.png").stat().st_size > 8000 and not (a / "report").exists()
    # pipelines against pipelines: a section per stage either holds
    p, q = make_pipeline(tmp_path / "p"), make_pipeline(tmp_path / "q")
    shutil.rmtree(q / "step2_reward")
    sections = sections_of([p, q])
    assert [(s.title, [r.label for r in s.runs]) for s in sections] == [
        ("step1_sft", ["p", "q"]), ("step2_reward", ["p"]), ("step3_rlhf", ["p", "q"])]
    with pytest.raises(UserError, match="not both"):
        sections_of([p, a])


def test_user_mistakes_are_one_line_errors_naming_the_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=f"{empty}: no metrics.jsonl"):
        write_report([empty])
    with pytest.raises(UserError, match="no such folder"):
        write_report([tmp_path / "absent"])
    proc = run_cli("report", str(empty), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith(f"dschat: error: {empty}: no metrics.jsonl")
    run = make_rl_run(tmp_path / "ok", alarms=False)
    proc = run_cli("report", str(run), "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"report: {tmp_path / 'o' / 'report.html'}"


def test_key_figures_pairs_before_and_after():
    figures = dict(key_figures({"perplexity": 9.0, "perplexity_before": 4155.9, "reward_before": 3.6,
                                "reward_after": 4.28, "reward_before_se": 0.14, "reward_after_se": 0.08,
                                "reward_gain_se": 0.135, "loss_type": "grpo", "reward_funcs": ["format", "accuracy"],
                                "alarms": [{"step": 3}], "nothing": [], "flag": True}))
    assert figures == {"perplexity": "4156 → 9", "reward": "3.6 ± 0.14 → 4.28 ± 0.08 (gain +0.68 ± 0.135)",
                       "loss_type": "grpo", "reward_funcs": "format, accuracy", "flag": "True"}
    assert {p.name for p in PLOTS} >= {"loss", "reward", "kl", "entropy", "answer_length", "eos_rate", "grad_norm",
                                       "accuracy", "scores", "perplexity"}


def test_a_standard_error_has_one_spelling():
    """``<x>_before_se``/``<x>_after_se`` only: the other order is not read as the pair's error, so a writer that
    drifts to it shows at once (its key stands alone among the scalars)."""
    figures = dict(key_figures({"reward_before": 3.6, "reward_after": 4.28, "reward_se_before": 0.14}))
    assert figures == {"reward": "3.6 → 4.28", "reward_se_before": "0.14"}


def test_the_pipeline_draws_the_report_and_never_fails_on_it(tmp_path, monkeypatch):
    from dschat.training import pipeline

    pipe = make_pipeline(tmp_path / "pipe")
    for stage in ("step2_reward", "step3_rlhf"):  # one stage is enough, and quicker to draw
        shutil.rmtree(pipe / stage)
    lines: list[str] = []
    run = pipeline.PipelineRun(names=["sft"], out=pipe)
    report = pipeline.run_pipeline(run, lines.append)  # the stage finished: skipped, then reported and drawn
    assert report["sft_perplexity"] == 9.0 and run.pictures == pipe / "report" / "report.html"
    assert (pipe / "report" / "step1_sft" / "loss.png").exists() and lines[-1].endswith("report.html")

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(pipeline, "write_report", broken)
    lines.clear()
    run = pipeline.PipelineRun(names=["sft"], out=pipe)
    assert pipeline.run_pipeline(run, lines.append)["sft_perplexity"] == 9.0 and run.pictures is None
    assert lines[-1] == "[pipeline] report not written: RuntimeError: no fonts"


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium(tmp_path, pipeline_report):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (CI installs it: apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    page = pipeline_report
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
                    page.resolve().as_uri()], capture_output=True, timeout=120, check=False,
                   env={**os.environ, "HOME": str(tmp_path)})
    assert shot.exists(), "chromium wrote no screenshot"
    from PIL import Image

    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        assert rgb.size == (1200, 2000)
        small = rgb.resize((300, 500))
        non_white = sum(1 for p in small.getdata() if min(p) < 235) / (300 * 500)
        distinct = len(rgb.getcolors(maxcolors=1 << 20) or [])
    assert non_white > 0.05 and distinct > 200, (non_white, distinct)  # text, tables and plots, not a blank page
