"""The connection guard of ``dschat serve``: a cap on open connections and a deadline for a request's line and
headers, which uvicorn lacks (its keep-alive timeout only starts after a first answer, so a half-sent request
holds its connection for ever).

``ConnectionGuard.protocol()`` is uvicorn's h11 protocol with these additions, in the asyncio protocol calls that
every transport makes (``connection_made``, ``data_received``, ``connection_lost``) and in the ASGI app the
protocol calls:

- past ``max_connections`` a new connection closes the oldest one that has no request in progress (a slow or
  idle one), so a slow client cannot lock the others out; when every connection is busy, the new one is turned
  away. Either way the connection shed gets a status: 503 with ``Retry-After`` (``shed``), unless it is a
  keep-alive connection that has sent nothing since its last answer, which is simply closed;
- a connection with no request in progress for ``header_timeout`` seconds (since it opened, or since its last
  answer) is closed: a request line or headers that take longer never reach the app.

A shed connection's 503 must reach its client: closing a socket whose peer's request is still unread makes the
kernel send a reset, which can destroy the answer before the client reads it. So a shed connection sends its 503,
shuts its sending side, reads and discards what still comes, and closes when the client does (at most ``LINGER``
seconds later).

The body's own deadline (``--body-timeout``) is the app's (``server``), which reads the body. Everything here runs
on the event loop's thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

# the request line and headers, in bytes, at most (h11's own default; more: 400 from uvicorn)
MAX_HEADER_BYTES = 16 * 1024
LINGER = 2.0  # seconds a shed connection stays open, discarding what it receives, for its 503 to be read
RETRY_AFTER = 1  # seconds, in the 503 of a shed connection

_BUSY_BODY = b'{"error": "every connection is busy (--max-connections); retry later"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: %d\r\ncontent-length: %d\r\n\r\n" % (RETRY_AFTER, len(_BUSY_BODY))) + _BUSY_BODY


@dataclass
class _Conn:
    transport: Any
    protocol: Any = None
    busy: int = 0  # requests in the app (0 or 1: HTTP/1.1 serves one at a time)
    idle_since: float = 0.0
    timer: Any = None
    quiet: bool = False  # it has been answered and has sent nothing since


def _in_request(protocol: Any) -> bool:
    """Whether uvicorn's protocol has a request whose headers are in and whose answer is not complete (true from
    the moment the headers are parsed, before the app's task starts)."""
    cycle = getattr(protocol, "cycle", None)
    return cycle is not None and not cycle.response_complete


class ConnectionGuard:
    """Open connections of one server. Counters for the log and the tests: ``peak`` (most open at once),
    ``timed_out`` (closed by ``header_timeout``), ``evicted`` (closed to admit a newer one), ``refused`` (turned
    away, every connection busy), ``shed`` (answered 503 of those two)."""

    def __init__(self, max_connections: int, header_timeout: float):
        self.max, self.timeout = max_connections, header_timeout
        self.open: dict[int, _Conn] = {}  # by id of the protocol, oldest first
        self.lingering: set[Any] = set()  # transports of shed connections not closed yet
        self.peak = self.timed_out = self.evicted = self.refused = self.shed = 0

    # ------------------------------------------------------------------------------------------- admission
    def _busy(self, conn: _Conn) -> bool:
        return conn.busy > 0 or _in_request(conn.protocol)

    def admit(self, key: int, transport: Any, loop: asyncio.AbstractEventLoop, protocol: Any = None) -> bool:
        if len(self.open) >= self.max:
            idle = next((k for k, c in self.open.items() if not self._busy(c)), None)
            if idle is None:
                self.refused += 1
                self._shed(transport, protocol, loop)
                return False
            self.evicted += 1
            old = self.open.pop(idle)
            self._cancel(old)
            if old.quiet:  # a keep-alive connection with nothing pending: closing it is ordinary HTTP
                old.transport.close()
            else:
                self._shed(old.transport, old.protocol, loop)
        conn = _Conn(transport, protocol, idle_since=time.monotonic())
        self.open[key] = conn
        self.peak = max(self.peak, len(self.open))
        self._arm(key, conn, loop)
        return True

    def _shed(self, transport: Any, protocol: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Answer 503 (``Retry-After``) and close without a reset: stop sending, discard what comes in, close when
        the client does or after ``LINGER`` seconds."""
        self.shed += 1
        if protocol is not None:
            protocol.dschat_shed = True  # its data_received discards from now on
        if transport.is_closing():
            return
        transport.write(_BUSY)
        if len(self.lingering) >= self.max or not transport.can_write_eof():
            transport.close()  # too many lingering already: the answer is written, the close may reset it
            return
        transport.write_eof()
        self.lingering.add(transport)
        loop.call_later(LINGER, self._end_linger, transport)

    def _end_linger(self, transport: Any) -> None:
        self.lingering.discard(transport)
        transport.close()

    def received(self, key: int) -> None:
        conn = self.open.get(key)
        if conn is not None:
            conn.quiet = False

    def release(self, key: int, transport: Any = None) -> None:
        self.lingering.discard(transport)
        conn = self.open.pop(key, None)
        if conn is not None:
            self._cancel(conn)

    @staticmethod
    def _cancel(conn: _Conn) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    # ------------------------------------------------------------------------------------------- deadlines
    def _arm(self, key: int, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        self._cancel(conn)
        conn.timer = loop.call_later(self.timeout, self._expire, key, conn)

    def _expire(self, key: int, conn: _Conn) -> None:
        if self.open.get(key) is conn and not self._busy(conn):
            self.timed_out += 1
            self.open.pop(key)
            self._cancel(conn)
            conn.transport.close()

    def started(self, key: int) -> None:
        conn = self.open.get(key)
        if conn is not None:
            conn.busy += 1
            self._cancel(conn)

    def ended(self, key: int, loop: asyncio.AbstractEventLoop) -> None:
        conn = self.open.get(key)
        if conn is not None:
            conn.busy -= 1
            if conn.busy == 0:
                conn.idle_since = time.monotonic()
                conn.quiet = True
                self._arm(key, conn, loop)

    # ------------------------------------------------------------------------------------------- uvicorn
    def protocol(self) -> type:
        """uvicorn's h11 protocol class under this guard (``uvicorn.Config(http=...)``)."""
        from uvicorn.protocols.http.h11_impl import H11Protocol

        guard = self

        class GuardedH11Protocol(H11Protocol):
            dschat_shed = False  # answered 503 by the guard: what it receives is discarded

            def connection_made(self, transport: Any) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if not guard.admit(id(self), transport, self.loop, self):
                    return
                inner, loop, key = self.app, self.loop, id(self)

                async def app(scope: Any, receive: Any, send: Any) -> None:
                    guard.started(key)
                    try:
                        await inner(scope, receive, send)
                    finally:
                        guard.ended(key, loop)

                self.app = app  # the protocol calls it once a request's headers are in

            def data_received(self, data: bytes) -> None:
                if self.dschat_shed:
                    return
                guard.received(id(self))
                super().data_received(data)

            def connection_lost(self, exc: Exception | None) -> None:
                guard.release(id(self), self.transport)
                super().connection_lost(exc)

        return GuardedH11Protocol
