"""Stream plumbing and server-sent events: a request's engine streams started together (bad input
fails the HTTP call before any byte), read together, aborted when the client goes away; and the
OpenAI chunk formats of completions and chat completions, errors after the first byte as events."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import QueueFullError
from tokenmill.outputs import RequestOutput
from tokenmill.server import chat
from tokenmill.server import protocol as P
from tokenmill.server.errors import ENGINE_ERRORS, APIError, bad_request
from tokenmill.server.responses import Usage, chat_logprobs, completion_logprobs, timings


async def start_all(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Submit every request at once and wait for each first output, so that bad input (prompt
    too long, queue full) fails the HTTP call with a proper status before any byte is streamed."""
    results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return results
    await close_all(streams)
    e = errors[0]
    if isinstance(e, ValueError):
        raise bad_request(e)
    if isinstance(e, QueueFullError):
        raise APIError(503, str(e), "server_overloaded")
    raise e  # the engine's own failures: _engine_failed answers them


async def close_all(streams) -> None:
    for s in streams:
        await s.aclose()


async def collect_all(streams, firsts) -> list[RequestOutput]:
    """Every stream's final output. All are read at once: a stream read later would meanwhile
    queue one output (a snapshot of its whole text) per token."""
    async def last(s, out):
        while not out.finished:
            out = await s.__anext__()
        return out
    return list(await asyncio.gather(*(last(s, f) for s, f in zip(streams, firsts))))


async def merged_outputs(streams, firsts) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as outputs arrive on any stream, each stream's first output first;
    every stream is read at once, for the same reason as in collect_all."""
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


async def until_disconnected(raw: Request, coro, streams):
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
            await close_all(streams)


def sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


STREAM_ERRORS = tuple(ENGINE_ERRORS)


def error_status(e: Exception) -> tuple[int, str]:
    """(status, message) of an engine failure after the stream began."""
    return ENGINE_ERRORS[type(e)][0], str(e)


def stream_error(e: Exception) -> str:
    """A stream that fails after its first byte (its request failed or timed out, or the engine
    died): the status is sent, so the error travels as an event in OpenAI's error shape (then
    [DONE]) instead of a connection cut mid-stream."""
    status, type_ = ENGINE_ERRORS[type(e)]
    body = P.ErrorResponse(error=P.ErrorBody(message=str(e), type=type_, code=status))
    return data(body.model_dump()) + "data: [DONE]\n\n"


async def completion_stream(rid, req, prompts, streams, firsts, params, model_name, client) -> AsyncIterator[str]:
    created = int(time.time())
    usage = Usage()
    sent_tokens: dict[int, int] = {}
    try:
        if req.echo:
            for pi, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    for i in range(params.n):
                        yield data({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                     "choices": [{"index": pi * params.n + i, "text": prompt, "logprobs": None,
                                                  "finish_reason": None}]})
        async with contextlib.aclosing(merged_outputs(streams, firsts)) as merged:  # its readers stop before close_all
            async for pi, out in merged:
                for o in out.outputs:
                    idx = pi * params.n + o.index
                    start = sent_tokens.get(idx, 0)
                    if not o.delta_text and o.finish_reason is None and len(o.token_ids) == start:
                        continue
                    choice = {"index": idx, "text": o.delta_text, "finish_reason": o.finish_reason,
                              "stop_reason": o.stop_reason, "logprobs": None}
                    if req.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(o, client, req.logprobs, start)
                    sent_tokens[idx] = len(o.token_ids)
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [choice]}
                    if o.finish_reason is not None and out.finished:
                        chunk["timings"] = timings(out).model_dump()
                    yield data(chunk)
                if out.finished:
                    usage.add(out)
        if req.stream_options and req.stream_options.include_usage:
            yield data({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [], "usage": usage.model().model_dump()})
        yield "data: [DONE]\n\n"
    except STREAM_ERRORS as e:
        yield stream_error(e)
    finally:
        await close_all(streams)


async def chat_stream(rid, req, stream, first, model_name, client, turn: chat.Turn) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}
    try:
        out = first
        n = len(out.outputs)
        yield data({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for i in range(n)]})
        sent = [0] * n
        readers = [chat.Deltas(turn) for _ in range(n)]
        while True:
            for o in out.outputs:
                if not o.delta_text and o.finish_reason is None and len(o.token_ids) == sent[o.index]:
                    continue
                reasoning, delta = readers[o.index].feed(o.delta_text or "", o.finish_reason is not None)
                if reasoning:
                    delta["reasoning_content"] = reasoning
                choice = {"index": o.index, "delta": delta,
                          "logprobs": chat_logprobs(o, client, turn.top_logprobs, sent[o.index]) if req.logprobs else None,
                          "finish_reason": readers[o.index].finish_reason(o.finish_reason), "stop_reason": o.stop_reason}
                sent[o.index] = len(o.token_ids)
                chunk = {**base, "choices": [choice]}
                if out.finished and o.finish_reason is not None:
                    chunk["timings"] = timings(out).model_dump()
                yield data(chunk)
            if out.finished:
                break
            out = await stream.__anext__()
        if req.stream_options and req.stream_options.include_usage:
            usage = Usage()
            usage.add(out)
            yield data({**base, "choices": [], "usage": usage.model().model_dump()})
        yield "data: [DONE]\n\n"
    except STREAM_ERRORS as e:
        yield stream_error(e)
    finally:
        await stream.aclose()
