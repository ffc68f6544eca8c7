"""Remote reward sources: ``--reward-funcs http://host:port/score`` scores completions on a ``dschat serve`` (or any
server answering its request shape; docs/serving.md), weighted like any other source (``--reward-weights``).

The client is the standard library's (``urllib.request``): one POST per scoring batch (or chunks of
``--reward-request-rows``), a timeout per request, retries with exponential backoff on connection errors,
timeouts, 429 and 5xx (never on another 4xx, which is the caller's mistake and stops at once with the server's
reason), and a circuit breaker: when a request still fails after its retries, the source is down and raises
``RewardServerDown``; stage 3 then saves the state of its last completed step and stops (exit code 4), so the
run continues with ``--resume`` once the server answers again.

The bearer token comes from ``--reward-token-file`` or the environment variable ``DSCHAT_REWARD_TOKEN``; it is
held by the client alone, never logged, never written to a run's files.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dschat.errors import ExitCode, UserError

TOKEN_ENV = "DSCHAT_REWARD_TOKEN"
SCHEMES = ("http://", "https://")


class RewardServerDown(UserError):
    """A remote reward source stayed unreachable (or kept failing) through its retries. Stage 3 saves the state
    of its last completed step first; exit code 4, as a run stopped with a state."""

    exit_code = ExitCode.STOPPED


def is_remote(name: str) -> bool:
    """Whether a ``--reward-funcs`` entry names a reward server."""
    return name.startswith(SCHEMES)


def read_token_file(path: str, flag: str) -> str:
    """The first line of the token file ``path`` (given as ``flag``): a bearer token, never logged."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            token = fh.readline().strip()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if not token:
        raise UserError(f"{flag} {path}: the file is empty")
    return token


def read_token(token_file: str = "") -> str | None:
    """The bearer token: the first line of ``token_file``, else ``$DSCHAT_REWARD_TOKEN``, else None."""
    if token_file:
        return read_token_file(token_file, "--reward-token-file")
    return os.environ.get(TOKEN_ENV) or None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary and EOS: equal fingerprints mean the same ids for the same tokens,
    so a client may send its own token ids (``input_ids``) instead of text that would be re-encoded."""
    vocab = sorted(tokenizer.get_vocab().items())
    text = json.dumps([vocab, tokenizer.eos_token_id], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass
class RemoteSettings:
    timeout: float = 60.0  # seconds per request
    retries: int = 4  # after the first try
    backoff: float = 1.0  # seconds before the first retry, doubled each time
    request_rows: int = 0  # rows per request; 0: one request per scoring batch
    token: str | None = None


class _Retryable(Exception):
    pass


class RemoteReward:
    """A reward function (``fn(prompts, completions, **row_fields) -> list[float]``) backed by a reward server.

    ``sleep`` is injectable so tests need not wait out the backoff.
    """

    def __init__(self, url: str, settings: RemoteSettings | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        if not is_remote(url):
            raise UserError(f"reward server {url!r}: the address must start with http:// or https://")
        self.url, self.s, self.sleep = url, settings or RemoteSettings(), sleep
        self.base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
        self.fingerprint: str | None = None  # of the caller's tokenizer (``bind_tokenizer``)
        self._server_info: dict[str, Any] | None = None
        self.down = False
        self.requests = 0

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Send token ids instead of text when the server's tokenizer is this one (stage 3: the actor's)."""
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"  # never the token

    # ------------------------------------------------------------------------------------------- scoring
    def __call__(self, prompts: list[str], completions: list[str], reached_eos: Sequence[bool] | None = None,
                 token_ids: Sequence[Sequence[int]] | None = None, answer: Sequence[Any] | None = None,
                 **row_fields: Any) -> list[float]:
        n = len(completions)
        if n == 0:
            return []
        ended = [bool(e) for e in reached_eos] if reached_eos is not None else [True] * n
        use_ids = token_ids is not None and self.fingerprint is not None and self._server_tokenizer() == \
            self.fingerprint
        step = self.s.request_rows if self.s.request_rows > 0 else n
        out: list[float] = []
        for k in range(0, n, step):
            body: dict[str, Any] = {"prompts": prompts[k: k + step], "completions": completions[k: k + step],
                                    "ended": ended[k: k + step]}
            if answer is not None:
                body["answers"] = [a if a is None or isinstance(a, str) else str(a) for a in answer[k: k + step]]
            if use_ids:
                assert token_ids is not None
                body["input_ids"] = [[int(t) for t in row] for row in token_ids[k: k + step]]
            out += self._scores(self._post(self.url, body), len(body["completions"]))
        return out

    def _scores(self, reply: Any, n: int) -> list[float]:
        values = reply.get("scores", reply.get("rewards")) if isinstance(reply, dict) else None
        if not isinstance(values, list):
            raise UserError(f"reward server {self.url}: the reply has no list 'scores'")
        if len(values) != n:
            raise UserError(f"reward server {self.url}: {len(values)} scores for {n} completions")
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise UserError(f"reward server {self.url}: a score is not a finite number ({v!r})")
            out.append(float(v))
        return out

    def _server_tokenizer(self) -> str | None:
        if self._server_info is None:
            try:
                self._server_info = self._request(self.base + "/info", None, retry=True)
            except UserError as e:
                if isinstance(e, RewardServerDown):
                    raise
                self._server_info = {}  # not a dschat server (no /info): text only
        info = self._server_info if isinstance(self._server_info, dict) else {}
        return info.get("tokenizer")

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        return self._request(url, json.dumps(body).encode("utf-8"), retry=True)

    # ------------------------------------------------------------------------------------------- transport
    def _request(self, url: str, data: bytes | None, retry: bool) -> Any:
        if self.down:
            raise RewardServerDown(f"reward server {self.url} is down (an earlier request failed through its "
                                   "retries)")
        tries = 1 + (max(0, self.s.retries) if retry else 0)
        last = ""
        for attempt in range(tries):
            if attempt:
                self.sleep(self.s.backoff * 2 ** (attempt - 1))
            try:
                return self._once(url, data)
            except _Retryable as e:
                last = str(e)
        self.down = True
        raise RewardServerDown(f"reward server {self.url} failed {tries} time(s), last: {last}")

    def _once(self, url: str, data: bytes | None) -> Any:
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.s.token:
            headers["Authorization"] = f"Bearer {self.s.token}"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.s.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            reason = _reason(e)
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code} {reason}") from None
            raise UserError(f"reward server {url} answered HTTP {e.code}: {reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut
            why = getattr(e, "reason", e)
            raise _Retryable(f"{type(why).__name__}: {why}" if str(why) else type(why).__name__) from None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"reward server {url}: the reply is not JSON ({raw[:60]!r})") from None


def _reason(e: urllib.error.HTTPError) -> str:
    """The server's one-line reason (``{"detail": ...}`` or ``{"error": ...}``), else the HTTP reason."""
    try:
        body = json.loads(e.read() or b"{}")
    except (ValueError, OSError):
        body = {}
    detail = body.get("error") or body.get("detail") if isinstance(body, dict) else None
    text = detail if isinstance(detail, str) else json.dumps(detail) if detail else str(e.reason)
    return " ".join(text.split())[:200]


def remote_reward(url: str, timeout: float = 60.0, retries: int = 4, backoff: float = 1.0, request_rows: int = 0,
                  token_file: str = "") -> RemoteReward:
    """The remote reward source at ``url`` with the run's client settings (``--reward-timeout``, ...)."""
    return RemoteReward(url, RemoteSettings(timeout, retries, backoff, request_rows, read_token(token_file)))
