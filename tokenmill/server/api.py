"""FastAPI application: OpenAI-compatible routes over an EngineClient.

Every request is validated before it reaches the engine; every failure becomes an OpenAI-style
error body with the right status (errors.py); a client that goes away aborts its request in the
engine (streaming.py). A request's fields become SamplingParams and token ids in params.py, tool
calls are planned in tool_plan.py, answers are assembled in responses.py and streaming.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server import protocol as P
from tokenmill.server import reasoning as R
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, install_handlers
from tokenmill.server.guard import Guard, cache_salt, error_response
from tokenmill.server.metrics import Metrics
from tokenmill.server.params import (chat_ids, completion_prompts, conversation, prompt_ids, sampling_params,
                                     template_kwargs)
from tokenmill.server.responses import Usage, chat_logprobs, completion_logprobs, timings
from tokenmill.server.streaming import chat_stream, collect_all, completion_stream, sse, start_all, until_disconnected
from tokenmill.server.tool_plan import ToolPlan


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
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    install_handlers(app)

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
            ids = await off_loop(chat_ids, tok, conversation(req.messages), req.add_generation_prompt, None, None,
                                 split, None)
        else:
            ids = await off_loop(prompt_ids, tok, req.prompt, req.add_special_tokens, bool(req.split_special_tokens),
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
        prompts = completion_prompts(req.prompt)
        params = sampling_params(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = prompts
        if client.tokenizer is not None and any(isinstance(p, str) for p in prompts):
            ids = [await off_loop(prompt_ids, client.tokenizer, p, True, req.split_special_tokens,
                                  client.max_model_len) if isinstance(p, str) else p for p in prompts]
        salt = cache_salt(raw, req.cache_salt)
        streams = [client.generate(f"{rid}-{i}", p, params, req.priority, salt) for i, p in enumerate(ids)]
        firsts = await until_disconnected(raw, start_all(streams), streams)  # gone while queued: never prefilled
        if req.stream:
            return sse(completion_stream(rid, req, prompts, streams, firsts, params, model_name, client))
        finals = await until_disconnected(raw, collect_all(streams, firsts), streams)
        choices, usage, timing = [], Usage(), None
        for pi, (prompt, out) in enumerate(zip(prompts, finals)):
            usage.add(out)
            timing = timing or timings(out)
            for o in out.outputs:
                text = (prompt if isinstance(prompt, str) else "") + o.text if req.echo else o.text
                choices.append(P.CompletionChoice(index=pi * params.n + o.index, text=text,
                                                  logprobs=completion_logprobs(o, client, req.logprobs) if req.logprobs is not None else None,
                                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        return P.CompletionResponse(id=rid, model=model_name, choices=choices, usage=usage.model(), timings=timing)

    # ------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, raw: Request):
        check_model(req.model)
        tok = tokenizer()
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        calls = ToolPlan.of(req, config.tool_call_parser, tok.chat_template)
        # a constrained output (forced tool call) is the constraint's from its first token: no thinking
        thinking = None if calls.forced else config.reasoning_parser
        ids = await off_loop(chat_ids, tok, conversation(req.messages), req.add_generation_prompt,
                             template_kwargs(req, tok.chat_template), req.tools, req.split_special_tokens,
                             client.max_model_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, client.max_model_len - len(ids))
        top = req.top_logprobs if req.top_logprobs is not None else 0
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = sampling_params(req, max_tokens, top if req.logprobs else None, calls.constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = client.generate(rid, ids, params, req.priority, cache_salt(raw, req.cache_salt))
        first = (await until_disconnected(raw, start_all([stream]), [stream]))[0]
        if req.stream:
            return sse(chat_stream(rid, req, stream, first, model_name, client, calls, thinking))
        out = (await until_disconnected(raw, collect_all([stream], [first]), [stream]))[0]
        usage = Usage()
        usage.add(out)
        choices = []
        for o in out.outputs:
            reasoning, answer = R.split(thinking, o.text) if thinking else (None, o.text)
            content, tool_calls = calls.parse(answer or "") if answer is not None else (None, [])
            finish = "tool_calls" if tool_calls and o.finish_reason == "stop" else o.finish_reason
            message = P.ChatResponseMessage(content=content, reasoning_content=reasoning,
                                            tool_calls=[c.to_openai() for c in tool_calls] or None)
            choices.append(P.ChatChoice(index=o.index, message=message,
                                        logprobs=chat_logprobs(o, client, top) if req.logprobs else None,
                                        finish_reason=finish, stop_reason=o.stop_reason))
        return P.ChatCompletionResponse(id=rid, model=model_name, choices=choices, usage=usage.model(),
                                        timings=timings(out))

    return app
