"""Nothing user-supplied is unpickled (docs/operations.md, Security). A pickle planted in a training state is
refused before any loader sees it (the state's sha256 manifest); the tokenized-data cache is JSON, so a planted
pickle there is never loaded at all."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dschat import integrity
from dschat.errors import UserError
from tests.helpers import read_jsonl, run_cli
from tests.reliability.conftest import TRAIN, Evil, fresh_copy, one_line_error


def plant(state_file, marker):
    torch.save({"module": Evil(marker)}, state_file)


def latest(out):
    return (out / "checkpoints" / "latest").read_text().strip()


def test_export_refuses_a_planted_pickle(trained, tmp_path):
    out = fresh_copy(trained, tmp_path / "run")
    marker = tmp_path / "PWNED"
    target = out / "checkpoints" / latest(out) / "model" / "state" / "mp_rank_00_model_states.pt"
    plant(target, marker)
    proc = run_cli("export", "--checkpoint", str(out), "--output", str(tmp_path / "exported"))
    one_line_error(proc, str(target), "manifest", "refusing to load")
    assert not marker.exists() and not (tmp_path / "exported").exists()


def test_resume_refuses_a_planted_pickle(trained, tmp_path, small_data):
    out = fresh_copy(trained, tmp_path / "run")
    marker = tmp_path / "PWNED"
    before = latest(out)
    target = out / "checkpoints" / before / "rng-rank0.pt"
    plant(target, marker)
    metrics = (out / "metrics.jsonl").read_text()
    proc = run_cli(*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "3", "--resume")
    one_line_error(proc, str(target), "manifest")
    assert not marker.exists()
    assert latest(out) == before and (out / "metrics.jsonl").read_text() == metrics  # last good state as it was


def test_a_state_without_manifest_is_refused(trained, tmp_path):
    out = fresh_copy(trained, tmp_path / "run")
    (out / "checkpoints" / latest(out) / integrity.MANIFEST).unlink()
    proc = run_cli("export", "--checkpoint", str(out), "--output", str(tmp_path / "exported"))
    one_line_error(proc, "no manifest.json")


def test_a_planted_data_cache_runs_no_code(trained, tmp_path, small_data):
    cache = fresh_copy(trained.parent / "cache", tmp_path / "cache")
    marker = tmp_path / "PWNED"
    names = [p.name for p in cache.iterdir()]
    assert names and all(n.endswith(".json") for n in names), names
    for name in names:  # a pickle under the cache's own name, and under the name older versions loaded
        plant(cache / name, marker)
        plant(cache / name.replace(".json", ".pt"), marker)
    out = tmp_path / "run"
    proc = run_cli(*TRAIN, "--data", str(small_data), "--output-dir", str(out), "--max-steps", "1",
                   "--data-cache-dir", str(cache), "--no-save-final-state")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not marker.exists()
    assert "from cache" not in proc.stderr  # the planted file was not read as a cache; rebuilt
    assert json.loads((cache / names[0]).read_text())["phase"] == 1
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [1]


def test_manifest_catches_every_kind_of_change(trained, tmp_path):
    state = fresh_copy(trained / "checkpoints" / latest(trained), tmp_path / "state")
    integrity.verify_state(state)  # as written
    (state / "extra.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="not in the state's manifest"):
        integrity.verify_state(state)
    (state / "extra.pt").unlink()
    trainer = state / "trainer.json"
    text = trainer.read_text()
    trainer.write_text(text.replace('"step": 2', '"step": 9'))  # same size, other content
    with pytest.raises(UserError, match="sha256 differs"):
        integrity.verify_state(state)
    trainer.write_text(text + " ")
    with pytest.raises(UserError, match="bytes where the state's manifest.json says"):
        integrity.verify_state(state)
    trainer.unlink()
    with pytest.raises(UserError, match="missing"):
        integrity.verify_state(state)


def test_own_tensor_files_load_without_pickles(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"a": torch.ones(2), "n": [1, 2.0, None, "x"]}, path)
    assert integrity.load_tensors(path)["n"] == [1, 2.0, None, "x"]
    plant(path, tmp_path / "PWNED")
    with pytest.raises(UserError, match="refusing to unpickle"):
        integrity.load_tensors(path)
    assert not (tmp_path / "PWNED").exists()


def test_rng_state_round_trips_without_pickles(tmp_path):
    import random

    import numpy as np

    from dschat.training.resume import _rng_state, _set_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    torch.save(_rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.standard_normal(), torch.rand(1).item())
    shutil.copy(tmp_path / "rng.pt", tmp_path / "again.pt")
    _set_rng_state(integrity.load_tensors(tmp_path / "again.pt"))
    assert (random.random(), np.random.standard_normal(), torch.rand(1).item()) == want
