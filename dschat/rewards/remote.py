"""Remote reward sources: ``--reward-funcs http://host:port/score`` scores completions on a ``dschat serve`` (or any
server answering its request shape; docs/serving.md), weighted like any other source (``--reward-weights``).

The client is the standard library's (``http.client``): one POST per scoring batch (or chunks of
``--reward-request-rows``), one deadline per request (connecting, sending and the whole reply; a server that
drips its answer cannot stretch it), retries with exponential backoff on connection errors, timeouts, 429 and 5xx
(never on another 4xx, which is the caller's mistake and stops at once with the server's reason), and a circuit
breaker: when a request still fails after its retries, the source is down and raises ``RewardServerDown``;
stage 3 then saves the state of its last completed step and stops (exit code 4), so the run continues with
``--resume`` once the server answers again.

The bearer token comes from ``--reward-token-file`` or the environment variable ``DSCHAT_REWARD_TOKEN``; it is
held by the client alone, never logged, never written to a run's files, and sent to the configured host only:
the client follows no redirect (a 3xx is an error) and uses no proxy.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import math
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dschat.errors import ExitCode, UserError, first_line

TOKEN_ENV = "DSCHAT_REWARD_TOKEN"
SCHEMES = ("http://", "https://")
MAX_REPLY_BYTES = 64 * 2**20  # a reply larger than this is refused (scores take a few dozen bytes a row)


class RewardServerDown(UserError):
    """A remote reward source stayed unreachable (or kept failing) through its retries. Stage 3 saves the state
    of its last completed step first; exit code 4, as a run stopped with a state."""

    exit_code = ExitCode.STOPPED


def is_remote(name: str) -> bool:
    """Whether a ``--reward-funcs`` entry names a reward server."""
    return name.startswith(SCHEMES)


def check_url(url: str) -> None:
    """A reward server's address as ``--reward-funcs`` gives it, checked before anything loads: http(s), a host,
    a port in 1..65535, no space or control character; else one line (``UserError``)."""
    if not is_remote(url):
        raise UserError(f"reward server {url!r}: the address must start with http:// or https://")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UserError(f"reward server {url!r}: the address holds a space or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port out of range or not a number, a bad IPv6 literal
        raise UserError(f"reward server {url!r}: not a valid address ({first_line(e, 100)})") from None
    if not parts.hostname:
        raise UserError(f"reward server {url!r}: the address names no host")
    if port == 0:
        raise UserError(f"reward server {url!r}: port 0 is not a port a server listens on")


def check_token(token: str, where: str) -> str:
    """A bearer token, surrounding whitespace (a file's CRLF, ``$(cat file)``'s ``\\r``) removed; one line
    naming ``where`` it came from, never the token, when it holds a character an HTTP header cannot carry."""
    token = token.strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise UserError(f"{where}: the token holds a line break or another control character; a bearer token is "
                        "one line of printable characters")
    try:
        token.encode("latin-1")
    except UnicodeEncodeError:
        raise UserError(f"{where}: the token holds a character an HTTP header cannot carry (outside Latin-1)") \
            from None
    return token


def read_token_file(path: str, flag: str) -> str:
    """The first line of the token file ``path`` (given as ``flag``): a bearer token, never logged."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            token = fh.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UserError(f"{flag} {path}: cannot read it ({why})") from None
    if not token:
        raise UserError(f"{flag} {path}: the file is empty")
    return check_token(token, f"{flag} {path}")


def read_token(token_file: str = "") -> str | None:
    """The bearer token: the first line of ``token_file``, else ``$DSCHAT_REWARD_TOKEN`` (surrounding whitespace
    removed in both), else None."""
    if token_file:
        return read_token_file(token_file, "--reward-token-file")
    value = os.environ.get(TOKEN_ENV, "")
    return check_token(value, f"${TOKEN_ENV}") or None if value.strip() else None


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
        check_url(url)
        self.url, self.s, self.sleep = url, settings or RemoteSettings(), sleep
        if self.s.token is not None:
            self.s.token = check_token(self.s.token, f"reward server {url}") or None
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
            try:  # an integer past float's range (10**400) overflows: not a finite number either
                ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
            except OverflowError:
                ok = False
            if not ok:
                raise UserError(f"reward server {self.url}: a score is not a finite number "
                                f"({_short(v)})")
            out.append(float(v))
        return out

    def _server_tokenizer(self) -> str | None:
        if self._server_info is None:
            try:
                self._server_info = self._request(self.base + "/info", None, retry=True)
            except UserError as e:
                if isinstance(e, RewardServerDown | RedirectRefused):
                    raise
                self._server_info = {}  # not a dschat server (no /info): text only
        info = self._server_info if isinstance(self._server_info, dict) else {}
        return info.get("tokenizer")

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        try:
            data = json.dumps(body, allow_nan=False).encode("utf-8")
        except ValueError:  # NaN or infinity in a row field: not JSON, and a server would refuse it
            raise UserError(f"reward server {self.url}: a row field holds NaN or an infinity, which JSON cannot "
                            "carry") from None
        return self._request(url, data, retry=True)

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
        self.requests += 1
        deadline = time.monotonic() + self.s.timeout
        try:
            status, reason, location, raw = _exchange(url, "POST" if data is not None else "GET", data, headers,
                                                      deadline)
        except _Overdue:
            raise _Retryable(f"timed out: no whole reply within {self.s.timeout:g} s (--reward-timeout)") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, cut, a bad status line
            raise _Retryable(f"{type(e).__name__}: {first_line(e)}" if str(e) else type(e).__name__) from None
        if 300 <= status < 400:
            where = f" to {first_line(location, 100)!r}" if location else ""
            raise RedirectRefused(f"reward server {url} answered HTTP {status} (a redirect{where}); redirects are "
                                  "not followed, so the token stays with this host: give the final address")
        if status >= 400:
            why = _reason(raw, reason)
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status} {why}")
            raise UserError(f"reward server {url} answered HTTP {status}: {why}")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):  # not JSON, nested too deep, a 5000-digit int
            raise UserError(f"reward server {url}: the reply is not JSON ({raw[:60]!r})") from None


class RedirectRefused(UserError):
    """A reward server answered 3xx: never followed (the token would go to the new host)."""


class _Overdue(Exception):
    pass


class _DeadlineSocket:
    """A connected socket whose every send and receive may only use the time left before ``deadline``
    (``time.monotonic()``): the bound is on the whole exchange, not on each read."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Overdue()
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise _Overdue() from None

    def recv_into(self, buffer: Any) -> int:
        self._arm()
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise _Overdue() from None

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        pass  # http.client closes the connection while its response still reads: _exchange closes the socket


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket):
        self.sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.sock.recv_into(buffer)


def _exchange(url: str, method: str, data: bytes | None, headers: dict[str, str],
              deadline: float) -> tuple[int, str, str, bytes]:
    """One HTTP request under one deadline: ``(status, reason, Location header, body)``. ``http.client`` itself
    follows no redirect and reads no proxy variables, so the request goes to this host and no other."""
    parts = urllib.parse.urlsplit(url)
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Overdue()
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=left)
    sock: socket.socket | None = None
    try:
        try:
            conn.connect()  # TCP (and TLS) within the time left
        except TimeoutError:
            raise _Overdue() from None
        sock = conn.sock
        conn.sock = _DeadlineSocket(sock, deadline)  # type: ignore[assignment]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(method, target, body=data, headers=headers)
        except (ValueError, http.client.InvalidURL):  # its message quotes the value: the token, maybe
            raise UserError(f"reward server {url}: a request header or the address is not valid HTTP") from None
        resp = conn.getresponse()
        declared = (resp.getheader("Content-Length") or "").strip()
        if declared.isdigit():
            if int(declared) > MAX_REPLY_BYTES:
                raise UserError(f"reward server {url}: a reply of {declared} bytes; at most {MAX_REPLY_BYTES}")
            raw = resp.read()  # IncompleteRead (retried) when the connection is cut before the end
        else:
            raw = resp.read(MAX_REPLY_BYTES + 1)
            if len(raw) > MAX_REPLY_BYTES:
                raise UserError(f"reward server {url}: a reply of over {MAX_REPLY_BYTES} bytes")
        return resp.status, resp.reason or "", resp.getheader("Location") or "", raw
    finally:
        conn.close()
        if sock is not None:
            sock.close()


def _short(value: Any, n: int = 40) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1024:
        return "an integer past float's range"
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _reason(raw: bytes, fallback: str) -> str:
    """The server's one-line reason (``{"detail": ...}`` or ``{"error": ...}``), else the HTTP reason."""
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        body = {}
    detail = body.get("error") or body.get("detail") if isinstance(body, dict) else None
    text = detail if isinstance(detail, str) else json.dumps(detail) if detail else fallback
    return " ".join(text.split())[:200]


def remote_reward(url: str, timeout: float = 60.0, retries: int = 4, backoff: float = 1.0, request_rows: int = 0,
                  token_file: str = "") -> RemoteReward:
    """The remote reward source at ``url`` with the run's client settings (``--reward-timeout``, ...)."""
    return RemoteReward(url, RemoteSettings(timeout, retries, backoff, request_rows, read_token(token_file)))
