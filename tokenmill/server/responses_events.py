"""A streamed Responses API answer in OpenAI's documented event sequence: response.created and
.in_progress; per output item .output_item.added, its deltas (.reasoning_text.delta;
.content_part.added, .output_text.delta, .output_text.done, .content_part.done;
.function_call_arguments.delta and .done) and .output_item.done; then .completed (or .incomplete
at max_output_tokens, .failed if the engine fails the request). Every event carries its
sequence_number."""
from __future__ import annotations

import itertools
import json
from typing import AsyncIterator, Callable

from tokenmill.outputs import RequestOutput
from tokenmill.server import chat
from tokenmill.server import responses_api as RA
from tokenmill.server.streaming import STREAM_ERRORS, error_status


class _Items:
    """The output items so far and the open one: a new kind of text, or a new call, closes it."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event, self.done, self.open_item = event, [], None

    @property
    def index(self) -> int:
        return len(self.done)

    def ensure(self, kind: str) -> list[str]:
        if self.open_item is not None and self.open_item["type"] == kind:
            return []
        events = self.close()
        if kind == "reasoning":
            self.open_item = {"type": "reasoning", "id": RA.new_id("rs"), "summary": [], "content": [],
                              "status": "in_progress", "_text": ""}
        else:
            self.open_item = {"type": "message", "id": RA.new_id("msg"), "status": "in_progress", "role": "assistant",
                              "content": [], "_text": ""}
        events.append(self.event("response.output_item.added", output_index=self.index, item=self._public()))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=self.open_item["id"],
                                     output_index=self.index, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return events

    def call(self, call_id: str, name: str) -> list[str]:
        events = self.close()
        self.open_item = {**RA.function_call(call_id, name, "", "in_progress"), "_text": ""}
        return events + [self.event("response.output_item.added", output_index=self.index, item=self._public())]

    def text(self, delta: str) -> str:
        item = self.open_item
        item["_text"] += delta
        where = dict(item_id=item["id"], output_index=self.index)
        if item["type"] == "reasoning":
            return self.event("response.reasoning_text.delta", **where, content_index=0, delta=delta)
        if item["type"] == "message":
            return self.event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
        return self.event("response.function_call_arguments.delta", **where, delta=delta)

    def close(self, status: str = "completed") -> list[str]:
        item = self.open_item
        if item is None:
            return []
        self.open_item, text = None, item.pop("_text")
        where, events = dict(item_id=item["id"], output_index=self.index), []
        item["status"] = status
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events += [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            item["arguments"] = text
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=text))
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.done.append(item)
        return events

    def _public(self) -> dict:
        return {k: v for k, v in self.open_item.items() if k != "_text"}


async def response_events(rid: str, req: RA.ResponsesRequest, model: str, created: int, turn: chat.Turn,
                          stream, first: RequestOutput, count_tokens: Callable[[str], int],
                          finished: Callable[[dict, list[dict]], None]) -> AsyncIterator[str]:
    """`finished(response, output items)` is called with the final response (to store it)."""
    seq = itertools.count()

    def event(kind: str, **body) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **body}, ensure_ascii=False)}\n\n"

    items = _Items(event)
    try:
        start = RA.response(rid, req, model, created, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        out, reader, thought = first, chat.Deltas(turn), ""
        while True:
            o = out.outputs[0]
            reasoning, delta = reader.feed(o.delta_text or "", o.finish_reason is not None)
            if reasoning:
                thought += reasoning
                for e in items.ensure("reasoning"):
                    yield e
                yield items.text(reasoning)
            if delta.get("content"):
                for e in items.ensure("message"):
                    yield e
                yield items.text(delta["content"])
            for piece in delta.get("tool_calls", []):
                fn = piece["function"]
                if "id" in piece:
                    for e in items.call(piece["id"], fn["name"]):
                        yield e
                if fn.get("arguments"):
                    yield items.text(fn["arguments"])
            if out.finished:
                break
            out = await stream.__anext__()
        finish = reader.finish_reason(out.outputs[0].finish_reason)
        for e in items.close("incomplete" if finish == "length" else "completed"):
            yield e
        body = RA.response(rid, req, model, created, RA.status_of(finish), items.done,
                           RA.usage(out, count_tokens(thought) if thought else 0), finish)
        finished(body, items.done)
        yield event("response.incomplete" if finish == "length" else "response.completed", response=body)
    except STREAM_ERRORS as e:
        status, message = error_status(e)
        body = RA.response(rid, req, model, created, "failed", items.done, None,
                           error={"code": "server_error" if status >= 500 else "invalid_request", "message": message})
        yield event("response.failed", response=body)
    finally:
        await stream.aclose()
