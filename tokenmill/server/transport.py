"""Bounds on the HTTP transport that uvicorn does not set: a deadline for each request's head and a
cap on open connections.

uvicorn closes a keep-alive connection that stays idle after a response, but not a connection that
never sends anything, nor one that sends its request line and headers a byte at a time (slowloris):
either holds a socket, and a slot of any concurrency limit, for as long as the client likes. This
subclass of uvicorn's HTTP protocol gives every request head `head_timeout` seconds from its first
byte (from the connection's start for the first) and closes connections beyond `max_connections`
as they open. Bodies get their deadline and size cap in the app's middleware (guard.Guard).

The protocol is uvicorn's httptools one (llhttp, a C parser) where httptools is installed, else its
h11 one (pure Python): parsing the request and framing the response in Python costs the router a
measurable part of what it adds to a request. Both keep `cycle` (the request in progress), which is
all the bounds need.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional: uvicorn's h11 protocol does the same, slower
    HttpToolsProtocol = None

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
    p.add_argument("--http-parser", choices=("auto", "httptools", "h11"), default="auto",
                   help="the front door's HTTP/1.1 parser: httptools (C) or h11 (pure Python); "
                        "auto: httptools where installed")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the front door's event loop: auto: uvloop where installed")


def front_door(args) -> dict:
    """uvicorn.Config keyword arguments for the flags add_arguments defines."""
    if args.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ValueError("--event-loop uvloop needs the uvloop package (pip install uvloop).")
    return {"http": bounded_http(args.client_timeout, args.max_connections, args.http_parser),
            "loop": args.event_loop, "log_level": args.uvicorn_log_level,
            "timeout_graceful_shutdown": args.graceful_shutdown_timeout}


def bounded_http(head_timeout: float, max_connections: int, parser: str = "auto") -> type:
    """uvicorn's HTTP protocol class with these bounds (pass as uvicorn.Config(http=...)); `parser`
    is "httptools", "h11" or "auto" (httptools where installed)."""
    if not head_timeout > 0:
        raise ValueError(f"the request head timeout must be positive, got {head_timeout}.")
    if max_connections < 1:
        raise ValueError(f"the connection limit must be at least 1, got {max_connections}.")
    if parser == "auto":
        parser = "h11" if HttpToolsProtocol is None else "httptools"
    if parser == "httptools" and HttpToolsProtocol is None:
        raise ValueError("the httptools parser needs the httptools package (pip install httptools).")
    if parser not in ("h11", "httptools"):
        raise ValueError(f"unknown HTTP parser {parser!r}: expected auto, httptools or h11.")
    base = H11Protocol if parser == "h11" else HttpToolsProtocol
    return type(f"Bounded{base.__name__}", (_Bounds, base), {"head_timeout": float(head_timeout),
                                                           "max_connections": int(max_connections)})


class _Bounds:
    """Mixed in before one of uvicorn's HTTP protocol classes (which provides connections, cycle,
    loop and transport)."""
    head_timeout = 30.0
    max_connections = 2048
    _last_warning = 0.0  # refusals are logged at most once a minute (they come in floods)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - _Bounds._last_warning > 60:
                _Bounds._last_warning = now
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
