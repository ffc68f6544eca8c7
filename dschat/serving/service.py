"""What ``dschat serve`` computes, without HTTP: the reward sources (a reward model, a generative judge, rule and
user functions) loaded once, a request's rows as the reward model reads them, and the answer to a request.

The reward model's score is ``dschat.rlhf.scoring.score_rows``, the function stage 3 scores with; text is encoded
by ``encode_for_reward`` (stage 3's template, EOS and truncation rules for a reward model with its own
tokenizer); the judge and rule sources are the functions stage 3 calls, mixed by ``RewardMixer``. So a served
score equals the in-process one bit for bit on the same inputs (docs/serving.md, Parity).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dschat.config import ServeArgs
from dschat.errors import UserError, first_line
from dschat.rewards.functions import RM, RewardMixer, get_reward_func, parse_weights
from dschat.rewards.judge import JUDGE
from dschat.rewards.remote import is_remote, tokenizer_fingerprint
from dschat.serving.batcher import Job

# sources a server cannot compute: 'overlong' needs the trainer's token counts and length cap
NOT_SERVED = ("overlong",)


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` (413 or 422) with a one-line ``reason``."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


# row fields the server fills itself (``answer`` from ``answers``, ``reached_eos`` from ``ended``) or that name the
# reward functions' own arguments: a request may not set them through ``fields``
RESERVED_FIELDS = ("answer", "prompts", "completions", "completion_lengths", "reached_eos", "token_ids", "external")
MAX_DEPTH = 64  # JSON nesting a request may use; the request shapes need 5


def reserved_fields(funcs: dict[str, Any]) -> tuple[str, ...]:
    """The names ``fields`` may not use: ``RESERVED_FIELDS``, the parameters of ``RewardMixer.__call__`` (which
    receives the fields as keywords) and the first two parameters of every served function (its prompts and
    completions, passed by position: a field of that name would be a second value for it)."""
    names = list(RESERVED_FIELDS)
    signatures = [inspect.signature(RewardMixer.__call__)]
    for fn in funcs.values():
        try:
            signatures.append(inspect.signature(fn))
        except (TypeError, ValueError):  # a callable without a signature Python can read
            continue
    for i, sig in enumerate(signatures):
        positional = [p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        named = [p.name for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD] if i == 0 else \
            positional[:2]
        names += [n for n in named if n not in names]
    return tuple(names)


def _no_constant(name: str) -> Any:
    raise BadRequest(422, f"the body holds {name}, which is not JSON (send finite numbers)")


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a one-line 422 (``parse_body_steps`` in one go)."""
    steps = parse_body_steps(raw)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def parse_body_steps(raw: bytes) -> Generator[None, None, Any]:
    """A request body as JSON, or a one-line 422: not UTF-8, not JSON, nested deeper than ``MAX_DEPTH``, a number
    of more digits than Python converts (4300), a ``NaN``/``Infinity`` literal, or a text holding a lone surrogate
    (``\\ud800``, which no tokenizer encodes). A generator: it yields between bounded steps of the walk over the
    parsed values, and returns the body."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise BadRequest(422, f"the body is not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise BadRequest(422, f"the body is nested too deep (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as e:
        raise BadRequest(422, f"the body is not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # an integer past the digit limit of int(str)
        raise BadRequest(422, f"the body holds a number Python refuses to convert ({first_line(e, 80)})") from None
    yield
    # valid UTF-8 holds no surrogate: a lone one can only come from a \\uD800-\\uDFFF escape
    yield from _check_values(body, texts=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINERS = {dict, list}
WALK_STEP = 200_000  # values the walk visits between two yields
ENCODE_CHUNK_CHARS = 32_768  # characters of text encoded between two yields (at least one row)


def _where(path: Any) -> str:
    """``prompts[3]``, ``messages[0][1].content``: where a value sits (``path``: ``(parent, key)`` links)."""
    keys: list[Any] = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out or "the body"


def _check_text(text: str, path: Any) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(422, f"{_where(path)}: a text holds a lone surrogate ({text[e.start]!a}); send valid "
                              "Unicode") from None


def _check_values(body: Any, texts: bool = True) -> Iterator[None]:
    """Depth (and, with ``texts``, the texts) of a parsed body, iteratively (a deep body must not recurse here
    either), yielding every ``WALK_STEP`` values. Only containers are stacked, a large one of scalars is skipped
    in one pass in C, and a location is spelt out only for an error."""
    if not isinstance(body, dict | list):
        if texts and isinstance(body, str):
            _check_text(body, None)
        return
    stack: list[tuple[Any, int, Any]] = [(body, 1, None)]
    budget = WALK_STEP
    while stack:
        if budget <= 0:
            budget = WALK_STEP
            yield
        value, depth, path = stack.pop()
        if value and depth >= MAX_DEPTH:  # its items would sit past the limit
            raise BadRequest(422, f"the body is nested too deep (at most {MAX_DEPTH} levels)")
        is_dict = type(value) is dict
        budget -= len(value) + 1
        if len(value) > 16:
            kinds = set(map(type, value.values() if is_dict else value))
            if not (kinds & _CONTAINERS or texts and (str in kinds or is_dict)):
                continue  # numbers, booleans and nulls only, or texts that need no check
        for key, item in value.items() if is_dict else enumerate(value):
            if texts and is_dict:
                _check_text(key, path)
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1, (path, key)))
            elif texts and kind is str:
                _check_text(item, (path, key))


@dataclass
class ScoreRequest:
    prompts: list[str]
    completions: list[str]
    ended: list[bool]
    answers: list[Any] | None = None
    input_ids: list[list[int]] | None = None
    fields: dict[str, list[Any]] = field(default_factory=dict)


def _strings(body: dict[str, Any], key: str, n: int | None = None) -> list[str]:
    values = body.get(key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise BadRequest(422, f"'{key}' must be a list of strings")
    if n is not None and len(values) != n:
        raise BadRequest(422, f"'{key}' has {len(values)} entries for {n} completions")
    return values


def _messages_text(tokenizer: Any, messages: Any, where: str) -> str:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), str) for m in messages):
        raise BadRequest(422, f"{where}: chat messages must be a list of {{'role': str, 'content': str}}")
    if tokenizer is None:
        raise BadRequest(422, f"{where}: chat messages need the reward model's tokenizer; send text")
    from dschat.data.formats import render_prompt

    # as the stages render a prompt: the chat template, or the plain Human/Assistant one without a template
    return render_prompt(messages, tokenizer)


def parse_score_request(body: Any, tokenizer: Any, max_rows: int,
                        reserved: tuple[str, ...] = RESERVED_FIELDS) -> ScoreRequest:
    """``POST /score``'s body: ``{"prompts": [...], "completions": [...]}`` (prompts as text or chat messages),
    or ``{"messages": [[...], ...]}`` (each a conversation whose last message is the assistant's answer);
    optional ``ended`` (did each answer reach EOS; default true), ``answers`` (reference answers, for the judge
    and rule sources), ``input_ids`` (the rows as token ids of the server's tokenizer, see ``/info``) and
    ``fields`` (other row fields, by name, for user functions; none of the ``reserved`` names)."""
    if not isinstance(body, dict):
        raise BadRequest(422, "the body must be a JSON object")
    key = "messages" if "messages" in body else "completions"
    if key not in body or key == "completions" and "prompts" not in body:
        raise BadRequest(422, "send 'prompts' and 'completions' (or 'messages')")
    if isinstance(body[key], list) and len(body[key]) > max_rows:  # before any row is rendered or read
        raise BadRequest(413, f"{len(body[key])} {'conversations' if key == 'messages' else 'completions'} in one "
                              f"request; at most {max_rows} (--max-request-rows)")
    if "messages" in body:
        convs = body["messages"]
        if not isinstance(convs, list):
            raise BadRequest(422, "'messages' must be a list of conversations")
        prompts, completions = [], []
        for i, conv in enumerate(convs):
            if not isinstance(conv, list) or not conv or not isinstance(conv[-1], dict) or \
                    conv[-1].get("role") != "assistant" or not isinstance(conv[-1].get("content"), str):
                raise BadRequest(422, f"messages[{i}] must end with an assistant message (the answer scored)")
            prompts.append(_messages_text(tokenizer, conv[:-1], f"messages[{i}]"))
            completions.append(conv[-1]["content"])
    else:
        raw = body["prompts"]
        if not isinstance(raw, list):
            raise BadRequest(422, "'prompts' must be a list")
        completions = _strings(body, "completions", len(raw))
        prompts = [p if isinstance(p, str) else _messages_text(tokenizer, p, f"prompts[{i}]")
                   for i, p in enumerate(raw)]
    n = len(completions)
    ended = body.get("ended", [True] * n)
    if not isinstance(ended, list) or len(ended) != n or not all(isinstance(e, bool) for e in ended):
        raise BadRequest(422, f"'ended' must be a list of {n} booleans")
    answers = body.get("answers")
    if answers is not None and (not isinstance(answers, list) or len(answers) != n):
        raise BadRequest(422, f"'answers' must be a list of {n} entries")
    ids = body.get("input_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != n or not all(
            isinstance(r, list) and r and all(isinstance(t, int) and not isinstance(t, bool) for t in r)
            for r in ids)):
        raise BadRequest(422, f"'input_ids' must be a list of {n} non-empty lists of integers")
    fields = body.get("fields") or {}
    if not isinstance(fields, dict) or not all(isinstance(v, list) and len(v) == n for v in fields.values()):
        raise BadRequest(422, f"'fields' must map names to lists of {n} entries")
    taken = [k for k in fields if k in reserved]
    if taken:
        raise BadRequest(422, f"'fields' may not set {taken[0]!r}: the server sets it or a reward function takes it "
                              f"as an argument (reserved: {', '.join(reserved)}; send 'answers' and 'ended' as "
                              "such)")
    return ScoreRequest(prompts, completions, ended, answers, ids, fields)


def parse_openrlhf_request(body: Any, max_rows: int) -> ScoreRequest:
    """OpenRLHF's ``POST /get_reward``: ``{"query": [full texts]}`` (optional ``"prompts"``: where each text's
    answer starts). A query is scored as a prompt and an answer that ended (the reward model's EOS appended)."""
    if not isinstance(body, dict):
        raise BadRequest(422, "the body must be a JSON object")
    if isinstance(body.get("query"), list) and len(body["query"]) > max_rows:
        raise BadRequest(413, f"{len(body['query'])} queries in one request; at most {max_rows} (--max-request-rows)")
    queries = _strings(body, "query")
    prompts = body.get("prompts")
    if prompts is not None:
        prompts = _strings(body, "prompts", len(queries))
        if not all(q.startswith(p) for q, p in zip(queries, prompts, strict=True)):
            raise BadRequest(422, "each query must start with its prompt")
        pairs = [(p, q[len(p):]) for q, p in zip(queries, prompts, strict=True)]
    else:
        pairs = [(q, "") for q in queries]
    return ScoreRequest([p for p, _ in pairs], [c for _, c in pairs], [True] * len(pairs))


class RewardService:
    """The server's reward sources, loaded once. ``names``/``weights`` as ``--reward-funcs``/``--reward-weights``
    (``rm`` the reward model, ``judge`` the judge); ``funcs`` the functions of the other sources."""

    def __init__(self, names: list[str], weights: list[float], funcs: dict[str, Any], reward_model: Any | None,
                 tokenizer: Any | None, limits: ServeArgs, info: dict[str, Any]):
        self.mixer = RewardMixer(names, weights, {**funcs, **({RM: None} if RM in names else {})})
        self.reward_model, self.tokenizer, self.limits = reward_model, tokenizer, limits
        self.vocab = len(tokenizer) if tokenizer is not None else 0
        self.info = {"sources": list(names), "weights": self.mixer.weights,
                     "max_seq_len": limits.max_seq_len, "max_batch_tokens": limits.max_batch_tokens,
                     "max_request_rows": limits.max_request_rows, "max_request_tokens": limits.max_request_tokens,
                     "max_body_bytes": limits.max_body_bytes, "max_queue": limits.max_queue, **info}
        if tokenizer is not None and reward_model is not None:
            self.info["tokenizer"] = tokenizer_fingerprint(tokenizer)
        self.reserved = reserved_fields(funcs)  # names 'fields' may not use

    # ------------------------------------------------------------------------------------------- rows
    def prepare(self, raw: bytes, openrlhf: bool = False, tokenizer: Any | None = None) -> Generator[None, None, Job]:
        """The batcher's job of a request body, in bounded steps: a generator that yields between them (the JSON
        walk, the request's shape, each chunk of rows encoded) and returns the job. ``tokenizer``: the copy of the
        reward model's tokenizer this thread uses (default: the service's). Stopping it between steps (a client
        that left) leaves no work behind."""
        body = yield from parse_body_steps(raw)
        max_rows = self.limits.max_request_rows
        req = parse_openrlhf_request(body, max_rows) if openrlhf else \
            parse_score_request(body, tokenizer if tokenizer is not None else self.tokenizer, max_rows, self.reserved)
        yield
        rows, widths = yield from self.encode(req, tokenizer)
        return Job(rows, {"request": req, "openrlhf": openrlhf}, widths)

    def job(self, req: ScoreRequest, openrlhf: bool = False) -> Job:
        """The batcher's job of a parsed request, in one go (``encode``)."""
        steps = self.encode(req)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                rows, widths = done.value
                return Job(rows, {"request": req, "openrlhf": openrlhf}, widths)

    def encode(self, req: ScoreRequest, tokenizer: Any | None = None) -> Generator[None, None, tuple[list, list]]:
        """The reward model's token rows of a request and their padded widths (none without a reward model), or
        413 once they cost more than ``--max-request-tokens`` padded tokens. Token ids are counted before they are
        checked; text is encoded a chunk of rows at a time (``ENCODE_CHUNK_CHARS``) with a running total, so a
        request over the bound stops at the chunk that crosses it, and the generator yields after each chunk."""
        from dschat.rlhf.scoring import score_width

        if self.reward_model is None:
            return [], []
        cap, max_len = self.limits.max_request_tokens, self.limits.max_seq_len
        if req.input_ids is not None:
            widths = [score_width(len(r)) for r in req.input_ids]
            self._check_cost(sum(widths))
            for i, row in enumerate(req.input_ids):
                if len(row) > max_len:
                    raise BadRequest(422, f"input_ids[{i}] has {len(row)} tokens; at most {max_len} (--max-seq-len)")
                if min(row) < 0 or max(row) >= self.vocab:
                    raise BadRequest(422, f"input_ids[{i}] holds an id outside the vocabulary [0, {self.vocab})")
            return req.input_ids, widths
        n = len(req.completions)
        self._check_cost(n * score_width(1), f"cost at least {n * score_width(1)} padded tokens ({score_width(1)} "
                         "a row)")  # before any row is encoded
        tok = tokenizer if tokenizer is not None else self.tokenizer
        rows: list[list[int]] = []
        widths: list[int] = []
        cost = start = 0
        while start < n:
            end, chars = start, 0
            while end < n and (end == start or chars < ENCODE_CHUNK_CHARS):
                chars += len(req.prompts[end]) + len(req.completions[end])
                end += 1
            chunk = self.encode_rows(req.prompts[start:end], req.completions[start:end], req.ended[start:end], tok)
            for i, row in enumerate(chunk, start):
                if not row:
                    raise BadRequest(422, f"row {i} encodes to no tokens (empty prompt and answer)")
            rows += chunk
            widths += [score_width(len(r)) for r in chunk]
            cost += sum(widths[start:end])
            if cost > cap:
                raise BadRequest(413, f"the first {end} of {n} rows already cost {cost} padded tokens; at most {cap} "
                                      "per request (--max-request-tokens): send fewer rows per request (the "
                                      "client's --reward-request-rows)")
            start = end
            yield
        return rows, widths

    def encode_rows(self, prompts: list[str], completions: list[str], ended: list[bool],
                    tokenizer: Any) -> list[list[int]]:
        """Rows of text as the reward model reads them (stage 3's ``encode_for_reward``)."""
        from dschat.rlhf.scoring import encode_for_reward

        return encode_for_reward(prompts, completions, ended, tokenizer, self.limits.max_seq_len)[0]

    def score_rows(self, rows: list[list[int]]) -> torch.Tensor:
        from dschat import engine as E
        from dschat.rlhf.scoring import score_rows

        return score_rows(self.reward_model, rows, self.tokenizer.pad_token_id, E.device(),
                          self.limits.max_batch_tokens)

    def _check_cost(self, cost: int, what: str = "") -> None:
        cap = self.limits.max_request_tokens
        if cost > cap:
            what = what or f"cost {cost} padded tokens"
            raise BadRequest(413, f"the rows {what}; at most {cap} per request (--max-request-tokens): send fewer "
                                  "rows per request (the client's --reward-request-rows)")

    # ------------------------------------------------------------------------------------------- answers
    def finish(self, job: Job, rm_scores: torch.Tensor) -> dict[str, Any]:
        """A job's answer from its reward-model scores: the weighted sum of every source, per source too when
        there are several."""
        req: ScoreRequest = job.payload["request"]
        n = len(req.completions)
        fields: dict[str, Any] = {"answer": req.answers if req.answers is not None else [None] * n,
                                  "reached_eos": req.ended, **req.fields}
        mixed = self.mixer(req.prompts, req.completions, external={RM: rm_scores} if RM in self.mixer.names
                           else None, **fields)
        scores = mixed.total.tolist()
        if not all(math.isfinite(s) for s in scores):
            raise UserError("a score is not finite")
        if job.payload["openrlhf"]:
            return {"rewards": scores, "scores": scores}
        out: dict[str, Any] = {"scores": scores}
        if len(self.mixer.names) > 1:
            out["sources"] = {k: v.tolist() for k, v in mixed.per_func.items()}
        return out


def source_names(reward_model: str, judge_model: str, reward_funcs: list[str]) -> list[str]:
    """The served sources: ``--reward-funcs``, else ``rm`` with ``--reward-model`` and ``judge`` with
    ``--judge-model``."""
    names = list(reward_funcs) or ([RM] if reward_model else []) + ([JUDGE] if judge_model else [])
    if not names:
        raise UserError("dschat serve needs --reward-model, --judge-model or --reward-funcs")
    for n in names:
        if n in NOT_SERVED:
            raise UserError(f"reward source {n!r} needs the trainer's token counts; compute it in the run, not on the "
                            "server")
        if is_remote(n):
            raise UserError(f"dschat serve computes its sources itself; {n} is another server")
    if RM in names and not reward_model:
        raise UserError("reward source 'rm' needs --reward-model (a step-2 output)")
    if JUDGE in names and not judge_model:
        raise UserError("reward source 'judge' needs --judge-model (a trained generative judge)")
    return names


def load_service(cfg: Any, log: Any = print) -> RewardService:
    """Load the sources of a ``ServeConfig``: the reward model (a stage-2 output) frozen on this process's device,
    with its tokenizer and its stage-2 mean/std; the judge; the rule and user functions."""
    from dschat.devices import resolve_dtype
    from dschat.models.loading import frozen_reward_model, load_tokenizer
    from dschat.models.reward_model import check_reward_checkpoint
    from dschat.rewards.judge import load_judge_reward
    from dschat.rlhf.engines import reward_model_path

    r, m = cfg.rewards, cfg.model
    names = source_names(r.reward_model, r.judge_model, list(r.reward_funcs))
    weights = parse_weights(r.reward_weights)
    funcs: dict[str, Any] = {n: get_reward_func(n) for n in names if n not in (RM, JUDGE)}
    info: dict[str, Any] = {"dtype": m.dtype}
    model, tok = None, None
    if RM in names:
        path = reward_model_path(r.reward_model)
        check_reward_checkpoint(path, m.trust_remote_code)
        tok = load_tokenizer(path, m.trust_remote_code)
        dtype = resolve_dtype(m.dtype)
        model = frozen_reward_model(path, dtype, tok.pad_token_id, m.trust_remote_code)
        config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
        mean, std = getattr(config, "reward_mean", None), getattr(config, "reward_std", None)
        info.update({"model": path, "dtype": str(dtype).removeprefix("torch."), "reward_mean": mean,
                     "reward_std": std})
        log(f"reward model {path} ({info['dtype']})")
    if JUDGE in names:
        funcs[JUDGE] = load_judge_reward(r.judge_model, r.judge_max_new_tokens, cfg.data.judge_system_prompt,
                                         m.dtype, m.trust_remote_code)
        info["judge_model"] = r.judge_model
        log(f"judge {r.judge_model}")
    return RewardService(names, weights, funcs, model, tok, cfg.serve, info)
