"""Resumable training states: every engine (model, optimizer, scheduler), the loop position, RNG states.

Layout under ``<output_dir>/checkpoints/``::

    step-00000040/          one complete state
        <engine>/state/     DeepSpeed checkpoint of each engine (ZeRO shards written by every rank)
        trainer.json        loop position (step, epoch, batch within epoch) and stage extras
        rng-rank<R>.pt      python / numpy / torch (/ cuda) RNG states of each rank, as plain tensors
        tensors.pt          optional extra tensors (e.g. the EMA weights)
        manifest.json       sha256 and size of every file above (``dschat.integrity``)
    latest                  the name of the newest complete state

A state is written into ``.step-N.tmp`` and renamed into place only once every rank has finished writing and
its manifest is written; only then is ``latest`` replaced (atomically). ``kill -9`` at any moment therefore
leaves ``latest`` pointing at a complete state (or absent), never at a half-written one. Older states beyond
``keep`` are removed afterwards. A full disk removes the partial state and stops with one line; the last
complete state stays ``latest``.

Loading checks the manifest first (DeepSpeed's loader unpickles), on every rank's share of the files. Rank 0
decides what exists (the latest state, whether a step was saved) and tells the others, so ranks never act on
different views of the folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dschat import engine as E
from dschat import integrity
from dschat.diskfull import DiskFull, disk_full_error, is_disk_full, remove_quietly
from dschat.errors import UserError
from dschat.models.lora import lora_args_of
from dschat.models.reward_model import RewardModel, hf_model
from dschat.utils import METRICS_FILE, atomic_write_text, read_jsonl_rows, write_jsonl

TAG = "state"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_state(output_dir: str | Path) -> Path | None:
    """The newest complete state, or None."""
    root = checkpoint_root(output_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "trainer.json").exists() else None


def _rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and numbers, so it loads with ``weights_only=True`` (no pickled objects)."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(int(w) for w in words.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _first_problem(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (collective): all ranks then stop together, none hangs."""
    return next((p for p in E.gather_objects(problem) if p), None)


def _hash_shared(folder: Path, files: list[str]) -> dict[str, str]:
    """sha256 of ``files`` (collective): each rank hashes its share of them, everyone gets all digests."""
    mine = integrity.hash_files(folder, files[E.rank():: E.world_size()])
    merged: dict[str, str] = {}
    for part in E.gather_objects(mine):
        merged.update(part)
    return merged


def verify_state(path: Path) -> None:
    """``dschat.integrity.verify_state`` shared between the ranks (collective)."""
    files, problem = integrity.precheck(path)
    problem = _first_problem(problem)
    if problem:
        raise UserError(problem)
    assert files is not None
    problem = integrity.compare(path, files, _hash_shared(path, sorted(files)))
    if problem:
        raise UserError(problem)


class Checkpointer:
    """Saves and restores the complete training state of a stage's engines (collective: call on every rank)."""

    def __init__(self, output_dir: str | Path, engines: dict[str, Any], keep: int = 2, tokenizer: Any = None):
        self.root = checkpoint_root(output_dir)
        self.engines = engines
        self.keep = max(1, keep)
        self.tokenizer = tokenizer  # saved beside each engine's config, so `dschat export` needs nothing else

    def save(self, step: int, trainer: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> Path:
        name = f"step-{step:08d}"
        final = self.root / name
        if E.broadcast_object((final / "trainer.json").exists() if E.is_main() else None):
            # Already complete (Ctrl-C right after a periodic save or a resume): the same step is the same state,
            # and rewriting it would first delete the folder 'latest' may point at.
            return final
        tmp = self.root / f".{name}.tmp"

        def main_writes() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        self._all_or_none(main_writes if E.is_main() else None, tmp)
        self._all_or_none(lambda: self._write(tmp, step, trainer, tensors), tmp)
        files = E.broadcast_object(integrity.state_files(tmp) if E.is_main() else None)
        digests = _hash_shared(tmp, files)

        def publish() -> None:
            atomic_write_text(tmp / integrity.MANIFEST, integrity.manifest_text(tmp, digests))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            atomic_write_text(self.root / "latest", name + "\n")
            self._prune(name)

        self._all_or_none(publish if E.is_main() else None, tmp)
        return final

    def _write(self, tmp: Path, step: int, trainer: dict[str, Any], tensors: dict[str, torch.Tensor] | None) -> None:
        for key, eng in self.engines.items():
            eng.save_checkpoint(str(tmp / key), tag=TAG, save_latest=False)
            if E.is_main():
                write_model_meta(E.unwrap(eng), self.tokenizer, tmp / key / META)
        torch.save(_rng_state(), tmp / f"rng-rank{E.rank()}.pt")
        if E.is_main():
            if tensors is not None:
                torch.save(tensors, tmp / "tensors.pt")
            (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, indent=2, default=float))

    def _all_or_none(self, work: Any, tmp: Path) -> None:
        """Run ``work`` (None: nothing on this rank), then agree across ranks (the barrier of each phase): a
        full disk on any rank removes the partial state and stops every rank with the same line."""
        full = False
        try:
            if work is not None:
                work()
        except Exception as e:  # noqa: BLE001 - only a full disk is translated; others are re-raised below
            if not is_disk_full(e, tmp):
                raise
            full = True
        if not any(E.gather_objects(full)):
            return
        message = None
        if E.is_main():
            remove_quietly([tmp])
            latest = latest_state(self.root.parent)
            kept = (f"the last complete state {latest} is kept (continue from it with --resume)" if latest
                    else "no earlier state existed")
            message = str(disk_full_error("a training state", tmp, kept))
        raise DiskFull(E.broadcast_object(message))

    def _prune(self, newest: str) -> None:
        states = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in states[: -self.keep]:
            if old.name != newest:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def resume_latest(self, log: Any) -> tuple[Path | None, dict[str, Any], dict[str, torch.Tensor]]:
        """Restore the output folder's newest complete state, if any (``load``), and drop the metrics logged past
        it. Returns its path, the trainer state and the extra tensors; ``(None, {}, {})`` when there is none."""
        output_dir = self.root.parent
        path = E.broadcast_object(latest_state(output_dir) if E.is_main() else None)  # rank 0 decides
        if path is None:
            return None, {}, {}
        trainer, tensors = self.load(path)
        truncate_metrics(output_dir, trainer["step"])
        log(f"resumed from {path} (step {trainer['step']})")
        return path, trainer, tensors or {}

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """Restore every engine and this rank's RNG from ``path``; return the trainer state and extra tensors.

        The state's manifest is checked first: DeepSpeed's loader unpickles, so only states dschat wrote load."""
        verify_state(path)
        for key, eng in self.engines.items():
            if not (path / key / TAG).exists():
                raise UserError(f"{path}: the saved state has no engine {key!r}; it was written by another "
                                "configuration")
            eng.load_checkpoint(str(path / key), tag=TAG, load_optimizer_states=True,
                                load_lr_scheduler_states=True)
        rng_file = path / f"rng-rank{E.rank()}.pt"
        if not rng_file.exists():
            raise UserError(f"{path}: no RNG state for rank {E.rank()} (was it saved with another world size?)")
        _set_rng_state(integrity.load_tensors(rng_file))
        trainer = json.loads((path / "trainer.json").read_text())
        tensors = integrity.load_tensors(path / "tensors.pt") if (path / "tensors.pt").exists() else None
        return trainer, tensors


META = "hf"  # per engine: config.json, tokenizer files and dschat.json (what module to rebuild for export)


def write_model_meta(module: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """What ``dschat export`` needs to turn the engine's shards back into a HF folder."""
    folder.mkdir(parents=True, exist_ok=True)
    target, _ = hf_model(module)
    target.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    lora = lora_args_of(module)
    meta = {"kind": "reward" if isinstance(module, RewardModel) else "causal_lm",
            "lora": asdict(lora) if lora is not None else None}
    (folder / "dschat.json").write_text(json.dumps(meta, indent=2))


def truncate_metrics(output_dir: str | Path, step: int) -> None:
    """Drop logged rows past the resumed step (they will be logged again) and any half-written last line, from
    ``metrics.jsonl`` and TensorBoard's events alike (``purge_tensorboard``)."""
    if not E.is_main():
        return
    path = Path(output_dir) / METRICS_FILE
    if path.exists():
        rows, _ = read_jsonl_rows(path)
        write_jsonl([row for row in rows if row.get("step", 0) <= step], path)
    purge_tensorboard(Path(output_dir) / "tensorboard", step)


def purge_tensorboard(folder: Path, step: int) -> None:
    """Abandon TensorBoard's events past ``step`` in ``folder``: a new event file that starts a session at
    ``step + 1`` (the writer's ``purge_step``), which TensorBoard's reader takes as the end of every earlier event
    from that step on. The files stay; what they show is cut as ``metrics.jsonl`` is."""
    if not folder.is_dir():
        return
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # no TensorBoard, so nothing reads the folder
        return
    SummaryWriter(str(folder), purge_step=step + 1).close()
