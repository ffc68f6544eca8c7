"""What ``dschat serve`` computes, without HTTP: the reward sources (a reward model, a generative judge, rule and
user functions) loaded once, a request's rows as the reward model reads them, and the answer to a request.

The reward model's score is ``dschat.rlhf.scoring.score_rows``, the function stage 3 scores with; text is encoded
by ``encode_for_reward`` (stage 3's template, EOS and truncation rules for a reward model with its own
tokenizer); the judge and rule sources are the functions stage 3 calls, mixed by ``RewardMixer``. So a served
score equals the in-process one bit for bit on the same inputs (docs/serving.md, Parity).
"""

from __future__ import annotations

import json
import math
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


def _no_constant(name: str) -> Any:
    raise BadRequest(422, f"the body holds {name}, which is not JSON (send finite numbers)")


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a one-line 422: not UTF-8, not JSON, nested deeper than ``MAX_DEPTH``, a number
    of more digits than Python converts (4300), a ``NaN``/``Infinity`` literal, or a text holding a lone surrogate
    (``\\ud800``, which no tokenizer encodes)."""
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
    _check_values(body)
    return body


def _check_values(body: Any) -> None:
    """Depth and texts of a parsed body, iteratively (a deep body must not recurse here either)."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "the body")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(422, f"the body is nested too deep (at most {MAX_DEPTH} levels)")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadRequest(422, f"{where}: a text holds a lone surrogate ({value[e.start]!a}); send valid "
                                      "Unicode") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth + 1, where))
                stack.append((v, depth + 1, k if where == "the body" else f"{where}.{k}"))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))


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


def parse_score_request(body: Any, tokenizer: Any, max_rows: int) -> ScoreRequest:
    """``POST /score``'s body: ``{"prompts": [...], "completions": [...]}`` (prompts as text or chat messages),
    or ``{"messages": [[...], ...]}`` (each a conversation whose last message is the assistant's answer);
    optional ``ended`` (did each answer reach EOS; default true), ``answers`` (reference answers, for the judge
    and rule sources), ``input_ids`` (the rows as token ids of the server's tokenizer, see ``/info``) and
    ``fields`` (other row fields, by name, for user functions)."""
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
    taken = [k for k in fields if k in RESERVED_FIELDS]
    if taken:
        raise BadRequest(422, f"'fields' may not set {taken[0]!r}: the server sets it ({', '.join(RESERVED_FIELDS)} "
                              "are reserved; send 'answers' and 'ended' instead)")
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

    # ------------------------------------------------------------------------------------------- rows
    def rows(self, req: ScoreRequest) -> list[list[int]]:
        """The reward model's token rows of a request (none without a reward model)."""
        if self.reward_model is None:
            return []
        from dschat.rlhf.scoring import encode_for_reward

        if req.input_ids is not None:
            for i, row in enumerate(req.input_ids):
                if len(row) > self.limits.max_seq_len:
                    raise BadRequest(422, f"input_ids[{i}] has {len(row)} tokens; at most {self.limits.max_seq_len} "
                                          "(--max-seq-len)")
                if min(row) < 0 or max(row) >= self.vocab:
                    raise BadRequest(422, f"input_ids[{i}] holds an id outside the vocabulary [0, {self.vocab})")
            return req.input_ids
        rows, _ = encode_for_reward(req.prompts, req.completions, req.ended, self.tokenizer, self.limits.max_seq_len)
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise BadRequest(422, f"row {empty[0]} encodes to no tokens (empty prompt and answer)")
        return rows

    def score_rows(self, rows: list[list[int]]) -> torch.Tensor:
        from dschat import engine as E
        from dschat.rlhf.scoring import score_rows

        return score_rows(self.reward_model, rows, self.tokenizer.pad_token_id, E.device(),
                          self.limits.max_batch_tokens)

    def job(self, req: ScoreRequest, openrlhf: bool = False) -> Job:
        """The batcher's job of a request; 413 when its rows cost more than ``--max-request-tokens`` padded
        tokens (token ids are counted before they are checked, text once encoded)."""
        from dschat.rlhf.scoring import score_width

        if req.input_ids is not None and self.reward_model is not None:
            self._check_cost([score_width(len(r)) for r in req.input_ids])
        rows = self.rows(req)
        widths = [score_width(len(r)) for r in rows]
        self._check_cost(widths)
        return Job(rows, {"request": req, "openrlhf": openrlhf}, widths)

    def _check_cost(self, widths: list[int]) -> None:
        cost, cap = sum(widths), self.limits.max_request_tokens
        if cost > cap:
            raise BadRequest(413, f"the rows cost {cost} padded tokens; at most {cap} per request "
                                  "(--max-request-tokens): send fewer rows per request (the client's "
                                  "--reward-request-rows)")

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
