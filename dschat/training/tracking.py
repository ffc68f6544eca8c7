"""Run outputs shared by every stage: args.json, metrics.jsonl, TensorBoard, eval.json, a progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from dschat.utils import write_json


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
        return float(v.item())
    return None


class RunTracker:
    """Writes one JSON object per logged step to ``metrics.jsonl`` and the same scalars to TensorBoard.

    Only the main rank writes; other ranks get a tracker that does nothing, so loops need no rank checks.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, total_steps: int, progress: bool = True,
                 desc: str = "train"):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.start = time.time()
        self._tb = None
        self._bar = None
        self._jsonl = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        except ImportError:  # tensorboard is a requirement, but never let logging kill a run
            self._tb = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc=desc, dynamic_ncols=True, file=sys.stderr,
                             mininterval=1.0)

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        from dschat.diskfull import disk_full_guard

        with disk_full_guard("the metrics log", self.dir / "metrics.jsonl"):
            self._log(step, metrics, prefix)

    def _log(self, step: int, metrics: dict[str, Any], prefix: str) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time() - self.start, 3)}
        for k, v in metrics.items():
            s = _scalar(v)
            row[prefix + k] = s if s is not None else v
            if s is not None and self._tb is not None and math.isfinite(s):
                self._tb.add_scalar(prefix + k, s, step)
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._jsonl.flush()

    def advance(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()},
                                      refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def write_eval(output_dir: str | Path, metrics: dict[str, Any]) -> None:
    write_json(Path(output_dir) / "eval.json", metrics)
