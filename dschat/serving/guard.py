"""The connection guard of ``dschat serve``: a cap on open connections and a deadline for a request's line and
headers, which uvicorn lacks (its keep-alive timeout only starts after a first answer, so a half-sent request
holds its connection for ever).

``ConnectionGuard.protocol()`` is uvicorn's h11 protocol with two additions, both in the asyncio protocol calls
that every transport makes (``connection_made``, ``connection_lost``) and in the ASGI app the protocol calls:

- past ``max_connections`` a new connection closes the oldest one that has no request in progress (a slow or
  idle one), so a slow client cannot lock the others out; when every connection is busy, the new one gets one
  503 and is closed;
- a connection with no request in progress for ``header_timeout`` seconds (since it opened, or since its last
  answer) is closed: a request line or headers that take longer never reach the app.

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

_BUSY_BODY = b'{"error": "every connection is busy (--max-connections); retry later"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n" % len(_BUSY_BODY)) + _BUSY_BODY


@dataclass
class _Conn:
    transport: Any
    busy: int = 0  # requests in progress (0 or 1: HTTP/1.1 serves one at a time)
    idle_since: float = 0.0
    timer: Any = None


class ConnectionGuard:
    """Open connections of one server. Counters for the log and the tests: ``peak`` (most open at once),
    ``timed_out`` (closed by ``header_timeout``), ``evicted`` (closed to admit a newer one), ``refused`` (503)."""

    def __init__(self, max_connections: int, header_timeout: float):
        self.max, self.timeout = max_connections, header_timeout
        self.open: dict[int, _Conn] = {}  # by id of the protocol, oldest first
        self.peak = self.timed_out = self.evicted = self.refused = 0

    # ------------------------------------------------------------------------------------------- admission
    def admit(self, key: int, transport: Any, loop: asyncio.AbstractEventLoop) -> bool:
        if len(self.open) >= self.max:
            idle = next((k for k, c in self.open.items() if c.busy == 0), None)
            if idle is None:
                self.refused += 1
                transport.write(_BUSY)
                transport.close()
                return False
            self.evicted += 1
            self._close(idle)
        conn = _Conn(transport, idle_since=time.monotonic())
        self.open[key] = conn
        self.peak = max(self.peak, len(self.open))
        self._arm(key, conn, loop)
        return True

    def release(self, key: int) -> None:
        conn = self.open.pop(key, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    def _close(self, key: int) -> None:
        conn = self.open.pop(key)
        if conn.timer is not None:
            conn.timer.cancel()
        conn.transport.close()

    # ------------------------------------------------------------------------------------------- deadlines
    def _arm(self, key: int, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = loop.call_later(self.timeout, self._expire, key, conn)

    def _expire(self, key: int, conn: _Conn) -> None:
        if self.open.get(key) is conn and conn.busy == 0:
            self.timed_out += 1
            self._close(key)

    def started(self, key: int) -> None:
        conn = self.open.get(key)
        if conn is not None:
            conn.busy += 1
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None

    def ended(self, key: int, loop: asyncio.AbstractEventLoop) -> None:
        conn = self.open.get(key)
        if conn is not None:
            conn.busy -= 1
            if conn.busy == 0:
                conn.idle_since = time.monotonic()
                self._arm(key, conn, loop)

    # ------------------------------------------------------------------------------------------- uvicorn
    def protocol(self) -> type:
        """uvicorn's h11 protocol class under this guard (``uvicorn.Config(http=...)``)."""
        from uvicorn.protocols.http.h11_impl import H11Protocol

        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport: Any) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if not guard.admit(id(self), transport, self.loop):
                    return
                inner, loop, key = self.app, self.loop, id(self)

                async def app(scope: Any, receive: Any, send: Any) -> None:
                    guard.started(key)
                    try:
                        await inner(scope, receive, send)
                    finally:
                        guard.ended(key, loop)

                self.app = app  # the protocol calls it once a request's headers are in

            def connection_lost(self, exc: Exception | None) -> None:
                guard.release(id(self))
                super().connection_lost(exc)

        return GuardedH11Protocol
