"""FastAPI application: OpenAI-compatible routes over an EngineClient.

Every request is validated before it reaches the engine; every failure becomes an OpenAI-style
error body with the right status; a client that goes away aborts its request in the engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import (EngineDeadError, QueueFullError, QueueTimeoutError, RequestFailedError,
                                           RequestTimeoutError)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import protocol as P
from tokenmill.server import reasoning as R
from tokenmill.server import tools as T
from tokenmill.server.guard import Guard, cache_salt, error_response
from tokenmill.server.metrics import Metrics

log = logging.getLogger("tokenmill.server")
# what the engine's own failures answer, before the first byte (a status) or after it (an event).
# A request past --request-timeout is a 504 (the server gave up on it, like a gateway does), one
# never scheduled within --max-queue-time a 503 (overloaded: safe to retry elsewhere, nothing ran).
_ENGINE_ERRORS = {RequestFailedError: (500, "internal_error"), EngineDeadError: (503, "internal_error"),
                  RequestTimeoutError: (504, "timeout_error"), QueueTimeoutError: (503, "server_overloaded")}


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str]
    max_request_bytes: int = 8 << 20
    client_timeout: float = 30.0  # seconds a client has to send a request's body (its head: transport.py)
    metrics_public: bool = False  # /metrics without the API key (for a scraper inside a trusted network)
    allowed_origins: list[str] = field(default_factory=list)  # CORS: none unless configured
    cache_salt_from_api_key: bool = False  # each API key its own prefix-cache namespace
    tool_call_parser: str | None = None     # None: picked from the chat template (server/tools.py)
    reasoning_parser: str | None = None     # server/reasoning.py; None: thinking stays in content


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


_PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {"prompt", "messages", "max_completion_tokens",
                                                            "response_format", "structured_outputs"}


def build_app(client, config: ServerConfig, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None)
    model_name = config.served_model_names[0]

    # ------------------------------------------------------------ cross-cutting
    open_paths = {"/health"} | ({"/metrics"} if config.metrics_public else set())
    app.add_middleware(Guard, api_keys=set(config.api_keys), max_bytes=config.max_request_bytes,
                       body_timeout=config.client_timeout, open_paths=open_paths,
                       salt_by_key=config.cache_salt_from_api_key)
    if config.allowed_origins:  # outside the guard: browsers send CORS preflights without credentials
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", "invalid_request_error")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                        for er in errs[:3])
        return error_response(400, msg, "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(RequestFailedError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestTimeoutError)
    @app.exception_handler(QueueTimeoutError)
    async def _engine_failed(_, e: Exception):
        status, type_ = _ENGINE_ERRORS[type(e)]
        return error_response(status, str(e), type_)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):  # the details go to the log, never to the client
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s", ref, exc_info=e)
        return error_response(500, f"internal error (reference {ref} in the server log)", "internal_error")

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_model_names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"{config.served_model_names}", "not_found_error", "model")

    def tokenizer():
        if client.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer; send token ids")
        return client.tokenizer

    # ------------------------------------------------------------ simple routes
    @app.get("/health")
    async def health():
        # 503 once the engine has died: the process is on its way out, a supervisor should restart it
        if client.dead is not None:
            return error_response(503, "the engine has stopped after an error", "internal_error")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": n, "object": "model", "created": now, "owned_by": "tokenmill",
                                            "max_model_len": client.max_model_len} for n in config.served_model_names]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-tokenize")

    async def off_loop(fn, *args):
        """Template rendering and tokenization run on worker threads (tokenizers releases the
        GIL): a prompt of megabytes does not stall /health and every stream while it tokenizes."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest):
        check_model(req.model)
        tok = tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            split = True if req.split_special_tokens is None else req.split_special_tokens
            ids = await off_loop(_chat_ids, tok, _conversation(req.messages), req.add_generation_prompt, None, None,
                                 split, None)
        else:
            ids = await off_loop(_prompt_ids, tok, req.prompt, req.add_special_tokens, bool(req.split_special_tokens),
                                 None)
        body = await off_loop(lambda: json.dumps({"count": len(ids), "max_model_len": client.max_model_len,
                                                  "tokens": ids}).encode())  # a million ids: not on the loop
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest):
        check_model(req.model)
        tok = tokenizer()
        vocab = tok.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    # ------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        check_model(req.model)
        prompts = _completion_prompts(req.prompt)
        params = _sampling_params(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = prompts
        if client.tokenizer is not None and any(isinstance(p, str) for p in prompts):
            ids = [await off_loop(_prompt_ids, client.tokenizer, p, True, req.split_special_tokens,
                                  client.max_model_len) if isinstance(p, str) else p for p in prompts]
        salt = cache_salt(raw, req.cache_salt)
        streams = [client.generate(f"{rid}-{i}", p, params, req.priority, salt) for i, p in enumerate(ids)]
        firsts = await _until_disconnected(raw, _start_all(streams), streams)  # gone while queued: never prefilled
        if req.stream:
            return _sse(_completion_stream(rid, req, prompts, streams, firsts, params, model_name, client))
        finals = await _until_disconnected(raw, _collect_all(streams, firsts), streams)
        choices, usage, timings = [], _Usage(), None
        for pi, (prompt, out) in enumerate(zip(prompts, finals)):
            usage.add(out)
            timings = timings or _timings(out)
            for o in out.outputs:
                text = (prompt if isinstance(prompt, str) else "") + o.text if req.echo else o.text
                choices.append(P.CompletionChoice(index=pi * params.n + o.index, text=text,
                                                  logprobs=_completion_logprobs(o, client, req.logprobs) if req.logprobs is not None else None,
                                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        return P.CompletionResponse(id=rid, model=model_name, choices=choices, usage=usage.model(), timings=timings)

    # ------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, raw: Request):
        check_model(req.model)
        tok = tokenizer()
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        calls = _ToolPlan.of(req, config.tool_call_parser, tok.chat_template)
        # a constrained output (forced tool call) is the constraint's from its first token: no thinking
        thinking = None if calls.forced else config.reasoning_parser
        ids = await off_loop(_chat_ids, tok, _conversation(req.messages), req.add_generation_prompt,
                             req.chat_template_kwargs, req.tools, req.split_special_tokens, client.max_model_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, client.max_model_len - len(ids))
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = _sampling_params(req, max_tokens, top if req.logprobs else None, calls.constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = client.generate(rid, ids, params, req.priority, cache_salt(raw, req.cache_salt))
        first = (await _until_disconnected(raw, _start_all([stream]), [stream]))[0]
        if req.stream:
            return _sse(_chat_stream(rid, req, stream, first, model_name, client, calls, thinking))
        out = (await _until_disconnected(raw, _collect_all([stream], [first]), [stream]))[0]
        usage = _Usage()
        usage.add(out)
        choices = []
        for o in out.outputs:
            reasoning, answer = R.split(thinking, o.text) if thinking else (None, o.text)
            content, tool_calls = calls.parse(answer or "") if answer is not None else (None, [])
            finish = "tool_calls" if tool_calls and o.finish_reason == "stop" else o.finish_reason
            message = P.ChatResponseMessage(content=content, reasoning_content=reasoning,
                                            tool_calls=[c.to_openai() for c in tool_calls] or None)
            choices.append(P.ChatChoice(index=o.index, message=message,
                                        logprobs=_chat_logprobs(o, client, top) if req.logprobs else None,
                                        finish_reason=finish, stop_reason=o.stop_reason))
        return P.ChatCompletionResponse(id=rid, model=model_name, choices=choices, usage=usage.model(),
                                        timings=_timings(out))

    return app


# ---------------------------------------------------------------- tool calls
@dataclass
class _ToolPlan:
    """How one chat request's tool calls are produced and read back: `forced` (required / a
    named function: a JSON-schema constraint, its output read as calls) or `parser` (auto: the
    model's own format), or neither."""
    choice: object = None
    parser: str | None = None
    constraint: StructuredOutputsParams | None = None
    names: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, req, parser_name: str | None, template: str | None) -> "_ToolPlan":
        try:
            named = T.validate_tool_choice(req.tool_choice, req.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice == "required" or named is not None:
            schema = T.forced_schema(choice, req.tools, req.parallel_tool_calls is not False)
            return cls(choice, None, StructuredOutputsParams(json=schema))
        if choice == "auto" and req.tools:
            names = {t["function"]["name"] for t in req.tools}
            return cls(choice, T.pick_parser(parser_name, template) or "none", names=names)
        return cls(choice)

    @property
    def forced(self) -> bool:
        return self.constraint is not None

    def parse(self, text: str) -> tuple[str | None, list[T.ToolCall]]:
        if self.forced:  # cut short by max_tokens, it is no call: the text is returned as it is
            forced = T.forced_calls(self.choice, text)
            return (None, forced) if forced else (text, [])
        if self.parser is not None:
            return T.parse(self.parser, text, self.names)
        return text, []


class _ToolStream:
    """One streamed choice's deltas under a _ToolPlan: content as it comes, tool calls the way
    OpenAI streams them (per call: id, type and name first with empty arguments, then arguments)."""

    def __init__(self, plan: _ToolPlan) -> None:
        self.plan = plan
        self.parser = T.StreamingParser(plan.parser, plan.names) if plan.parser is not None and not plan.forced else None
        self.text = ""          # forced: the output so far
        self.named_id: str | None = None
        self.num_calls = 0

    def delta(self, text: str, final: bool) -> dict:
        calls: list[T.ToolCall] = []
        content = ""
        pieces: list[dict] = []
        if self.plan.forced and isinstance(self.plan.choice, dict):  # a named function: arguments stream as written
            if self.named_id is None and (text or final):
                self.named_id = T.ToolCall(self.plan.choice["function"]["name"], "").id
                pieces.append({"index": 0, "id": self.named_id, "type": "function",
                               "function": {"name": self.plan.choice["function"]["name"], "arguments": ""}})
                self.num_calls = 1
            if text:
                pieces.append({"index": 0, "function": {"arguments": text}})
        elif self.plan.forced:  # required: a JSON list of calls, read when complete
            self.text += text
            if final:
                calls = T.forced_calls(self.plan.choice, self.text)
        elif self.parser is not None:
            content, calls = self.parser.feed(text)
            if final:
                more_content, more_calls = self.parser.finish()
                content, calls = content + more_content, calls + more_calls
        else:
            content = text
        for c in calls:
            pieces.append({"index": self.num_calls, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": ""}})
            pieces.append({"index": self.num_calls, "function": {"arguments": c.arguments}})
            self.num_calls += 1
        out: dict = {}
        if content:
            out["content"] = content
        if pieces:
            out["tool_calls"] = pieces
        return out


# ---------------------------------------------------------------- request -> engine
def _sampling_params(req, max_tokens: int | None, logprobs: int | None,
                     tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    kw = dict(n=req.n, max_tokens=max_tokens, logprobs=logprobs, seed=req.seed, stop=req.stop,
              stop_token_ids=req.stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    kw["structured_outputs"] = _structured_outputs(req)
    if tool_constraint is not None:
        if kw["structured_outputs"] is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with another "
                                "constraint (response_format, structured_outputs, guided_*)", param="tool_choice")
        kw["structured_outputs"] = tool_constraint
    try:
        kw["logit_bias"] = req.logit_bias
        return SamplingParams(**kw)
    except ValueError as e:
        raise _bad_request(e) from None


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_BACKENDS = {None, "auto", "guidance", "llguidance"}


def _structured_outputs(req) -> StructuredOutputsParams | None:
    """The request's constraint from whichever field carries it (one of them at most)."""
    fmt, so = req.response_format, req.structured_outputs
    guided = {name[len("guided_"):]: getattr(req, name) for name in _GUIDED if getattr(req, name) is not None}
    given = [name for name, present in (("response_format", fmt is not None and fmt.get("type") != "text"),
                                        ("structured_outputs", so is not None), ("guided_*", bool(guided)))
             if present]
    if len(given) > 1:
        raise APIError(400, f"give one constraint, not {' and '.join(given)}", param=given[1])
    if req.guided_decoding_backend not in _BACKENDS:
        raise APIError(400, f"guided_decoding_backend {req.guided_decoding_backend!r:.50} is not available: "
                            "tokenmill's structured outputs run on llguidance ('guidance')",
                       param="guided_decoding_backend")
    try:
        if fmt is not None:
            return _response_format(fmt)
        if so is not None:
            return StructuredOutputsParams(**so)
        if guided:
            return StructuredOutputsParams(**guided, whitespace_pattern=req.guided_whitespace_pattern)
        if req.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern needs guided_json")
    except TypeError as e:  # an unknown field of structured_outputs
        raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    except ValueError as e:
        raise APIError(400, str(e), param=given[0] if given else None) from None
    return None


def _response_format(fmt: dict) -> StructuredOutputsParams | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with the schema under 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        # strict or not, the schema is enforced (OpenAI's strict mode is the only one tokenmill has)
        return StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r:.50}")


def _bad_request(e: ValueError) -> APIError:
    msg = str(e)
    first = msg.split(" ", 1)[0].strip("(),:")
    return APIError(400, msg, param=first if first in _PARAM_NAMES else None)


def _completion_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if len(prompt) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt may hold at most {P.MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    return list(prompt)


def _prompt_ids(tok, text: str, add_special_tokens: bool, split_special_tokens: bool,
                max_model_len: int | None) -> list[int]:
    """A prompt's ids (on a worker thread); one that cannot fit max_model_len even at the
    vocabulary's longest token is refused without tokenizing it."""
    _check_fits(tok, len(text), max_model_len, "prompt")
    return tok.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)


def _check_fits(tok, chars: int, max_model_len: int | None, param: str) -> None:
    """Text longer than max_model_len tokens of the vocabulary's longest token cannot fit: refused
    before it is tokenized (None: no bound, as for /tokenize)."""
    if max_model_len is not None and chars > max_model_len * tok.max_token_chars:
        raise APIError(400, f"the {param} has {chars} characters, more than the model's context of {max_model_len} "
                            f"tokens can hold (no token is longer than {tok.max_token_chars} characters); shorten it.",
                       param=param)


def _chat_ids(tok, conv: list[dict], add_generation_prompt: bool, kwargs, tools, split_special_tokens: bool,
              max_model_len: int | None) -> list[int]:
    """The conversation's ids (on a worker thread), bounded like _prompt_ids."""
    _check_fits(tok, sum(len(v) for m in conv for v in m.values() if isinstance(v, str)), max_model_len, "messages")
    try:
        return tok.encode_chat(conv, add_generation_prompt, tools, kwargs, split_special_tokens)
    except ValueError as e:
        param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        raise APIError(400, str(e), param=param) from None


def _conversation(messages: list[P.ChatMessage]) -> list[dict]:
    """The request's messages as the template sees them (roles checked, text parts joined)."""
    allowed = {"system", "user", "assistant", "tool", "developer"}
    conv = []
    for i, m in enumerate(messages):
        if m.role not in allowed:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not one of {sorted(allowed)}", param="messages")
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            texts = [part.get("text", "") for part in content]
            if any(not isinstance(t, str) for t in texts):
                raise APIError(400, f"messages[{i}]: a text content part's text must be a string", param="messages")
            content = "".join(texts)
        msg = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_template_call(c) for c in msg["tool_calls"]]
        conv.append(msg)
    return conv


def _template_call(call):
    """An assistant's earlier tool call as chat templates expect it: OpenAI sends the arguments as
    JSON text, templates render them with `tojson` (a string would come out quoted twice)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call


async def _start_all(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Submit every request at once and wait for each first output, so that bad input (prompt
    too long, queue full) fails the HTTP call with a proper status before any byte is streamed."""
    results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return results
    await _close(streams)
    e = errors[0]
    if isinstance(e, ValueError):
        raise _bad_request(e)
    if isinstance(e, QueueFullError):
        raise APIError(503, str(e), "server_overloaded")
    raise e  # the engine's own failures: _engine_failed answers them


async def _close(streams) -> None:
    for s in streams:
        await s.aclose()


async def _collect_all(streams, firsts) -> list[RequestOutput]:
    """Every stream's final output. All are read at once: a stream read later would meanwhile
    queue one output (a snapshot of its whole text) per token."""
    async def last(s, out):
        while not out.finished:
            out = await s.__anext__()
        return out
    return list(await asyncio.gather(*(last(s, f) for s, f in zip(streams, firsts))))


async def _merged(streams, firsts) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as outputs arrive on any stream, each stream's first output first;
    every stream is read at once, for the same reason as in _collect_all."""
    if len(streams) == 1:  # the common case, without a task and a queue per token
        out = firsts[0]
        yield 0, out
        while not out.finished:
            out = await streams[0].__anext__()
            yield 0, out
        return
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s, out: RequestOutput) -> None:
        try:
            arrived.put_nowait((i, out))
            while not out.finished:
                out = await s.__anext__()
                arrived.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            arrived.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        left = len(streams)
        while left:
            i, item = await arrived.get()
            if isinstance(item, Exception):
                raise item
            left -= item.finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnected(raw: Request, coro, streams):
    """Run `coro` over `streams`; if the client goes away first (or this handler is cancelled),
    cancel it and close the streams, which aborts their requests — queued ones before prefill."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await _close(streams)


# ---------------------------------------------------------------- responses
class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.completion += sum(len(o.token_ids) for o in out.outputs)
        self.cached += out.metrics.num_cached_tokens if out.metrics else 0

    def model(self) -> P.Usage:
        return P.Usage(prompt_tokens=self.prompt, completion_tokens=self.completion,
                       total_tokens=self.prompt + self.completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=self.cached))


def _timings(out: RequestOutput) -> P.Timings | None:
    m = out.metrics
    if m is None:
        return None
    end = m.finished_time or m.last_token_time
    ntok = max(len(o.token_ids) for o in out.outputs)
    decode = None
    if m.first_token_time is not None and end is not None and end > m.first_token_time and ntok > 1:
        decode = (ntok - 1) / (end - m.first_token_time)
    return P.Timings(queue_time=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
                     ttft=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
                     decode_tokens_per_s=decode, e2e=None if end is None else end - m.arrival_time,
                     cached_prompt_tokens=m.num_cached_tokens, preemptions=m.num_preemptions,
                     draft_tokens=m.num_draft_tokens, accepted_draft_tokens=m.num_accepted_tokens)


def _token_str(client, tid: int) -> str:
    return client.tokenizer.decode([tid], skip_special_tokens=False) if client.tokenizer else str(tid)


def _top(entry: dict, k: int) -> list:
    """A position's top-k alternatives, best first (the sampled token is in `entry` even when it
    ranks below k)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda kv: kv[1].rank)


def _completion_logprobs(o, client, k: int, start: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = 0
    for tid, entry in zip(o.token_ids[start:], (o.logprobs or [])[start:]):
        s = _token_str(client, tid)
        tokens.append(s)
        lps.append(entry[tid].logprob)
        tops.append({_token_str(client, t): lp.logprob for t, lp in _top(entry, k)})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(o, client, k: int, start: int = 0) -> dict:
    content = []
    for tid, entry in zip(o.token_ids[start:], (o.logprobs or [])[start:]):
        s = _token_str(client, tid)
        top = [{"token": (ts := _token_str(client, t)), "logprob": lp.logprob, "bytes": list(ts.encode())}
               for t, lp in _top(entry, k)]
        content.append({"token": s, "logprob": entry[tid].logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_STREAM_ERRORS = tuple(_ENGINE_ERRORS)


def _stream_error(e: Exception) -> str:
    """A stream that fails after its first byte (its request failed or timed out, or the engine
    died): the status is sent, so the error travels as an event in OpenAI's error shape (then
    [DONE]) instead of a connection cut mid-stream."""
    status, type_ = _ENGINE_ERRORS[type(e)]
    body = P.ErrorResponse(error=P.ErrorBody(message=str(e), type=type_, code=status))
    return _data(body.model_dump()) + "data: [DONE]\n\n"


async def _completion_stream(rid, req, prompts, streams, firsts, params, model_name, client) -> AsyncIterator[str]:
    created = int(time.time())
    usage = _Usage()
    sent_tokens: dict[int, int] = {}
    try:
        if req.echo:
            for pi, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    for i in range(params.n):
                        yield _data({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                     "choices": [{"index": pi * params.n + i, "text": prompt, "logprobs": None,
                                                  "finish_reason": None}]})
        async with contextlib.aclosing(_merged(streams, firsts)) as merged:  # its readers stop before _close
            async for pi, out in merged:
                for o in out.outputs:
                    idx = pi * params.n + o.index
                    start = sent_tokens.get(idx, 0)
                    if not o.delta_text and o.finish_reason is None and len(o.token_ids) == start:
                        continue
                    choice = {"index": idx, "text": o.delta_text, "finish_reason": o.finish_reason,
                              "stop_reason": o.stop_reason, "logprobs": None}
                    if req.logprobs is not None:
                        choice["logprobs"] = _completion_logprobs(o, client, req.logprobs, start)
                    sent_tokens[idx] = len(o.token_ids)
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [choice]}
                    if o.finish_reason is not None and out.finished:
                        chunk["timings"] = _timings(out).model_dump()
                    yield _data(chunk)
                if out.finished:
                    usage.add(out)
        if req.stream_options and req.stream_options.include_usage:
            yield _data({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [], "usage": usage.model().model_dump()})
        yield "data: [DONE]\n\n"
    except _STREAM_ERRORS as e:
        yield _stream_error(e)
    finally:
        await _close(streams)


async def _chat_stream(rid, req, stream, first, model_name, client, plan: _ToolPlan,
                       thinking: str | None) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
    try:
        out = first
        n = len(out.outputs)
        yield _data({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for i in range(n)]})
        sent = [0] * n
        tools = [_ToolStream(plan) for _ in range(n)]
        thoughts = [R.StreamingReasoning(thinking) if thinking else None for _ in range(n)]
        while True:
            for o in out.outputs:
                if not o.delta_text and o.finish_reason is None and len(o.token_ids) == sent[o.index]:
                    continue
                final = o.finish_reason is not None
                text, reasoning = o.delta_text or "", ""
                if thoughts[o.index] is not None:
                    reasoning, text = thoughts[o.index].feed(text, final)
                delta = tools[o.index].delta(text, final)
                if reasoning:
                    delta["reasoning_content"] = reasoning
                finish = o.finish_reason
                if finish == "stop" and tools[o.index].num_calls:
                    finish = "tool_calls"
                choice = {"index": o.index, "delta": delta,
                          "logprobs": _chat_logprobs(o, client, req.top_logprobs or 0, sent[o.index]) if req.logprobs else None,
                          "finish_reason": finish, "stop_reason": o.stop_reason}
                sent[o.index] = len(o.token_ids)
                chunk = {**base, "choices": [choice]}
                if out.finished and o.finish_reason is not None:
                    chunk["timings"] = _timings(out).model_dump()
                yield _data(chunk)
            if out.finished:
                break
            out = await stream.__anext__()
        if req.stream_options and req.stream_options.include_usage:
            usage = _Usage()
            usage.add(out)
            yield _data({**base, "choices": [], "usage": usage.model().model_dump()})
        yield "data: [DONE]\n\n"
    except _STREAM_ERRORS as e:
        yield _stream_error(e)
    finally:
        await stream.aclose()
