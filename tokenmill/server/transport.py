"""Bounds on the HTTP transport that uvicorn does not set: a deadline for each request's head and a
cap on open connections.

uvicorn closes a keep-alive connection that stays idle after a response, but not a connection that
never sends anything, nor one that sends its request line and headers a byte at a time (slowloris):
either holds a socket, and a slot of any concurrency limit, for as long as the client likes. This
subclass of uvicorn's h11 protocol gives every request head `head_timeout` seconds from its first
byte (from the connection's start for the first) and closes connections beyond `max_connections`
as they open. Bodies get their deadline and size cap in the app's middleware (guard.Guard).
"""
from __future__ import annotations

import asyncio
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tokenmill.server")


def add_arguments(p, seconds) -> None:
    """The front door's flags, shared by `serve` and `router` (`seconds`: the CLI's parser of a
    positive number of seconds)."""
    p.add_argument("--graceful-shutdown-timeout", type=int, default=30,
                   help="seconds SIGTERM waits for running requests to finish (default: 30)")
    p.add_argument("--client-timeout", type=seconds, default=30.0,
                   help="seconds a client has to send a request's head, and again its body (default: 30)")
    p.add_argument("--max-connections", type=int, default=2048,
                   help="open connections beyond which new ones are closed at once (default: 2048)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="largest request body, declared or chunked (default: 8 MiB)")
    p.add_argument("--uvicorn-log-level", default="warning")


def bounded_h11(head_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with these bounds (pass as uvicorn.Config(http=...))."""
    if not head_timeout > 0:
        raise ValueError(f"the request head timeout must be positive, got {head_timeout}.")
    if max_connections < 1:
        raise ValueError(f"the connection limit must be at least 1, got {max_connections}.")
    return type("BoundedH11Protocol", (_BoundedH11,), {"head_timeout": float(head_timeout),
                                                      "max_connections": int(max_connections)})


class _BoundedH11(H11Protocol):
    head_timeout = 30.0
    max_connections = 2048
    _last_warning = 0.0  # refusals are logged at most once a minute (they come in floods)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - _BoundedH11._last_warning > 60:
                _BoundedH11._last_warning = now
                log.warning("refusing connections beyond --max-connections %d", self.max_connections)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self._head_timer is not None and not self._between_requests():
            self._head_timer.cancel()  # the head is complete: the app has the request
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()  # nothing to answer: no request arrived
