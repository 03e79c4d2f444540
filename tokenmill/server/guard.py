"""The HTTP front door shared by `tokenmill serve` and `tokenmill router`: OpenAI's error body,
the API-key check and the bounded read of request bodies. Plain ASGI and pydantic: nothing of the
engine, so the router process imports it without torch."""
from __future__ import annotations

import asyncio
import hashlib
import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.server import protocol as P


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorBody(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from handlers):
    API key on every route but the open ones (/health; /metrics if public), and the request body
    read here, whole, before any handler runs: at most `max_bytes` whether declared
    (Content-Length) or chunked, within `body_timeout` seconds, so a client that sends slowly or
    without end holds nothing beyond that."""

    def __init__(self, app, api_keys: set[str], max_bytes: int, body_timeout: float, open_paths: set[str],
                 salt_by_key: bool = False) -> None:
        self.app, self.max_bytes, self.body_timeout, self.open_paths = app, max_bytes, body_timeout, open_paths
        self.api_keys = [k.encode() for k in sorted(api_keys)]
        # a key's prefix-cache namespace: a digest, so the key itself is kept nowhere else
        self.salts = [hashlib.sha256(b"tokenmill-cache-salt\0" + k).hexdigest()[:32] for k in self.api_keys]
        self.salt_by_key = salt_by_key

    def _authorized(self, auth: str) -> int | None:
        """The index of the key sent, or None. Constant-time against every key: how long a wrong
        key takes says nothing about a right one."""
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""  # RFC 7235: any case
        found = None
        for i, key in enumerate(self.api_keys):
            if hmac.compare_digest(given, key):
                found = i
        return found if given else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_keys and scope["path"] not in self.open_paths:
            key = self._authorized(hdrs.get("authorization", ""))
            if key is None:
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                      "authentication_error")
                return await resp(scope, receive, send)
            if self.salt_by_key:
                scope[KEY_SALT] = self.salts[key]
        length = hdrs.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _closing(413, f"request body of {length} bytes exceeds the limit of {self.max_bytes} "
                                       "bytes")(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
            except _BodyTooLarge:
                return await _closing(413, f"request body exceeds the limit of {self.max_bytes} bytes")(
                    scope, receive, send)
            except asyncio.TimeoutError:
                return await _closing(408, f"the request body did not arrive within {self.body_timeout:g} s")(
                    scope, receive, send)
            except _ClientGone:
                return None
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


KEY_SALT = "tokenmill.key_salt"  # ASGI scope entry: the prefix-cache namespace of the key used


def cache_salt(raw: Request, asked: str | None) -> str | None:
    """The request's prefix-cache namespace: its key's (with --cache-salt-from-api-key), then its
    own cache_salt within it."""
    key = raw.scope.get(KEY_SALT)
    if key is None:
        return asked
    return key if asked is None else f"{key}/{asked}"


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _closing(status: int, message: str) -> JSONResponse:
    """An error for a request whose body was not read to its end: the connection cannot carry
    another request, so it is closed after the answer."""
    resp = error_response(status, message, "invalid_request_error")
    resp.headers["connection"] = "close"
    return resp


def _replay(body: bytes, receive):
    """The ASGI receive of a request whose body was read already: the body once, then the
    connection's own messages (the disconnect that handlers watch for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed
