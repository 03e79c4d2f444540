"""What a failed request answers: OpenAI-style error bodies with the right status, the message
and (where one field is to blame) its name, never exception text from inside the server."""
from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineDeadError, QueueTimeoutError, RequestFailedError, RequestTimeoutError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.guard import error_response

log = logging.getLogger("tokenmill.server")
# what the engine's own failures answer, before the first byte (a status) or after it (an event).
# A request past --request-timeout is a 504 (the server gave up on it, like a gateway does), one
# never scheduled within --max-queue-time a 503 (overloaded: safe to retry elsewhere, nothing ran).
ENGINE_ERRORS = {RequestFailedError: (500, "internal_error"), EngineDeadError: (503, "internal_error"),
                 RequestTimeoutError: (504, "timeout_error"), QueueTimeoutError: (503, "server_overloaded")}
PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {"prompt", "messages", "max_completion_tokens",
                                                          "response_format", "structured_outputs"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def bad_request(e: ValueError) -> APIError:
    msg = str(e)
    first = msg.split(" ", 1)[0].strip("(),:")
    return APIError(400, msg, param=first if first in PARAM_NAMES else None)


def install_handlers(app: FastAPI) -> None:
    """Every exception a route can raise, as its error body."""
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", "invalid_request_error",
                                  path=request.url.path)
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                        for er in errs[:3])
        return error_response(400, msg, "invalid_request_error", loc[0] if loc else None, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error", path=request.url.path)

    @app.exception_handler(RequestFailedError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestTimeoutError)
    @app.exception_handler(QueueTimeoutError)
    async def _engine_failed(request, e: Exception):
        status, type_ = ENGINE_ERRORS[type(e)]
        return error_response(status, str(e), type_, path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):  # the details go to the log, never to the client
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s", ref, exc_info=e)
        return error_response(500, f"internal error (reference {ref} in the server log)", "internal_error",
                              path=request.url.path)
