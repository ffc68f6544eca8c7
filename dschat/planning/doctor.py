"""``dschat doctor``: check a planned run without training (docs/doctor.md).

``run_doctor(step, values, ...)`` takes a stage's flags as ``dschat train --step N`` would receive them (flat
``{flag name: value}``, only the flags given) and returns one ``Finding`` per check: the flags as the stage
validates them, the model folders (read as JSON and safetensors headers, no weights loaded), the tokenizer (pad
against EOS and BOS, the chat template's round trip), the data as the stage would tokenize it (formats, drops,
over-long prompts, a length histogram), the memory plan, the output folder (writable, free space, a live lock,
an earlier run) and the launcher (hostfile, hosts, master port, versions). Severity is ``ok``, ``warn`` or
``error``; a run with an error would fail or train on something other than what was meant.

The checks reuse the functions the stages run (``build_config``, ``refuse_inert``, ``load_phase``,
``render_turns``, ``tokenize_examples``, ``ensure_distinct_pad``), so they measure what the stage would do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.metadata
import ipaddress
import json
import math
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dschat.config import build_config, refuse_inert
from dschat.diskfull import human_bytes
from dschat.errors import UserError
from dschat.training.lock import holder_alive

__all__ = ["ERROR", "OK", "WARN", "Finding", "histogram", "inspect_model_folder", "local_versions", "output_folder",
           "parse_hostfile", "read_safetensors_header", "run_doctor"]

OK, WARN, ERROR = "ok", "warn", "error"

#: A share of rows dropped as too long, or of prompts cut to --max-prompt-seq-len, above which the data check warns.
LONG_SHARE = 0.10
#: Bytes per trained parameter in one resumable state when no plan gives the size: fp32 master weights and two
#: Adam moments (12) plus the engine's own copy of the weights (up to 4).
STATE_BYTES_PER_PARAM = 16
SSH_PORT = 22
SAFETENSORS_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                        "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
# The conversation the chat template is checked on when the data has none: a system turn, an earlier assistant
# turn holding reasoning (which some templates drop once the conversation goes on), and a final answer.
PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>2 plus 3 is 5.</think><answer>5</answer>"},
    {"role": "user", "content": "And 4 + 4?"},
]
PROBE_ANSWER = "<think>4 plus 4 is 8.</think><answer>8</answer>"


@dataclass
class Finding:
    """One line of the doctor's report: which check, how bad (``ok``, ``warn``, ``error``), and what it found."""

    check: str
    severity: str
    message: str


class Report:
    """The findings so far, added by check name."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(self, check: str, severity: str, message: str) -> None:
        self.findings.append(Finding(check, severity, message))


def run_doctor(step: int, values: dict[str, Any], *, hostfile: str | None = None, master_port: int | None = None,
               num_gpus: int | None = None, nodes: int | None = None, gpu_memory: int | None = None,
               gpu: str | None = None, default_data: Callable[[str], Sequence[str]] | None = None,
               connect_timeout: float = 3.0) -> list[Finding]:
    """Check a planned run of stage ``step`` with the flags ``values`` (flat, as given: defaults are not
    flags given) and the launcher's settings; nothing is trained and no weights are loaded.

    ``default_data(kind)`` gives ``--data`` when none is given (the stage mains pass the demo corpus; ``kind`` is
    ``pairwise`` for stages 1 and 2, the algorithm's demo file for stage 3). ``connect_timeout`` bounds each
    network probe of a hostfile's hosts. Returns the findings in report order.
    """
    report = Report()
    cfg = _check_flags(step, values, report)
    if cfg is not None:
        paths = _check_models(step, cfg, report)
        main = paths.get("actor" if step == 3 else "model")
        tokenizer = _check_tokenizer(main, cfg.model.trust_remote_code, report) if main else None
        if step == 3 and paths.get("reward") and paths.get("reward") != main:
            _check_tokenizer(paths["reward"], cfg.model.trust_remote_code, report, who="reward model ")
        formats: list[str] = []
        if tokenizer is not None:
            formats = _check_data(step, cfg, tokenizer, default_data, report)
            _check_template(tokenizer, formats, report)
        if hostfile and nodes is None:
            with contextlib.suppress(UserError, OSError):
                nodes = len(parse_hostfile(hostfile))
        plan = _check_plan(step, values, report, num_gpus=num_gpus, nodes=nodes, gpu_memory=gpu_memory, gpu=gpu)
        _check_output(step, cfg, report, plan, paths)
    _check_launcher(report, hostfile, master_port, connect_timeout)
    return report.findings


# ------------------------------------------------------------------------------------------------ flags
def _check_flags(step: int, values: dict[str, Any], report: Report) -> Any:
    """The checks ``dschat train`` makes before anything loads: types and ranges (``build_config``), flags with no
    effect in the chosen mode (``refuse_inert``), stage 3's combinations (``check_config``) and the trackers."""
    from dschat.planning.plan import config_class

    try:
        cfg = build_config(config_class(step), values)
        refuse_inert(cfg, set(values))
        if step == 3:
            from dschat.rlhf.config import check_config

            check_config(cfg)
        from dschat.training.sinks import tracker_problem

        problem = tracker_problem(cfg.run.report_to, output_folder(step, cfg))
        if problem:
            raise UserError(problem)
    except UserError as e:
        report.add("flags", ERROR, str(e))
        return None
    given = ", ".join("--" + k.replace("_", "-") for k in sorted(values)) or "none (all defaults)"
    report.add("flags", OK, f"stage {step} flags accepted; given: {given}")
    return cfg


# ------------------------------------------------------------------------------------------------ models
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


def _check_models(step: int, cfg: Any, report: Report) -> dict[str, str]:
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
    files, problem = _weight_files(folder)
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
                                f"{_count(params)} parameters, {kinds}")
    return params


def _weight_files(folder: Path) -> tuple[list[Path], str | None]:
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


# ------------------------------------------------------------------------------------------------ tokenizer
def _check_tokenizer(path: str, trust_remote_code: bool, report: Report, who: str = "") -> Any:
    """The folder's tokenizer as saved, then as dschat pads with it (``ensure_distinct_pad``); findings on EOS, pad
    and BOS. Returns dschat's tokenizer, or None when it does not load."""
    from transformers import AutoTokenizer

    from dschat.models.loading import ensure_distinct_pad

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loader failure is the folder's
        report.add("tokenizer", ERROR, f"{path}: {who}tokenizer does not load ({str(e).strip().splitlines()[0][:200]})")
        return None
    eos, bos, pad = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id
    if eos is None:
        report.add("tokenizer", ERROR, f"{path}: {who}tokenizer has no EOS token, so no answer can end; set "
                                       "eos_token in its tokenizer_config.json")
        return None
    n_before = len(tok)
    ensure_distinct_pad(tok)
    grew = len(tok) > n_before
    grown = ", a new token: the embedding grows by a row" if grew else ""
    if pad is None:
        report.add("tokenizer", OK, f"{who}tokenizer has no pad token; dschat pads with {tok.pad_token!r} (id "
                                    f"{tok.pad_token_id}){grown}")
    elif pad == eos:
        report.add("tokenizer", WARN, f"{path}: {who}tokenizer's pad is its EOS ({tok.eos_token!r}, id {eos}): a "
                                      "trainer that pads with it masks the EOS as padding and the model never learns "
                                      f"to stop; dschat pads with {tok.pad_token!r} (id {tok.pad_token_id}) instead"
                                      f"{grown} and saves that, but other tools reading this folder pad with EOS")
    elif pad == bos:
        report.add("tokenizer", WARN, f"{path}: {who}tokenizer's pad is its BOS ({tok.bos_token!r}, id {bos}): "
                                      "padding and the start of every sequence look alike to anything that finds "
                                      "padding by id rather than by the attention mask")
    else:
        report.add("tokenizer", OK, f"{who}pad {tok.pad_token!r} ({pad}), EOS {tok.eos_token!r} ({eos}), BOS "
                                    f"{tok.bos_token!r} ({bos}): distinct")
    return tok


def _check_template(tok: Any, formats: list[str], report: Report) -> None:
    """Whether the chat template renders a conversation at once as the stage renders it turn by turn: the text
    (``render_turns``: every earlier turn unchanged once the conversation goes on) and the token ids (the whole
    conversation's ids equal the concatenation of its spans' ids, as stage 1 builds and masks them)."""
    from dschat.config import DataArgs
    from dschat.data.formats import PAIRWISE, Example, has_chat_template, render_turns
    from dschat.data.phases import tokenize_examples
    from dschat.data.usertext import encode_texts, single_bos

    if not has_chat_template(tok):
        report.add("template", OK, "no chat template: message rows use the plain Human/Assistant template")
        return
    # Only text pairwise rows never meet the template; with those alone a broken template is not used.
    used = any(f != PAIRWISE for f in formats)
    bad = ERROR if used else WARN
    unused = "" if used else " (this data renders no messages with it)"
    prompt, whole, failure = PROBE_CONVERSATION, "", ""
    for attempt in (PROBE_CONVERSATION, PROBE_CONVERSATION[1:]):  # some templates refuse a system turn
        try:
            whole = tok.apply_chat_template(attempt + [{"role": "assistant", "content": PROBE_ANSWER}],
                                            tokenize=False)
            prompt = attempt
            break
        except Exception as e:  # noqa: BLE001 - a template raising (jinja's raise_exception) is its own finding
            failure = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    else:
        report.add("template", bad, f"the chat template fails to render a conversation ({failure}){unused}")
        return
    if render_turns(prompt, tok) is None:
        where = _rewritten_turn(prompt, tok)
        report.add("template", bad, "the chat template does not round-trip multi-turn rows: rendering the whole "
                                    f"conversation differs from rendering it turn by turn ({where}); stage 1 then "
                                    f"trains only the last answer of such rows (multi_turn_last_only){unused}")
        return
    counts: Counter[str] = Counter()
    rows = tokenize_examples([Example(list(prompt), chosen=PROBE_ANSWER, train_all_turns=True)], 1, tok,
                             DataArgs(max_seq_len=10**9), counts)
    staged = rows[0]["input_ids"] if rows else []
    parts: list[str | None] = [m["content"] for m in prompt] + [PROBE_ANSWER]
    # The stage ends every answer with the EOS id, in place of an EOS the template writes after it (render_answer).
    eos_text = tok.eos_token or ""
    if eos_text and whole.rstrip().endswith(eos_text):
        whole = whole.rstrip()[: -len(eos_text)]
    full = single_bos(encode_texts(tok, [whole], [parts], True)[0], tok.bos_token_id) + [tok.eos_token_id]
    if staged != full:
        at = _divergence(staged, full)
        report.add("template", WARN, f"the chat template round-trips the text, but the ids built turn by turn "
                                     f"({len(staged)}) differ from the whole conversation's ({len(full)}) from "
                                     f"token {at} (a merge across a turn boundary){unused}")
        return
    report.add("template", OK, f"the chat template round-trips a multi-turn conversation ({len(full)} tokens, "
                               "text and ids)")


def _rewritten_turn(prompt: list[dict[str, str]], tok: Any) -> str:
    """Where the whole-conversation rendering first departs from an earlier, shorter rendering of it."""
    full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": PROBE_ANSWER}], tokenize=False)
    for i in range(1, len(prompt) + 1):
        asks = prompt[i - 1]["role"] == "user"  # a prefix ending with a question gets the generation prompt
        try:
            head = tok.apply_chat_template(prompt[:i], tokenize=False, add_generation_prompt=asks)
        except Exception:  # noqa: BLE001 - a template may refuse a prefix (a system turn alone): skip it
            continue
        if not full.startswith(head):
            at = max(0, _divergence(head, full) - 12)  # from a little before, so the snippets show their turn
            return (f"after turn {i} ({prompt[i - 1]['role']}) alone it reads {head[at:at + 48]!r}, in the whole "
                    f"conversation {full[at:at + 48]!r}")
    return "the generation prompt is not a prefix of the answered turn"


def _divergence(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------------------------------ data
def _check_data(step: int, cfg: Any, tok: Any, default_data: Callable[[str], Sequence[str]] | None,
                report: Report) -> list[str]:
    """Load the stage's data as it would (``load_phase``, no cache); report each source's format, the drops, the
    prompts over --max-prompt-seq-len (stage 3) and a length histogram. Returns the sources' formats."""
    from dschat.data import load_phase
    from dschat.data.sources import DataSpec, load_source

    data, seed = cfg.data, cfg.run.seed
    kind, shape = "pairwise", step
    if step == 3:
        kind, shape = cfg.algorithm.demo_data, cfg.algorithm.tokenize_as or 3
    default = (lambda: default_data(kind)) if default_data is not None else None
    malformed: list[str] = []  # the stage's own lines on the malformed rows it drops (the first three, then a count)

    def log(line: str) -> None:
        if line.startswith(("data: dropped a malformed row: ", "data: ... and ")):
            malformed.append(line.removeprefix("data: "))

    try:
        pd = load_phase(data, step, tok, seed, use_cache=False, log=log, default_data=default, tokenize_as=shape)
        if step == 3:
            from dschat.rlhf.config import check_reward_data

            check_reward_data(cfg.reward_func_names(), pd.train + pd.eval)
    except UserError as e:
        # Name every source that does not read, not only the first; else the phase's own error.
        names = list(data.data) or (list(default()) if default else [])
        broken = []
        for name in names:
            try:
                load_source(DataSpec.parse(name))
            except UserError as bad:
                broken.append(str(bad))
        for text in broken or [str(e)]:
            report.add("data", ERROR, text)
        return []
    for s in pd.sources:
        report.add("data", OK, f"{s['name']}: {s['rows']} rows, format {s['format']}; {s['train_rows']} train rows "
                               f"in phase {step}" + (f" (tokenized as phase {shape})" if shape != step else ""))
    for text in malformed:
        report.add("data", WARN, text)
    counts = pd.counts
    drops = {k.removeprefix("dropped_"): v for k, v in sorted(counts.items()) if k.startswith("dropped_") and v}
    seen = counts.get("train_rows", 0) + counts.get("eval_rows", 0) + sum(drops.values())
    listed = ", ".join(f"{k} {v}" for k, v in drops.items()) or "none"
    too_long = drops.get("too_long", 0)
    severity = WARN if seen and too_long / seen > LONG_SHARE else OK
    why = (f"; {too_long / seen:.0%} are longer than --max-seq-len {data.max_seq_len} (over {LONG_SHARE:.0%}): "
           "raise it or shorten the data") if severity == WARN else ""
    report.add("data", severity, f"phase {step}: {counts.get('train_rows', 0)} train and {counts.get('eval_rows', 0)} "
                                 f"eval rows kept of {seen}; dropped: {listed}{why}")
    if counts.get("multi_turn_last_only"):
        report.add("data", WARN, f"{counts['multi_turn_last_only']} multi-turn rows train only their last answer "
                                 "(the chat template does not render them turn by turn)")
    if shape == 3:
        cut, kept = counts.get("truncated_prompt", 0), counts.get("train_rows", 0) + counts.get("eval_rows", 0)
        share = cut / kept if kept else 0.0
        advice = f"; over {LONG_SHARE:.0%}: raise the limit or shorten the prompts" if share > LONG_SHARE else ""
        report.add("data", WARN if advice else OK,
                   f"{cut} of {kept} prompts ({share:.0%}) exceed --max-prompt-seq-len {data.max_prompt_seq_len} "
                   f"and lose their beginning (left truncation){advice}")
    _histograms(step, shape, cfg, tok, load_phase, default, report)
    return [s["format"] for s in pd.sources]


def _histograms(step: int, shape: int, cfg: Any, tok: Any, load_phase: Any, default: Any, report: Report) -> None:
    """Prompt and answer token lengths of the phase's rows, tokenized as the stage does but without the length
    limits (so the histogram shows what the limits cut)."""
    unlimited = dataclasses.replace(cfg.data, max_seq_len=10**9, max_prompt_seq_len=10**9, mask_prompt=True,
                                    packing=False, group_by_length=False)
    try:
        pd = load_phase(unlimited, step, tok, cfg.run.seed, use_cache=False, log=lambda _: None,
                        default_data=default, tokenize_as=shape)
    except UserError:
        return
    rows = pd.train + pd.eval
    prompts: list[int] = []
    answers: list[int] = []
    for r in rows:
        if shape == 3:
            prompts.append(len(r["prompt_input_ids"]))
        elif shape == 2:
            prompts.append(r["prompt_len"])
            answers += [len(r["chosen_input_ids"]) - r["prompt_len"], len(r["rejected_input_ids"]) - r["prompt_len"]]
        else:  # the masked head is the prompt (with earlier turns of a multi-turn row counted as answer)
            head = next((i for i, label in enumerate(r["labels"]) if label != -100), len(r["labels"]))
            prompts.append(head)
            answers.append(len(r["input_ids"]) - head)
    limit = cfg.data.max_prompt_seq_len if shape == 3 else cfg.data.max_seq_len
    if prompts:
        report.add("data", OK, "prompt tokens " + histogram(prompts) + (f" | limit {limit}" if shape == 3 else ""))
    if answers:
        report.add("data", OK, "answer tokens (EOS included) " + histogram(answers)
                               + f" | prompt + answer limit {limit}")


def histogram(lengths: Sequence[int]) -> str:
    """A one-line text histogram: count, median, 95th percentile, max, then counts per power-of-two bin
    (``<=16:3`` counts lengths 9-16) with a bar of block characters."""
    xs = sorted(lengths)
    if not xs:
        return "n=0"
    bins: Counter[int] = Counter(max(1, 1 << max(0, (x - 1).bit_length())) for x in xs)
    top = max(bins.values())
    blocks = " ▁▂▃▄▅▆▇█"
    bar = "".join(blocks[max(1, round(8 * bins.get(b, 0) / top))] if bins.get(b) else " "
                  for b in _bin_range(min(bins), max(bins)))
    cells = " ".join(f"<={b}:{bins[b]}" for b in sorted(bins))
    return (f"n={len(xs)} median {xs[len(xs) // 2]} p95 {xs[min(len(xs) - 1, int(0.95 * len(xs)))]} max {xs[-1]} "
            f"[{bar}] {cells}")


def _bin_range(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


# ------------------------------------------------------------------------------------------------ plan
def _check_plan(step: int, values: dict[str, Any], report: Report, **hardware: Any) -> Any:
    """The memory planner's verdict (``dschat.planning.make_plan``): does the run fit, and what to change."""
    try:
        from dschat.planning import make_plan
    except ImportError:
        report.add("plan", WARN, "plan unavailable (dschat.planning.make_plan is not installed)")
        return None
    try:
        plan = make_plan(step, values, **{k: v for k, v in hardware.items() if v is not None})
    except UserError as e:
        report.add("plan", ERROR, str(e))
        return None
    except Exception as e:  # noqa: BLE001 - a planner that cannot plan this run must not stop the other checks
        report.add("plan", WARN, f"plan unavailable ({type(e).__name__}: {str(e).strip()[:160]})")
        return None
    peak = human_bytes(plan.peak_bytes)
    if plan.fits:
        report.add("plan", OK, f"fits: peak {peak} per device, checkpoint {human_bytes(plan.checkpoint_bytes)}")
    else:
        hint = f"; {plan.suggestion}" if plan.suggestion else ""
        report.add("plan", ERROR, f"does not fit: peak {peak} per device{hint}")
    return plan


# ------------------------------------------------------------------------------------------------ output
def output_folder(step: int, cfg: Any) -> Path:
    """``--output-dir``, or the stage's default (``output/<stage>``)."""
    if cfg.run.output_dir:
        return Path(cfg.run.output_dir).expanduser()
    name = {1: "step1_sft", 2: "step2_reward"}.get(step) or cfg.algorithm.output_name
    return Path("output") / name


def _check_output(step: int, cfg: Any, report: Report, plan: Any, paths: dict[str, str]) -> None:
    """Writable, room for the checkpoints, no live run holding it, no earlier run without --resume or --force."""
    out = output_folder(step, cfg)
    if out.exists() and not out.is_dir():
        report.add("output", ERROR, f"--output-dir {out}: is a file, not a folder")
        return
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        report.add("output", ERROR, f"--output-dir {out}: {existing} is not writable by this user")
        return
    need, how = _checkpoint_need(step, cfg, plan, paths)
    free = shutil.disk_usage(existing).free
    has, wants = human_bytes(free), human_bytes(need)
    if need and free < need:
        report.add("output", ERROR, f"--output-dir {out}: {has} free on its disk, the run's checkpoints need about "
                                    f"{wants} ({how}); free space or choose another disk")
    elif need and free < 2 * need:
        report.add("output", WARN, f"--output-dir {out}: {has} free, less than twice the {wants} the checkpoints "
                                   f"need ({how})")
    else:
        report.add("output", OK, f"--output-dir {out}: writable, {has} free"
                                 + (f" for about {wants} of checkpoints ({how})" if need else ""))
    _check_lock(out, report)
    if not out.is_dir():
        return
    from dschat.training.resume import latest_state

    latest, finished = latest_state(out), (out / "eval.json").exists()
    run = cfg.run
    if finished and not run.force and not (run.resume and latest is not None):
        report.add("output", ERROR, f"{out} already holds a finished run (eval.json); pass --force to overwrite "
                                    "it, --resume to train on from its final state, or choose another --output-dir")
    elif latest is not None and not (run.resume or run.force):
        report.add("output", ERROR, f"{out} holds a resumable training state ({latest.name}); pass --resume to "
                                    "continue it or --force to start over")
    elif latest is not None and run.resume:
        report.add("output", OK, f"--resume continues from {latest}")
    elif run.resume:
        report.add("output", WARN, f"--resume: {out} holds no training state; the run starts from the beginning")


def _checkpoint_need(step: int, cfg: Any, plan: Any, paths: dict[str, str]) -> tuple[int, str]:
    """Bytes the run writes at its peak (``--keep-checkpoints`` states plus the one being written, and the saved
    model folders), from the plan, else estimated from the trained models' parameter counts."""
    states = cfg.run.keep_checkpoints + 1
    if plan is not None:
        saved, state = int(plan.checkpoint_bytes), int(getattr(plan, "state_bytes", 0) or 0)
        return saved + states * state, (f"the plan: {states} x {human_bytes(state)} states + {human_bytes(saved)} "
                                        "of saved models")
    trained = ["model"] if step in (1, 2) else ["actor"] + (["critic"] if "critic" in cfg.algorithm.needs(cfg) else [])
    params = 0
    for role in trained:
        path = paths.get(role) or (paths.get("reward") if role == "critic" else None)
        if path:
            params += _folder_params(Path(path))
    if not params:
        return 0, ""
    return params * (STATE_BYTES_PER_PARAM * states + 4), (f"{_count(params)} trained parameters x "
                                                          f"{STATE_BYTES_PER_PARAM} bytes x {states} states, "
                                                          "estimated")


def _folder_params(folder: Path) -> int:
    files, problem = _weight_files(folder)
    total = 0
    for f in [] if problem else files:
        with contextlib.suppress(OSError, ValueError):
            header, _ = read_safetensors_header(f)
            total += sum(math.prod(int(d) for d in t.get("shape", [])) for k, t in header.items()
                         if k != "__metadata__")
    return total


def _check_lock(out: Path, report: Report) -> None:
    """Whether another live run holds the folder's lock (``dschat.training.lock``), taken and released at once."""
    from dschat.training.lock import LOCK_NAME, describe

    path = out / LOCK_NAME
    if not path.is_file():
        return
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        report.add("output", WARN, f"{path}: cannot read the lock ({e.strerror}); whether a run holds it is unknown")
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = False
    except BlockingIOError:
        held = True
    except OSError as e:  # no locks on this filesystem: the note is the lock
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        held = info.get("host") != socket.gethostname() or holder_alive(info)
    finally:
        os.close(fd)
    if held:
        report.add("output", ERROR, f"{out} is in use by another run ({describe(info)}); wait for it to finish or "
                                    "choose another --output-dir")
    elif info.get("pid"):
        report.add("output", OK, f"{out}: the lock was left by a run that is gone ({describe(info)})")


# ------------------------------------------------------------------------------------------------ launcher
def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """``(host, slots)`` of a DeepSpeed hostfile (``host slots=N`` per line, ``#`` comments); a line of any other
    shape, or a host named twice, is a ``UserError`` naming the file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{p}: hostfile not found")
    hosts: list[tuple[str, int]] = []
    for lineno, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots=") or not fields[1][6:].isdigit() \
                or int(fields[1][6:]) < 1:
            raise UserError(f"{p}:{lineno}: expected 'hostname slots=N' (N >= 1), got {line!r}")
        if any(h == fields[0] for h, _ in hosts):
            raise UserError(f"{p}:{lineno}: host {fields[0]} is listed twice")
        hosts.append((fields[0], int(fields[1][6:])))
    if not hosts:
        raise UserError(f"{p}: no hosts")
    return hosts


def _local_addresses() -> set[str]:
    out = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        with contextlib.suppress(OSError):
            out |= {str(i[4][0]) for i in socket.getaddrinfo(name, None)}
    return out


def _is_local(host: str, addresses: set[str]) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    for a in addresses:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(a.split("%")[0]).is_loopback:
                return True
    return bool(addresses & _local_addresses())


def local_versions() -> dict[str, str]:
    """The versions of what a rank imports, read from package metadata (nothing is imported)."""
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for pkg in ("dschat", "torch", "deepspeed", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


# Run on a remote host with this machine's interpreter path (as DeepSpeed's launcher does): its package versions.
_REMOTE_PROBE = ("import importlib.metadata as m, json\nout = {}\nfor p in ('dschat', 'torch'):\n    try:\n"
                 "        out[p] = m.version(p)\n    except Exception:\n        out[p] = 'missing'\n"
                 "print(json.dumps(out))")


def _check_launcher(report: Report, hostfile: str | None, master_port: int | None, timeout: float) -> None:
    mine = local_versions()
    report.add("launcher", ERROR if "missing" in (mine["dschat"], mine["torch"]) else OK,
               "this machine: " + ", ".join(f"{k} {v}" for k, v in mine.items()))
    if master_port is not None:
        with socket.socket() as s:
            try:
                s.bind(("", master_port))
                report.add("launcher", OK, f"--master-port {master_port} is free on this machine")
            except OSError as e:
                report.add("launcher", ERROR, f"--master-port {master_port} is in use on this machine "
                                              f"({e.strerror}); choose another or leave it out (a free one is picked)")
    if not hostfile:
        return
    try:
        hosts = parse_hostfile(hostfile)
    except UserError as e:
        report.add("launcher", ERROR, str(e))
        return
    report.add("launcher", OK, f"{hostfile}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slots")
    for i, (host, _) in enumerate(hosts):
        try:
            addresses = {str(a[4][0]) for a in socket.getaddrinfo(host, SSH_PORT, type=socket.SOCK_STREAM)}
        except OSError as e:
            report.add("launcher", ERROR, f"host {host}: does not resolve ({getattr(e, 'strerror', None) or e})")
            continue
        if _is_local(host, addresses):
            report.add("launcher", OK, f"host {host}: this machine")
            continue
        if not _answers(sorted(addresses), SSH_PORT, timeout):
            report.add("launcher", ERROR, f"host {host} ({', '.join(sorted(addresses))}): does not answer on ssh port "
                                          f"{SSH_PORT} within {timeout:g}s")
            continue
        _remote_versions(host, mine, timeout, report)
        if i == 0 and master_port is not None:
            report.add("launcher", WARN, f"--master-port {master_port}: the rendezvous runs on {host}, where the "
                                         "port was not checked")


def _answers(addresses: list[str], port: int, timeout: float) -> bool:
    for a in addresses:
        with contextlib.suppress(OSError), socket.create_connection((a, port), timeout=timeout):
            return True
    return False


def _remote_versions(host: str, mine: dict[str, str], timeout: float, report: Report) -> None:
    """dschat and torch on ``host`` as ssh sees them, without a password prompt (BatchMode); a warning when ssh
    does not get in."""
    if shutil.which("ssh") is None:
        report.add("launcher", WARN, f"host {host}: answers on port {SSH_PORT}; versions not checked (no ssh client)")
        return
    # ssh hands the remote shell one command line: each word quoted for it
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", host,
           shlex.quote(sys.executable), "-c", shlex.quote(_REMOTE_PROBE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode == 255:
        why = (done.stderr.strip().splitlines() or ["?"])[-1][:120] if done is not None else "timed out"
        report.add("launcher", WARN, f"host {host}: answers on port {SSH_PORT}, but ssh does not log in without a "
                                     f"prompt ({why}); versions not checked")
        return
    try:
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report.add("launcher", ERROR, f"host {host}: {sys.executable} does not run there "
                                      f"({(done.stderr.strip().splitlines() or ['?'])[-1][:120]})")
        return
    differ = [f"{p} {theirs.get(p)} (here {mine[p]})" for p in ("dschat", "torch") if theirs.get(p) != mine[p]]
    if differ:
        report.add("launcher", ERROR, f"host {host}: " + ", ".join(differ))
    else:
        report.add("launcher", OK, f"host {host}: reachable by ssh, dschat {mine['dschat']}, torch {mine['torch']}")


# ------------------------------------------------------------------------------------------------ units
def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"
