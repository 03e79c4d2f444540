"""FastAPI application: OpenAI's routes (completions, chat, Responses, embeddings), Anthropic's
Messages, and rerank / score (pooling_api.py) over an EngineClient.

Every request is validated before it reaches the engine; every failure becomes an error body with
the right status (errors.py; Anthropic's shape on its paths); a client that goes away aborts its
request in the engine (streaming.py). A request's fields become SamplingParams and token ids in
params.py; the chat-shaped APIs all go through chat.py (responses_api.py and anthropic.py translate
to and from it), tool calls are planned in tool_plan.py, answers are assembled in responses.py,
streaming.py, responses_events.py and anthropic.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server import anthropic as A
from tokenmill.server import chat, lora_api, pooling_api
from tokenmill.server import protocol as P
from tokenmill.server import responses_api as RA
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, install_handlers
from tokenmill.server.guard import Guard, cache_salt, error_response
from tokenmill.server.metrics import Metrics
from tokenmill.server.params import chat_ids, completion_prompts, conversation, prompt_ids, sampling_params
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses import Usage, chat_logprobs, completion_logprobs, timings
from tokenmill.server.responses_events import response_events
from tokenmill.server.streaming import chat_stream, collect_all, completion_stream, sse, start_all, until_disconnected


def build_app(client, config: ServerConfig, metrics: Metrics, adapters: list | None = None) -> FastAPI:
    """`adapters`: the LoRARequests the engine was started with (--lora-modules)."""
    app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None)
    model_name = config.served_model_names[0]
    served = lora_api.Served(config.served_model_names, adapters or [])

    # ------------------------------------------------------------ cross-cutting
    open_paths = {"/health"} | ({"/metrics"} if config.metrics_public else set())
    app.add_middleware(Guard, api_keys=set(config.api_keys), max_bytes=config.max_request_bytes,
                       body_timeout=config.client_timeout, open_paths=open_paths,
                       salt_by_key=config.cache_salt_from_api_key)
    if config.allowed_origins:  # outside the guard: browsers send CORS preflights without credentials
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])
    install_handlers(app)

    check_model = served.resolve  # None: the base model; a LoRA adapter's name; 404 for anything else

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
        return {"object": "list", "data": served.model_cards(client.max_model_len)}

    lora_api.add_routes(app, client, served, config.enable_lora_runtime_updates)

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

    pooling_api.add_routes(app, client, check_model, off_loop, model_name)  # embeddings, rerank, score

    # ------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        lora = check_model(req.model)
        name = req.model if lora else model_name
        prompts = completion_prompts(req.prompt)
        params = sampling_params(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = prompts
        if client.tokenizer is not None and any(isinstance(p, str) for p in prompts):
            ids = [await off_loop(prompt_ids, client.tokenizer, p, True, req.split_special_tokens,
                                  client.max_model_len) if isinstance(p, str) else p for p in prompts]
        salt = cache_salt(raw, req.cache_salt)
        streams = [client.generate(f"{rid}-{i}", p, params, req.priority, salt, lora) for i, p in enumerate(ids)]
        firsts = await until_disconnected(raw, start_all(streams), streams)  # gone while queued: never prefilled
        if req.stream:
            return sse(completion_stream(rid, req, prompts, streams, firsts, params, name, client))
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
        return P.CompletionResponse(id=rid, model=name, choices=choices, usage=usage.model(), timings=timing)

    # ------------------------------------------------------------ chat
    async def turn_of(req: P.ChatCompletionRequest) -> chat.Turn:
        return await chat.prepare(req, tokenizer(), client.max_model_len, config.tool_call_parser,
                                  config.reasoning_parser, off_loop)

    async def started(rid: str, turn: chat.Turn, raw: Request, priority: int = 0, salt: str | None = None,
                      lora: str | None = None):
        """A turn's engine stream and its first output (bad input fails here, before any byte)."""
        stream = client.generate(rid, turn.ids, turn.params, priority, cache_salt(raw, salt), lora)
        return stream, (await until_disconnected(raw, start_all([stream]), [stream]))[0]

    async def finished(raw: Request, stream, first):
        return (await until_disconnected(raw, collect_all([stream], [first]), [stream]))[0]

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        lora = check_model(req.model)
        name = req.model if lora else model_name
        turn = await turn_of(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream, first = await started(rid, turn, raw, req.priority, req.cache_salt, lora)
        if req.stream:
            return sse(chat_stream(rid, req, stream, first, name, client, turn))
        out = await finished(raw, stream, first)
        usage = Usage()
        usage.add(out)
        choices = []
        for o in out.outputs:
            a = chat.answer(turn, o)
            message = P.ChatResponseMessage(content=a.content, reasoning_content=a.reasoning,
                                            tool_calls=[c.to_openai() for c in a.tool_calls] or None)
            choices.append(P.ChatChoice(index=o.index, message=message,
                                        logprobs=chat_logprobs(o, client, turn.top_logprobs) if req.logprobs else None,
                                        finish_reason=a.finish_reason, stop_reason=a.stop_reason))
        return P.ChatCompletionResponse(id=rid, model=name, choices=choices, usage=usage.model(),
                                        timings=timings(out))

    # ------------------------------------------------------------ OpenAI's Responses API
    store = ResponseStore()

    def reasoning_tokens(text: str | None) -> int:
        return len(client.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    @app.post("/v1/responses")
    async def create_response(req: RA.ResponsesRequest, raw: Request):
        lora = check_model(req.model)
        history: list[dict] = []
        if req.previous_response_id is not None:
            found = store.get(req.previous_response_id)
            if found is None:
                raise APIError(404, f"no stored response '{req.previous_response_id:.80}' (never stored with store: "
                                    "true, deleted, or dropped from the bounded store)", "not_found_error",
                               "previous_response_id")
            history = found[1]
        chat_req, turns = RA.to_chat(req, history)
        turn = await turn_of(chat_req)
        rid, created, model = RA.new_id("resp"), int(time.time()), req.model or model_name

        def keep(body: dict, items: list[dict]) -> None:
            if req.store:
                store.put(rid, body, turns + RA.assistant_turn(items))

        stream, first = await started(rid, turn, raw, lora=lora)
        if req.stream:
            return sse(response_events(rid, req, model, created, turn, stream, first, reasoning_tokens, keep))
        out = await finished(raw, stream, first)
        a = chat.answer(turn, out.outputs[0])
        items = RA.output_items(a)
        body = RA.response(rid, req, model, created, RA.status_of(a.finish_reason), items,
                           RA.usage(out, reasoning_tokens(a.reasoning)), a.finish_reason)
        keep(body, items)
        return body

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        found = store.get(rid)
        if found is None:
            raise APIError(404, f"no stored response '{rid:.80}'", "not_found_error")
        return found[0]

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if not store.delete(rid):
            raise APIError(404, f"no stored response '{rid:.80}'", "not_found_error")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    # ------------------------------------------------------------ Anthropic's Messages API
    @app.post("/v1/messages")
    async def messages(req: A.MessagesRequest, raw: Request):
        lora = check_model(req.model)
        turn = await turn_of(A.to_chat(req))
        rid = f"msg_{uuid.uuid4().hex}"
        stream, first = await started(rid, turn, raw, lora=lora)
        if req.stream:
            return sse(A.message_events(rid, req.model, turn, stream, first))
        return A.message(rid, req.model, turn, await finished(raw, stream, first))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: A.CountTokensRequest):
        check_model(req.model)
        return {"input_tokens": len((await turn_of(A.to_chat(req))).ids)}

    return app
