"""The doctor's model check: every model folder the stage reads, resolved as the stage resolves it and inspected
without loading weights (config.json, remote code, safetensors headers against file sizes, index shards)."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from dschat.doctor.report import ERROR, OK, WARN, Report
from dschat.errors import UserError
from dschat.units import fmt_count


def _model_folders(step: int, cfg: Any) -> list[tuple[str, str, str]]:
    """``(role, flag, name)`` of every model folder the stage reads."""
    if step in (1, 2):
        out = [("model", "--model", cfg.model.model)]
        if step == 1 and cfg.kd.teacher_model:
            out.append(("teacher", "--teacher-model", cfg.kd.teacher_model))
        return out
    from dschat.rewards.names import JUDGE, RM

    names = cfg.reward_func_names()
    out = [("actor", "--actor-model", cfg.actor.model)]
    if RM in names:
        out.append(("reward", "--reward-model", cfg.rewards.reward_model))
    if "critic" in cfg.algorithm.needs(cfg) and cfg.critic.model:
        out.append(("critic", "--critic-model", cfg.critic.model))
    if JUDGE in names:
        out.append(("judge", "--judge-model", cfg.rewards.judge_model))
    return out


def check_models(step: int, cfg: Any, report: Report) -> dict[str, str]:
    """Resolve and inspect each model folder; returns role -> folder for those that resolved."""
    from dschat.models.loading import resolve_model, resolve_saved_model

    paths: dict[str, str] = {}
    for role, flag, name in _model_folders(step, cfg):
        try:
            # the stages resolve a teacher or judge as a saved stage output too (its model/ or actor/)
            path = resolve_saved_model(name) if role in ("teacher", "judge") else resolve_model(name)
        except UserError as e:
            report.add("model", ERROR, f"{flag}: {e}")
            continue
        paths[role] = path
        inspect_model_folder(path, flag, cfg.model.trust_remote_code, report)
    return paths


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the file size it describes (8 + header + data); a ``ValueError``
    says why the header cannot be read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"header length {n} exceeds the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError("header has a tensor without data_offsets") from None
    return header, 8 + n + end


def inspect_model_folder(path: str, flag: str, trust_remote_code: bool, report: Report) -> int:
    """config.json, remote code, and weights complete and whole; returns the parameter count (0 if unknown)."""
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        report.add("model", ERROR, f"{flag} {folder}/config.json does not parse ({e})")
        return 0
    if config.get("auto_map"):
        if trust_remote_code:
            report.add("model", WARN, f"{flag} {folder}: runs Python code shipped with the model (auto_map)")
        else:
            report.add("model", ERROR, f"{flag} {folder}: needs its own Python code (auto_map in config.json) to "
                                       "load; pass --trust-remote-code if you trust that code")
    pad, eos = config.get("pad_token_id"), config.get("eos_token_id")
    if isinstance(pad, int) and (pad == eos or (isinstance(eos, list) and pad in eos)):
        report.add("model", WARN, f"{flag} {folder}/config.json: pad_token_id {pad} is the EOS id; a sequence-"
                                  "classification head pools at the last token that is not pad, so outside dschat "
                                  "it would skip the EOS (dschat names its own pad when it loads the folder)")
    files, problem = weight_files(folder)
    if problem:
        report.add("model", ERROR, f"{flag} {folder}: {problem}")
        return 0
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if bins:
            report.add("model", WARN, f"{flag} {folder}: weights are pickled .bin files ({len(bins)}), not "
                                      "checked here; safetensors are checked without loading")
        else:
            report.add("model", ERROR, f"{flag} {folder}: no weights (*.safetensors or pytorch_model*.bin)")
        return 0
    dtypes: Counter[str] = Counter()
    params = 0
    bad = False
    for file in files:
        try:
            header, expected = read_safetensors_header(file)
        except (OSError, ValueError) as e:
            report.add("model", ERROR, f"{flag} {file}: damaged safetensors ({e}); copy or download it again")
            bad = True
            continue
        size = file.stat().st_size
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            report.add("model", ERROR, f"{flag} {file}: {what}: {size} bytes, the header describes {expected}; "
                                       "copy or download it again")
            bad = True
            continue
        for name, t in header.items():
            if name != "__metadata__":
                n = math.prod(int(d) for d in t.get("shape", []))
                dtypes[str(t.get("dtype"))] += n
                params += n
    if not bad:
        kinds = ", ".join(f"{k} {v / params:.0%}" if len(dtypes) > 1 else k for k, v in dtypes.most_common())
        report.add("model", OK, f"{flag} {folder}: config.json parses; {len(files)} safetensors file(s) whole, "
                                f"{fmt_count(params)} parameters, {kinds}")
    return params


def weight_files(folder: Path) -> tuple[list[Path], str | None]:
    """The safetensors files of a model folder (an index's shards, or the ``*.safetensors`` beside config.json);
    a problem when the index does not parse or lists shards that are missing."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [], f"{index.name} does not parse ({e})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return [], (f"{index.name} lists {len(shards)} shards, {len(missing)} missing ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''})")
        return [folder / s for s in shards], None
    return sorted(folder.glob("*.safetensors")), None


def folder_params(folder: Path) -> int:
    """The parameter count of a folder's safetensors files, from their headers (0 where none reads)."""
    files, problem = weight_files(folder)
    total = 0
    for f in [] if problem else files:
        with contextlib.suppress(OSError, ValueError):
            header, _ = read_safetensors_header(f)
            total += sum(math.prod(int(d) for d in t.get("shape", [])) for k, t in header.items()
                         if k != "__metadata__")
    return total
