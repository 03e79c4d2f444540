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


ANTHROPIC_PATHS = "/v1/messages"  # its routes answer errors in Anthropic's shape
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, type_: str, param: str | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error body, or Anthropic's on its paths (the type named by the status there)."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error(status, message), status_code=status)
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

    def _authorized(self, auth: str, x_api_key: str) -> int | None:
        """The index of the key sent (as a bearer token, or in Anthropic's x-api-key header), or
        None. Constant-time against every key: how long a wrong key takes says nothing about a
        right one."""
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""  # RFC 7235: any case
        given = given or x_api_key.strip().encode("latin-1")
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
            key = self._authorized(hdrs.get("authorization", ""), hdrs.get("x-api-key", ""))
            if key is None:
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                           "'x-api-key: <key>')", "authentication_error", path=scope["path"])
                return await resp(scope, receive, send)
            if self.salt_by_key:
                scope[KEY_SALT] = self.salts[key]
        length = hdrs.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _closing(413, f"request body of {length} bytes exceeds the limit of {self.max_bytes} "
                                       "bytes", scope["path"])(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
            except _BodyTooLarge:
                return await _closing(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                      scope["path"])(scope, receive, send)
            except asyncio.TimeoutError:
                return await _closing(408, f"the request body did not arrive within {self.body_timeout:g} s",
                                      scope["path"])(scope, receive, send)
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


def _closing(status: int, message: str, path: str) -> JSONResponse:
    """An error for a request whose body was not read to its end: the connection cannot carry
    another request, so it is closed after the answer."""
    resp = error_response(status, message, "invalid_request_error", path=path)
    resp.headers["connection"] = "close"
    return resp


def _replay(body: bytes, receive):
    """The ASGI receive of a request whose body was read already: the body once, then the
    connection's own messages (the disconnect that handlers watch for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed
