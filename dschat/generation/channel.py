"""The control channel between a trainer and a sampler: one TCP connection per sampler that carries small JSON
messages (requests, answers, verdicts, pings) and the tensors that go with them (prompt ids, sampled ids, their
log-probs). Weights never cross it: they go over the weight group (``dschat.generation.weight_plane``).

What it guarantees, whoever is on the other end:

- **Both ends hold the run's secret** before anything else crosses. The end that listens sends a nonce, the one
  that connects answers with its own nonce and an HMAC-SHA256 of both under the secret, and the listener proves
  the secret back the same way (``handshake``). A peer that cannot is refused in one line on both sides, and
  nothing it sent is read. The secret is a per-run random token that a trainer passes to the sampler it starts in
  that process's environment, or a file or ``DSCHAT_SAMPLER_TOKEN`` for a sampler started apart (``load_secret``).
  The channel authenticates its peers; it does not encrypt (listen on loopback or a private network).
- **Every wait ends within its timeout**, in one line: a peer that is gone closes the connection (seen at once, a
  ``kill -9`` included); one that is silent, or a TCP listener that never speaks, is given up at the timeout
  (``ChannelClosed``).
- **Every message is bounded and checked.** A frame is ``MAGIC``, a 4-byte header length, a UTF-8 JSON header
  (the message and the dtype and shape of each tensor) and the tensors' bytes. The header is at most
  ``MAX_HEADER`` bytes and ``MAX_DEPTH`` deep, JSON without NaN or infinities; at most ``MAX_TENSORS`` tensors of
  known dtypes and ``MAX_PAYLOAD`` bytes in all. Anything else is ``BadMessage``: one line naming what was wrong,
  exit code 2. Each message's fields are checked by its reader (``Fields``).
- **It binds what it is asked**: ``listen`` binds the host given, not every interface.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dschat.errors import UserError, first_line

MAGIC = b"DSC\x01"
HELLO = b"DSCH"
NONCE = 32
MAX_HEADER = 64 << 20  # bytes of one message's JSON
MAX_DEPTH = 64  # nesting of its JSON
MAX_TENSORS = 16  # tensors in one message
MAX_PAYLOAD = 4 << 30  # bytes of one message's tensors
MAX_DIMS = 4
HANDSHAKE_S = 5.0  # the longest a peer may take to prove the secret (within the caller's own timeout)
TOKEN_ENV = "DSCHAT_SAMPLER_TOKEN"
MIN_TOKEN = 16  # characters

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


class ChannelClosed(Exception):
    """The peer is gone (it closed the connection, or died) or sent nothing within the timeout. The caller says
    what that means for it (the sampler lost, the trainer gone)."""


class BadMessage(UserError):
    """The peer sent something this side cannot take (a malformed frame or message): one line, exit code 2."""


class Refused(UserError):
    """The peer does not hold the run's secret (or this side does not hold the peer's)."""


def new_secret() -> str:
    """A per-run secret: 64 hex characters."""
    return secrets.token_hex(32)


def load_secret(token_file: str = "", what: str = "--token-file") -> str:
    """The run's secret: the first line of ``token_file``, else ``$DSCHAT_SAMPLER_TOKEN``; a one-line error when
    there is none, or it is shorter than ``MIN_TOKEN`` characters."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{what} {token_file}: {first_line(e)}") from None
        where = token_file
    else:
        token, where = os.environ.get(TOKEN_ENV, "").strip(), f"${TOKEN_ENV}"
        if not token:
            raise UserError(f"a sampler started apart and its trainer prove a shared secret to each other: put one "
                            f"in {TOKEN_ENV} on both sides, or in a file given as {what} (e.g. the output of "
                            "python -c 'import secrets; print(secrets.token_hex(32))')")
    if len(token) < MIN_TOKEN:
        raise UserError(f"{where}: the secret is {len(token)} characters long; use at least {MIN_TOKEN}")
    return token


# ------------------------------------------------------------------------------------------------ sockets
def listen(host: str, port: int) -> socket.socket:
    """A socket listening at exactly ``host:port`` (``dschat.utils.listen_at``)."""
    from dschat.utils import listen_at

    return listen_at(host, port)


def _exactly(sock: socket.socket, n: int, deadline: float, into: memoryview | None = None) -> bytes | None:
    """``n`` bytes from ``sock`` before ``deadline`` (monotonic), into ``into`` if given; ``ChannelClosed`` on
    EOF or timeout."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelClosed("sent nothing in time")
        sock.settimeout(left)
        try:
            k = sock.recv_into(buf[got:], min(n - got, 1 << 24))
        except TimeoutError:
            raise ChannelClosed("sent nothing in time") from None
        except OSError as e:
            raise ChannelClosed(f"the connection failed ({first_line(e)})") from None
        if k == 0:
            raise ChannelClosed("closed the connection")
        got += k
    return None if into is not None else bytes(buf)


def _send(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelClosed("did not take what was sent in time")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise ChannelClosed("did not take what was sent in time") from None
    except OSError as e:
        raise ChannelClosed(f"the connection failed ({first_line(e)})") from None


def _mac(secret: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret.encode(), label + b"|" + b"".join(parts), hashlib.sha256).digest()


def handshake(sock: socket.socket, secret: str, listener: bool, timeout_s: float) -> None:
    """Prove the secret both ways (the module's docstring); ``Refused`` when the peer cannot, ``ChannelClosed``
    when it leaves or stays silent."""
    deadline = time.monotonic() + min(timeout_s, HANDSHAKE_S)
    if listener:
        ours = secrets.token_bytes(NONCE)
        _send(sock, HELLO + ours, deadline)
        got = _exactly(sock, len(HELLO) + 2 * NONCE, deadline)
        assert got is not None
        theirs, proof = got[len(HELLO):len(HELLO) + NONCE], got[len(HELLO) + NONCE:]
        if got[:len(HELLO)] != HELLO or not hmac.compare_digest(proof, _mac(secret, b"connector", ours, theirs)):
            _send(sock, b"NO", deadline)
            raise Refused("it did not prove the run's secret")
        _send(sock, b"OK" + _mac(secret, b"listener", theirs, ours), deadline)
        return
    got = _exactly(sock, len(HELLO) + NONCE, deadline)
    assert got is not None
    if got[:len(HELLO)] != HELLO:
        raise Refused("it is not a dschat peer (it did not start the handshake)")
    theirs, ours = got[len(HELLO):], secrets.token_bytes(NONCE)
    _send(sock, HELLO + ours + _mac(secret, b"connector", theirs, ours), deadline)
    reply = _exactly(sock, 2, deadline)
    if reply != b"OK":
        raise Refused("it refused this side's secret")
    proof = _exactly(sock, 32, deadline)
    assert proof is not None
    if not hmac.compare_digest(proof, _mac(secret, b"listener", ours, theirs)):
        raise Refused("it did not prove the run's secret")


# ------------------------------------------------------------------------------------------------ channel
class Channel:
    """One authenticated connection: ``send`` a message with its tensors, ``recv`` the next one. Each call waits
    at most ``timeout_s``. Not shared between threads (each side has one user)."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float):
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None:
        deadline = time.monotonic() + self.timeout_s
        flat = [t.detach().contiguous().cpu().reshape(-1) for t in tensors]
        head = json.dumps({"m": msg, "t": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]},
                          allow_nan=False).encode()
        _send(self.sock, MAGIC + struct.pack(">I", len(head)) + head, deadline)
        for t in flat:
            if t.numel():
                _send(self.sock, memoryview(t.view(torch.uint8).numpy()), deadline)

    def recv(self, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next message and its tensors; ``ChannelClosed`` when the peer is gone or silent past the timeout,
        ``BadMessage`` for a frame or JSON this side will not take."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        start = _exactly(self.sock, 8, deadline)
        assert start is not None
        if start[:4] != MAGIC:
            raise BadMessage("a frame that does not start as dschat's do")
        (n,) = struct.unpack(">I", start[4:])
        if n > MAX_HEADER:
            raise BadMessage(f"a message of {n} bytes (at most {MAX_HEADER})")
        raw = _exactly(self.sock, n, deadline)
        assert raw is not None
        head = parse_json(raw)
        if not isinstance(head, dict) or not isinstance(head.get("m"), dict) or not isinstance(head.get("t"), list):
            raise BadMessage("a frame without its message and tensor list")
        specs = head["t"]
        if len(specs) > MAX_TENSORS:
            raise BadMessage(f"{len(specs)} tensors in one message (at most {MAX_TENSORS})")
        shapes, total = [], 0
        for i, spec in enumerate(specs):
            ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and spec[0] in DTYPES and \
                isinstance(spec[1], list) \
                and len(spec[1]) <= MAX_DIMS and all(type(d) is int and 0 <= d < 2**40 for d in spec[1])
            if not ok:
                raise BadMessage(f"tensor {i}: {json.dumps(spec)[:80]} is not [dtype, shape] of a known dtype")
            dtype, shape = DTYPES[spec[0]], spec[1]
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            total += size
            if total > MAX_PAYLOAD:
                raise BadMessage(f"tensors of more than {MAX_PAYLOAD} bytes in one message")
            shapes.append((dtype, shape, size))
        tensors = []
        for dtype, shape, size in shapes:
            buf = torch.empty(size, dtype=torch.uint8)
            if size:
                _exactly(self.sock, size, deadline, memoryview(buf.numpy()))
            tensors.append(buf.view(dtype).reshape(shape))
        return head["m"], tensors

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def parse_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN or infinity, at most ``MAX_DEPTH`` deep; else ``BadMessage``."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not a number JSON allows")

    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=refuse)
    except UnicodeDecodeError:
        raise BadMessage("a message that is not UTF-8") from None
    except RecursionError:
        raise BadMessage(f"a message nested deeper than {MAX_DEPTH}") from None
    except ValueError as e:
        raise BadMessage(f"a message that is not JSON ({first_line(e, 80)})") from None
    if _depth(value) > MAX_DEPTH:
        raise BadMessage(f"a message nested deeper than {MAX_DEPTH}")
    return value


def _depth(value: Any, at: int = 0) -> int:
    if at > MAX_DEPTH:
        return at
    if isinstance(value, dict):
        return max((_depth(v, at + 1) for v in value.values()), default=at + 1)
    if isinstance(value, list):
        return max((_depth(v, at + 1) for v in value), default=at + 1)
    return at


def connect(host: str, port: int, secret: str, timeout_s: float,
            alive: Callable[[], bool] | None = None) -> Channel:
    """A channel to ``host:port``, retried until it takes a connection (a sampler still starting) or
    ``timeout_s`` passes; ``alive`` (say, "the sampler process has not exited") is asked between tries.
    ``Refused`` when the listener there does not hold the secret; ``ChannelClosed`` when nothing answers."""
    deadline = time.monotonic() + timeout_s
    last = "nothing listens there"
    while True:
        if alive is not None and not alive():
            raise ChannelClosed("exited before it listened")
        try:
            sock = socket.create_connection((host, port), timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
        except OSError as e:
            last = e.strerror or first_line(e)
            if time.monotonic() > deadline:
                raise ChannelClosed(f"did not take a connection within {timeout_s:g} s: {last}") from None
            time.sleep(0.2)
            continue
        try:
            handshake(sock, secret, listener=False, timeout_s=max(deadline - time.monotonic(), 1.0))
        except Refused:
            sock.close()
            raise
        except ChannelClosed as e:  # a listener busy with another peer's handshake, or not dschat's: again
            sock.close()
            last = f"no handshake: {e}"
            if time.monotonic() > deadline:
                raise ChannelClosed(f"did not take a connection within {timeout_s:g} s: {last}") from None
            time.sleep(0.2)
            continue
        return Channel(sock, f"{host}:{port}", timeout_s)


def accept(listener: socket.socket, secret: str, wait_s: float, log: Callable[[str], None],
           timeout_s: float | None = None) -> Channel:
    """The first peer that proves the secret, within ``wait_s``; a peer that does not is refused (one line to
    ``log``) and the wait goes on. The channel's own waits are ``timeout_s`` each (default ``wait_s``).
    ``ChannelClosed`` when none came in time."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelClosed(f"no peer proved the run's secret within {wait_s:g} s")
        listener.settimeout(left)
        try:
            sock, addr = listener.accept()
        except TimeoutError:
            continue
        peer = f"{addr[0]}:{addr[1]}"
        try:
            handshake(sock, secret, listener=True, timeout_s=left)
        except (Refused, ChannelClosed) as e:
            log(f"refused a connection from {peer}: {first_line(e)}")
            sock.close()
            continue
        return Channel(sock, peer, wait_s if timeout_s is None else timeout_s)


# ------------------------------------------------------------------------------------------------- fields
class Fields:
    """One received message's fields, each read with its type and range checked; a wrong one is ``BadMessage``
    naming ``where`` and the field (``sample.settings.temperature: nan is not a finite number``)."""

    def __init__(self, msg: Any, where: str):
        if not isinstance(msg, dict):
            raise BadMessage(f"{where}: not a JSON object")
        self.msg, self.where = msg, where

    def _bad(self, key: str, why: str) -> BadMessage:
        return BadMessage(f"{self.where}.{key}: {why}")

    def has(self, key: str) -> bool:
        return self.msg.get(key) is not None

    def int(self, key: str, low: int | None = None, high: int | None = None, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        if type(v) is not int:
            raise self._bad(key, f"{json.dumps(v)[:40]} is not an integer")
        if (low is not None and v < low) or (high is not None and v > high):
            raise self._bad(key, f"{v} is out of range [{low}, {high}]")
        return v

    def number(self, key: str, low: float | None = None, high: float | None = None, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        if type(v) not in (int, float) or not math.isfinite(v):
            raise self._bad(key, f"{json.dumps(v)[:40]} is not a finite number")
        if (low is not None and v < low) or (high is not None and v > high):
            raise self._bad(key, f"{v} is out of range [{low}, {high}]")
        return float(v)

    def bool(self, key: str, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        if type(v) is not bool:
            raise self._bad(key, f"{json.dumps(v)[:40]} is not true or false")
        return v

    def str(self, key: str, choices: Sequence[str] | None = None, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = f"one of {', '.join(choices)}" if choices is not None else "a string"
            raise self._bad(key, f"{json.dumps(v)[:40]} is not {want}")
        return v

    def list(self, key: str, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        if not isinstance(v, list):
            raise self._bad(key, "is not a list")
        return v

    def ints(self, key: str, low: int = 0, length: int | None = None) -> list[int]:
        v = self.list(key)
        if (length is not None and len(v) != length) or not all(type(x) is int and x >= low for x in v):
            raise self._bad(key, f"{json.dumps(v)[:60]} is not a list of {length or ''} integers >= {low}")
        return v

    def fields(self, key: str, default: Any = ...) -> Any:
        v = self.msg.get(key)
        if v is None and default is not ...:
            return default
        return Fields(v, f"{self.where}.{key}")

    def tensors(self, got: list[torch.Tensor], want: Sequence[tuple[torch.dtype, Sequence[int]]]) -> None:
        """The message's tensors are exactly ``want`` (dtype, shape), in order."""
        if len(got) != len(want) or any(t.dtype != d or list(t.shape) != list(s)
                                        for t, (d, s) in zip(got, want, strict=False)):
            have = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in got]
            need = [(str(d).removeprefix("torch."), list(s)) for d, s in want]
            raise BadMessage(f"{self.where}: tensors {have} where {need} were due")
