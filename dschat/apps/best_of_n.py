"""``dschat generate``: N sampled answers per prompt from any saved model, optionally scored, written as JSON Lines
in dschat's own row formats (docs/data.md, Row formats), so the output trains a stage as it is:

- ``--keep all``: every sample as an SFT row (``prompt``, ``response``) with its ``score``;
- ``--keep best``: the best-scoring sample per prompt as an SFT row: rejection sampling / best-of-n, and
  sequence-level distillation (docs/algorithms.md, Distillation: generate from the teacher, train the student on
  it in stage 1);
- ``--keep pairs``: the best as ``chosen`` and the worst as ``rejected`` of a pairwise row (DPO, a reward model);
  a prompt whose samples all score the same gives no pair (counted as ``ties``).

A whole job of one command, assembled from the library's packages: sampling is the library's one generation path,
the one stage 3 rolls out and evaluates with (``dschat.rlhf.rollout.generate_rollout`` through the hybrid engine),
scoring is stage 3's reward sources (``dschat.rlhf.scoring.build_scorer``: a reward model, rules, a judge, user
functions), and the prompts are read as the stages read rows (``dschat.data``).

Resumable. Rows go to ``OUTPUT.partial`` one batch of prompts at a time, and ``OUTPUT.progress.json`` records,
after each batch is on disk, how many prompts and bytes are complete and under which settings; ``OUTPUT`` appears
(by a rename) only when every prompt is done, so a killed run never leaves a half-written ``OUTPUT``. Running the
same command again cuts the partial file back to its last complete batch (a line half-written by the kill goes)
and continues. Batch k of prompts samples with seed ``--seed + k``, so the resumed file is byte for byte the file
an uninterrupted run writes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dschat.config import AgentArgs, DataArgs, ModelArgs, RunArgs, VLLMArgs, arg, piece, to_flat_dict
from dschat.errors import UserError
from dschat.rewards.names import JUDGE, RM, given_or_default, reward_sources
from dschat.rlhf.config import (
    RewardArgs,
    RLArgs,
    check_agent,
    check_reward_data,
    check_reward_models,
    reward_settings_inert,
    vllm_inert,
)

KEEP = ("all", "best", "pairs")
# What a partial output was sampled from beside the flags, as a changed-settings error names it.
INPUTS = {"model_files": "the model's weights", "data_files": "the --data files", "prompts": "the number of prompts",
          "reward_func_files": "the reward function files", "reward_model_files": "the reward model's weights",
          "judge_model_files": "the judge's weights"}
PROGRESS_VERSION = 1


@dataclass
class GenerateArgs:
    output: str = arg("", "JSON Lines file to write. Rows go to OUTPUT.partial until every prompt is done; running "
                          "the same command again continues after the last complete batch of prompts (progress in "
                          "OUTPUT.progress.json); --force starts over.")
    num_samples: int = arg(4, "Answers sampled per prompt.", low=1)
    keep: str = arg("all", "What to write: 'all' (every sample as an SFT row, with its score), 'best' (the "
                           "best-scoring sample per prompt as an SFT row: rejection sampling, best-of-n, distillation "
                           "from a teacher), 'pairs' (best as chosen, worst as rejected: a pairwise row for DPO or a "
                           "reward model; prompts whose samples all score the same are skipped and counted).",
                    choices=KEEP)
    min_score: float | None = arg(None, "With --keep best: write a prompt's best sample only when it scores at "
                                        "least this (rejection sampling's threshold); other prompts are skipped "
                                        "and counted (below_min_score).")
    max_prompts: int = arg(0, "Use only the first N prompts (0: all).", low=0)

    def inert_fields(self) -> dict[str, str]:
        return {} if self.keep == "best" else {"min_score": f"with --keep {self.keep}"}


@dataclass
class GenerateConfig:
    """``dschat generate``'s flags: its own, and the pieces it shares with the stages (declared there once)."""

    gen: GenerateArgs = field(default_factory=GenerateArgs)
    model: ModelArgs = piece(ModelArgs, only=("model", "dtype", "trust_remote_code"), defaults={"model": ""},
                             help={"model": "Model to sample from: a stage output folder (its actor/ or model/), a "
                                            "Hugging Face model folder, a HF id in the cache, an alias or 'tiny'."})
    data: DataArgs = piece(DataArgs, only=("data", "max_prompt_seq_len", "judge_system_prompt"), help={
        "data": "Prompts (repeatable): a .jsonl/.json/.parquet file, a save_to_disk folder or a registered name, "
                "in any row format dschat reads (prompt-only, SFT and pairwise rows give their prompt). Every row "
                "of the source is used; a source's own test split is left out.",
        "max_prompt_seq_len": "Longest prompt in tokens (longer ones keep their end, counted)."})
    rl: RLArgs = piece(RLArgs, only=("per_device_generation_batch_size", "max_answer_seq_len", "temperature",
                                     "top_p", "top_k", "generation_backend"), help={
        "per_device_generation_batch_size": "Prompts per generation batch, each sampled --num-samples times."})
    vllm: VLLMArgs = field(default_factory=VLLMArgs)
    agent: AgentArgs = field(default_factory=AgentArgs)
    rewards: RewardArgs = piece(RewardArgs, help={
        "reward_funcs": "Reward source (repeatable): rm (the reward model's end score), format, accuracy, judge_match, "
                        "overlong, judge (a generative judge), or path/to/file.py:function. Default: rm with "
                        "--reward-model and judge with --judge-model; none: samples are unscored (--keep all)."})
    run: RunArgs = piece(RunArgs, only=("seed", "force", "progress"), help={
        "seed": "Seed of the sampling: batch k of prompts samples with seed + k, so a resumed run writes what an "
                "uninterrupted one would.",
        "force": "Start over: discard OUTPUT, OUTPUT.partial and their progress."})

    def reward_func_names(self) -> list[str]:
        """The sources of ``reward_entries``, without their labels."""
        return reward_sources(self.reward_entries())

    def reward_entries(self) -> list[str]:
        """--reward-funcs as given (``LABEL=SOURCE`` kept), else the environments' reward with --env, else the
        sources the given models imply: rm with --reward-model, judge with --judge-model; none: samples are written
        unscored (``--keep all`` only)."""
        r = self.rewards
        implied = ([RM] if r.reward_model else []) + ([JUDGE] if r.judge_model else [])
        return given_or_default(r.reward_funcs, self.agent.env, implied)

    def inert_flags(self) -> dict[str, str]:
        names = self.reward_func_names()
        out = reward_settings_inert(names)
        if RM not in names:
            out["reward_model"] = "without the reward source 'rm' in --reward-funcs"
        if not names:
            out["reward_weights"] = "without a reward source (--reward-model, --reward-funcs or --judge-model)"
        out.update(vllm_inert(self.rl.generation_backend))
        return out


def check_generate_config(cfg: GenerateConfig) -> None:
    """Stop before anything loads on what cannot work."""
    g = cfg.gen
    for flag, value in (("--model", cfg.model.model), ("--data", cfg.data.data), ("--output", g.output)):
        if not value:
            raise UserError(f"dschat generate needs {flag}")
    names = cfg.reward_func_names()
    if g.keep != "all" and not names:
        raise UserError(f"--keep {g.keep} ranks the samples by score: give --reward-model, --reward-funcs or "
                        "--judge-model (or --keep all for unscored samples)")
    if g.keep == "pairs" and g.num_samples < 2:
        raise UserError("--keep pairs needs --num-samples >= 2 (chosen and rejected are two samples of a prompt)")
    check_reward_models(names, cfg.rewards)
    check_agent(cfg.agent, names)
    if Path(g.output).expanduser().is_dir():
        raise UserError(f"--output {g.output} is a folder; give a file name (e.g. {g.output.rstrip('/')}/gen.jsonl)")


# --------------------------------------------------------------------------------------------- selection
@dataclass
class Sample:
    text: str  # decoded completion (up to its first EOS, special tokens dropped)
    score: float | None  # weighted total of the reward sources; None unscored
    scores: dict[str, float]  # per source, when there is more than one
    truncated: bool  # never reached EOS within --max-answer-seq-len


def best_and_worst(samples: Sequence[Sample]) -> tuple[int, int] | None:
    """Indices of the best- and worst-scoring samples that have text (the first of equal scores), or None when
    none has. An empty completion is no SFT target and no rejected answer (the data layer drops either)."""
    usable = [j for j, s in enumerate(samples) if s.text.strip()]
    if not usable:
        return None
    best = min(usable, key=lambda j: (-samples[j].score, j))  # type: ignore[operator]
    worst = min(usable, key=lambda j: (samples[j].score, j))  # type: ignore[operator]
    return best, worst


def prompt_rows(prompt: Any, answer: str | None, samples: Sequence[Sample], keep: str,
                counts: Counter[str], prompt_index: int, min_score: float | None = None) -> list[dict[str, Any]]:
    """The output rows of one prompt under ``--keep`` (docs/data.md, Row formats), counting what was skipped and why:
    ``skipped_empty`` (best: no sample has text; pairs: fewer than two have), ``below_min_score`` (best: the best
    scores under ``min_score``), ``ties`` (pairs: best and worst score the same), ``identical`` (pairs: best and
    worst are the same text)."""
    extra = {"answer": answer} if answer is not None else {}
    if keep == "all":
        rows = []
        for j, s in enumerate(samples):
            row: dict[str, Any] = {"prompt": prompt, "response": s.text}
            if s.score is not None:
                row["score"] = s.score
            if s.scores:
                row["scores"] = s.scores
            rows.append(row | {"prompt_index": prompt_index, "sample": j, "truncated": s.truncated} | extra)
        return rows
    picked = best_and_worst(samples)
    if keep == "best":
        if picked is None:
            counts["skipped_empty"] += 1
            return []
        best = samples[picked[0]]
        if min_score is not None and best.score < min_score:  # type: ignore[operator]
            counts["below_min_score"] += 1
            return []
        return [{"prompt": prompt, "response": best.text, "score": best.score} | extra]
    if picked is None or sum(bool(s.text.strip()) for s in samples) < 2:
        counts["skipped_empty"] += 1
        return []
    chosen, rejected = samples[picked[0]], samples[picked[1]]
    if chosen.score == rejected.score:
        counts["ties"] += 1
        return []
    if chosen.text == rejected.text:
        counts["identical"] += 1
        return []
    return [{"prompt": prompt, "chosen": chosen.text, "rejected": rejected.text, "score_chosen": chosen.score,
             "score_rejected": rejected.score} | extra]


# ------------------------------------------------------------------------------------------------ prompts
def read_prompts(data: DataArgs, tokenizer: Any, log: Callable[[str], None],
                 tools: list[dict[str, Any]] | None = None) -> tuple[list[Any], list[dict[str, Any]],
                                                                                      dict[str, int], list[Any]]:
    """Every row of every ``--data`` source, read as the stages read rows (``parse_rows``: malformed ones dropped
    and counted, a mostly malformed source stops) and tokenized as stage 3's prompts. Returns the row prompts
    (text or messages, as written in the output), their tokenized rows (``prompt_input_ids``, ``answer``,
    ``extra``), the counts and each source's fingerprint."""
    from dschat.data.formats import check_malformed, parse_rows, source_format
    from dschat.data.phases import tokenize_examples
    from dschat.data.sources import DataSpec, load_source, source_fingerprint
    from dschat.prompts import read_system_prompt

    judge_system = read_system_prompt(data.judge_system_prompt) if data.judge_system_prompt else None
    counts: Counter[str] = Counter()
    examples: list[Any] = []
    fingerprints: list[Any] = []
    for name in data.data:
        spec = DataSpec.parse(name)
        if spec.weight != 1.0:
            raise UserError(f"--data {name}: a weight means nothing to dschat generate (every row is used once)")
        raw = load_source(spec)
        fmt = source_format(raw.train, raw.name)
        if raw.test:
            log(f"data: {raw.name}: its test split ({len(raw.test)} rows) is left out")
        found, problems = parse_rows(raw.train, fmt, counts, judge_system)
        check_malformed(problems, len(raw.train), raw.name, log)
        log(f"data: {raw.name}: {len(raw.train)} rows, format {fmt}, {len(found)} prompts")
        examples += found
        fingerprints.append([name, raw.fingerprint or source_fingerprint(spec)])
    rows = tokenize_examples(examples, 3, tokenizer, data, counts, tools)
    assert len(rows) == len(examples)  # phase 3 keeps every row (long prompts are cut, counted)
    return [ex.prompt for ex in examples], rows, dict(counts), fingerprints


def model_fingerprint(path: str) -> list[Any]:
    """Names, sizes and modification times of a model folder's config and weights: a model retrained in place
    is not taken for the one a partial output was sampled from."""
    folder = Path(path)
    files = sorted(f for f in folder.iterdir() if f.name == "config.json" or f.suffix in (".safetensors", ".bin"))
    return [str(folder.resolve())] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _file_digest(path: str) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError:
        return None  # a missing file stops later, where the reward function is loaded


# ------------------------------------------------------------------------------------------------- output
class ResumableOutput:
    """``OUTPUT.partial`` appended one batch at a time, ``OUTPUT.progress.json`` (written atomically after each
    batch reached the disk) saying how far it is complete, and the rename to ``OUTPUT`` at the end. Held under
    an exclusive lock for the life of the run: a second run on the same output stops with one line."""

    def __init__(self, output: str, settings: dict[str, Any], force: bool, log: Callable[[str], None]):
        self.path = Path(output).expanduser()
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.progress = self.path.with_name(self.path.name + ".progress.json")
        self.settings, self.log = settings, log
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"{self.path} is being written by another dschat generate right now") from None
            raise
        try:
            self.state = self._start(force)
        except BaseException:
            os.close(self.fd)
            raise

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.progress.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) and state.get("version") == PROGRESS_VERSION else None

    def _differs(self, state: dict[str, Any]) -> str:
        old = state.get("settings", {})
        keys = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
        return ", ".join(INPUTS.get(k, f"--{k.replace('_', '-')}") for k in keys)

    def _start(self, force: bool) -> dict[str, Any]:
        state = None if force else self._read_state()
        fresh = {"version": PROGRESS_VERSION, "settings": self.settings, "prompts_done": 0, "bytes": 0,
                 "counts": {}, "finished": False}
        if force:
            self.path.unlink(missing_ok=True)
            os.ftruncate(self.fd, 0)
            return fresh
        if state is not None and state["settings"] != self.settings:
            raise UserError(f"{self.path} was begun with other settings ({self._differs(state)} changed); pass "
                            "--force to start over, or choose another --output")
        if self.path.exists():
            if state is None or not state.get("finished"):
                raise UserError(f"{self.path} exists and is not the finished output of this command; pass --force "
                                "to overwrite it, or choose another --output")
            return state
        if state is None:  # nothing recorded: nothing of the partial file is known complete
            os.ftruncate(self.fd, 0)
            return fresh
        size = os.fstat(self.fd).st_size
        if size < state["bytes"]:
            raise UserError(f"{self.partial} is shorter ({size} bytes) than its progress says ({state['bytes']}); "
                            "pass --force to start over")
        if size > state["bytes"]:
            self.log(f"{self.partial}: dropping {size - state['bytes']} bytes written after the last complete batch")
            os.ftruncate(self.fd, state["bytes"])
        if state.get("finished"):  # stopped between recording the end and the rename
            os.replace(self.partial, self.path)
        return state

    @property
    def done(self) -> int:
        return int(self.state["prompts_done"])

    def append(self, rows: list[dict[str, Any]], prompts_done: int, counts: dict[str, Any]) -> None:
        """Write a batch's rows, make them durable, then record them as complete."""
        from dschat.diskfull import disk_full_guard

        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        before = self.state["bytes"]
        try:
            with disk_full_guard("the generated rows", self.partial, kept="rows of earlier batches are kept"):
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
                os.fsync(self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, before)
            raise
        self._record(prompts_done=prompts_done, bytes=before + len(data), counts=counts)

    def _record(self, **changes: Any) -> None:
        from dschat.utils import write_json

        self.state = {**self.state, **changes}
        write_json(self.progress, self.state)

    def finish(self, summary: dict[str, Any]) -> None:
        self._record(finished=True, summary=summary)
        os.replace(self.partial, self.path)

    def close(self) -> None:
        os.close(self.fd)


# -------------------------------------------------------------------------------------------------- the run
def _log(text: str) -> None:
    print(f"[generate] {text}", file=sys.stderr, flush=True)


def _scored(rewards: Any, k: int) -> tuple[float | None, dict[str, float]]:
    if rewards is None:
        return None, {}
    per = {n: float(v[k]) for n, v in rewards.per_func.items()} if len(rewards.per_func) > 1 else {}
    return float(rewards.total[k]), per


def summarize(counts: Counter[str], keep: str) -> dict[str, Any]:
    """The run's figures from its running sums: mean score of all samples and of the best and worst per prompt
    (their difference from the mean is what best-of-n selection buys)."""
    out: dict[str, Any] = {k: v for k, v in sorted(counts.items()) if not k.startswith("sum_")}
    if counts.get("scored_prompts"):
        n = counts["scored_prompts"]
        out.update(mean_score=counts["sum_score"] / counts["scored_samples"], mean_best_score=counts["sum_best"] / n,
                   mean_worst_score=counts["sum_worst"] / n)
    out["keep"] = keep
    return out


def generate(cfg: GenerateConfig, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run ``dschat generate``: sample, score, select, write (resumably). Returns the summary (also kept in
    ``OUTPUT.progress.json``)."""
    from dschat import engine as E
    from dschat.data import DataCollatorRLHF
    from dschat.devices import resolve_dtype
    from dschat.generation.decode import GenerationConfig
    from dschat.generation.hybrid_engine import make_hybrid_engine
    from dschat.models.loading import load_tokenizer, resolve_saved_model
    from dschat.rlhf.engines import frozen_models, reward_model_path
    from dschat.rlhf.rollout import completion_texts, generate_rollout, repeat_prompts
    from dschat.rlhf.scoring import build_scorer
    from dschat.training.stage import to_device
    from dschat.utils import progress_bar

    check_generate_config(cfg)
    g, rl = cfg.gen, cfg.rl
    names = cfg.reward_func_names()
    t0 = time.time()
    model_path = resolve_saved_model(cfg.model.model)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    from dschat.agents.agent import build_agent

    agent = build_agent(cfg.agent)  # --tools and --env: each sample is an episode, its whole text the response
    if agent is not None:
        agent.warm()
    prompts, rows, data_counts, data_files = read_prompts(cfg.data, tok, log,
                                                          agent.tool_schemas if agent and agent.tools else None)
    if g.max_prompts:
        prompts, rows = prompts[: g.max_prompts], rows[: g.max_prompts]
    if not rows:
        raise UserError(f"no prompts in {', '.join(cfg.data.data)} ({data_counts})")
    check_reward_data(names, rows)
    if agent is not None:
        agent.check_rows(rows)
    reward_path = reward_model_path(cfg.rewards.reward_model) if RM in names else ""
    judge_path = resolve_saved_model(cfg.rewards.judge_model) if JUDGE in names else ""
    settings = {k: v for k, v in to_flat_dict(cfg).items() if k not in ("progress", "force", "output")}
    user_files = [[f, _file_digest(f)] for f in (n.rsplit(":", 1)[0] for n in names if ".py:" in n)]
    settings.update(model_files=model_fingerprint(model_path), data_files=data_files, prompts=len(rows),
                    **({"reward_func_files": user_files} if user_files else {}),
                    **({"reward_model_files": model_fingerprint(reward_path)} if reward_path else {}),
                    **({"judge_model_files": model_fingerprint(judge_path)} if judge_path else {}))

    out = ResumableOutput(g.output, settings, cfg.run.force, log)
    try:
        if out.state.get("finished"):
            log(f"{out.path} is complete ({len(rows)} prompts); nothing to do (--force starts over)")
            return dict(out.state.get("summary", {}))
        B, N = rl.per_device_generation_batch_size, g.num_samples
        start = out.done
        if start:
            log(f"resuming {out.partial} after prompt {start} of {len(rows)}")

        # the model to sample from, and the reward sources (frozen, on this process's device)
        dtype = resolve_dtype(cfg.model.dtype)
        models = frozen_models(model_path, tok, dtype, reward_path, trust_remote_code=cfg.model.trust_remote_code)
        hybrid = make_hybrid_engine(models.actor, tok, requested=False, backend=rl.generation_backend, vllm=cfg.vllm,
                                    max_model_len=cfg.data.max_prompt_seq_len + rl.max_answer_seq_len, agent=agent)
        scorer = build_scorer(cfg, models) if names else None
        gen = GenerationConfig.from_flags(rl)
        collator = DataCollatorRLHF(tok.pad_token_id)
        log(f"model {model_path} | {len(rows)} prompts x {N} samples, batches of {B} | keep {g.keep} | "
            f"scores {scorer.describe() if scorer else 'none'} | writing {out.partial}")

        counts: Counter[str] = Counter(out.state.get("counts", {}))
        bar = progress_bar(cfg.run.progress, len(rows), "generate", initial=start, unit="prompt")
        try:
            for first in range(start, len(rows), B):
                part = rows[first: first + B]
                batch = to_device(collator(part), E.device())
                group = repeat_prompts(batch, N)  # the N samples of a prompt are consecutive
                rollout, _ = generate_rollout(hybrid, tok, group, gen, seed=cfg.run.seed + first // B,
                                              min_answer_len=1)
                rewards = scorer(rollout, group) if scorer is not None else None
                _, texts, _ = completion_texts(tok, rollout, group["prompt_att_mask"])
                truncated = (~rollout.reached_eos).tolist()
                lines: list[dict[str, Any]] = []
                for i, row in enumerate(part):
                    samples = [Sample(texts[k], *_scored(rewards, k), truncated[k]) for k in range(i * N, (i + 1) * N)]
                    lines += prompt_rows(prompts[first + i], row.get("answer"), samples, g.keep, counts, first + i,
                                         g.min_score)
                    _tally(counts, samples)
                counts["rows"] += len(lines)
                out.append(lines, first + len(part), dict(counts))
                if bar is not None:
                    bar.update(len(part))
                    if counts.get("scored_prompts"):
                        bar.set_postfix(best=f"{counts['sum_best'] / counts['scored_prompts']:.3g}", refresh=False)
        finally:
            if bar is not None:
                bar.close()
            hybrid.close()
        summary = {"output": str(out.path), "prompts": len(rows), "num_samples": N, **summarize(counts, g.keep),
                   "seconds_this_run": round(time.time() - t0, 1), **data_counts}
        out.finish(summary)
    finally:
        out.close()
    skipped = ", ".join(f"{k} {summary[k]}" for k in ("ties", "identical", "skipped_empty", "below_min_score")
                        if summary.get(k))
    scores = (f" | mean score {summary['mean_score']:.4g}, best {summary['mean_best_score']:.4g}, worst "
              f"{summary['mean_worst_score']:.4g}") if "mean_score" in summary else ""
    log(f"wrote {summary['rows']} rows ({g.keep}) for {len(rows)} prompts to {out.path}"
        f"{' | skipped: ' + skipped if skipped else ''} | truncated samples {summary.get('truncated', 0)}{scores}")
    return summary


def _tally(counts: Counter[str], samples: Sequence[Sample]) -> None:
    """Running sums for the summary: samples, empty and truncated ones, and the scores (all samples, and the best
    and worst sample with text)."""
    counts["samples"] += len(samples)
    counts["empty"] += sum(not s.text.strip() for s in samples)
    counts["truncated"] += sum(s.truncated for s in samples)
    picked = best_and_worst(samples) if samples and samples[0].score is not None else None
    if picked is not None:  # the best and worst that --keep best/pairs would write
        counts["scored_prompts"] += 1
        counts["scored_samples"] += len(samples)
        counts["sum_score"] += sum(s.score for s in samples)  # type: ignore[misc]
        counts["sum_best"] += samples[picked[0]].score  # type: ignore[operator]
        counts["sum_worst"] += samples[picked[1]].score  # type: ignore[operator]
