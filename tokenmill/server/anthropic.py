"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat core:
a request becomes a ChatCompletionRequest (`to_chat`), so templates, tools, thinking and schemas
behave exactly as on /v1/chat/completions (chat.py); the answer becomes Anthropic's content blocks
(`message`) or its event stream (`message_events`). Errors on these paths take Anthropic's shape
(guard.error_response). What each field does is listed in the README ("Anthropic Messages")."""
from __future__ import annotations

import json
from typing import Annotated, AsyncIterator, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tokenmill.outputs import RequestOutput
from tokenmill.server import chat
from tokenmill.server import protocol as P
from tokenmill.server.errors import APIError
from tokenmill.server.guard import anthropic_error
from tokenmill.server.streaming import STREAM_ERRORS, error_status

Blocks = Annotated[list[dict[str, P.Json]], Field(max_length=P.MAX_CONTENT_PARTS)]
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | Blocks


class CountTokensRequest(BaseModel):
    """What renders the prompt: also the whole of a count_tokens request."""
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Message] = Field(max_length=P.MAX_MESSAGES)
    system: str | Blocks | None = None
    tools: list[dict[str, P.Json]] | None = None
    tool_choice: dict[str, P.Json] | None = None
    thinking: dict[str, P.Json] | None = None        # enabled / disabled: the template's thinking switch
    output_config: dict[str, P.Json] | None = None   # effort -> reasoning_effort; format -> a JSON schema
    cache_control: dict[str, P.Json] | None = None   # accepted, no effect: prefix caching is automatic
    mcp_servers: Annotated[list[dict[str, P.Json]] | None, AfterValidator(P._refuse("mcp_servers"))] = None
    container: Annotated[str | dict[str, P.Json] | None, AfterValidator(P._refuse("container"))] = None
    context_management: Annotated[dict[str, P.Json] | None, AfterValidator(P._refuse("context_management"))] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # accepted, no effect on the output: bookkeeping and routing fields of Anthropic's API
    metadata: dict[str, P.Json] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict[str, P.Json] | None = None


def to_chat(req: CountTokensRequest) -> P.ChatCompletionRequest:
    """The same request as chat completions take it."""
    kw: dict = {"model": req.model, "messages": conversation(req), "tools": tools(req.tools),
                "tool_choice": None, "chat_template_kwargs": thinking(req.thinking)}
    if req.tool_choice is not None:
        kw["tool_choice"], parallel = tool_choice(req.tool_choice)
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
    config = req.output_config or {}
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise APIError(400, f"output_config.{unknown[0]:.60} is not a field tokenmill takes (effort, format)",
                       param="output_config")
    if config.get("effort") is not None:
        if config["effort"] not in EFFORTS:
            raise APIError(400, f"output_config.effort must be one of {', '.join(EFFORTS)}", param="output_config")
        kw["reasoning_effort"] = EFFORTS[config["effort"]]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                           param="output_config")
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if isinstance(req, MessagesRequest):
        kw.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                  **{k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None})
    if req.messages and req.messages[-1].role == "assistant":  # a prefill: the answer continues it
        kw.update(add_generation_prompt=False, continue_final_message=True)
    return P.ChatCompletionRequest(**kw)


def _text(blocks, where: str) -> str:
    """The text of a string or of a list of text blocks (system, tool results)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here", param=where.split("[")[0])
        parts.append(b["text"])
    return "\n".join(parts)


def conversation(req: CountTokensRequest) -> list[dict]:
    """Anthropic's turns as chat messages: system first, a user turn's tool results as `tool`
    messages (before its text), an assistant turn's tool uses as its `tool_calls` and its thinking
    as `reasoning_content` (the name chat templates read)."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls, thoughts = [], [], []
        for j, b in enumerate(blocks):
            where, kind = f"messages[{i}].content[{j}]", b.get("type")
            try:
                if kind == "text":
                    texts.append(_string(b, "text"))
                elif kind == "tool_use" and m.role == "assistant":
                    calls.append({"id": _string(b, "id"), "type": "function",
                                  "function": {"name": _string(b, "name"), "arguments": json.dumps(b.get("input", {}))}})
                elif kind == "tool_result" and m.role == "user":
                    content = b.get("content", "")
                    out.append({"role": "tool", "tool_call_id": _string(b, "tool_use_id"),
                                "content": _text(content if isinstance(content, (str, list)) else "", where + ".content")})
                elif kind == "thinking" and m.role == "assistant":
                    thoughts.append(_string(b, "thinking"))
                else:
                    raise ValueError(f"a {m.role} turn's content blocks may be text, "
                                     f"{'tool_use and thinking' if m.role == 'assistant' else 'and tool_result'}; "
                                     f"got {str(kind)[:40]!r}")
            except ValueError as e:
                raise APIError(400, f"{where}: {e}", param="messages") from None
        if texts or calls or thoughts or not blocks:
            msg = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            out.append(msg)
    return out


def _string(block: dict, key: str) -> str:
    if not isinstance(block.get(key), str):
        raise ValueError(f"{key} must be a string")
    return block[key]


def tools(given: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools as chat's function tools; server tools (web search, code
    execution, …) run at Anthropic and are refused by name."""
    if not given:
        return None
    out = []
    for i, t in enumerate(given):
        if t.get("type", "custom") != "custom":
            raise APIError(400, f"tools[{i}]: {str(t.get('type'))[:60]!r} is one of Anthropic's server tools, "
                                "which tokenmill does not run; give client tools (name, input_schema)", param="tools")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}] needs a name and an input_schema object", param="tools")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's {type: auto | any | tool | none}."""
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': …}",
                   param="tool_choice")


def thinking(config: dict | None) -> dict | None:
    """`thinking` as the chat template's switch (Qwen3's enable_thinking; templates without one
    ignore it). budget_tokens is accepted: the model ends its thinking itself."""
    if config is None or config.get("type") == "adaptive":
        return None
    if config.get("type") not in ("enabled", "disabled"):
        raise APIError(400, "thinking.type must be 'enabled', 'disabled' or 'adaptive'", param="thinking")
    budget = config.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise APIError(400, "thinking.budget_tokens must be a positive integer", param="thinking")
    return {"enable_thinking": config["type"] == "enabled"}


# ------------------------------------------------------------------ answers
def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat answer's finish_reason and the stop that ended it."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(out: RequestOutput) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from the rest."""
    cached = out.metrics.num_cached_tokens if out.metrics else 0
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": len(out.outputs[0].token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(c) -> dict:
    try:
        args = json.loads(c.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):  # a tool's input is an object; other JSON is kept under a key
        args = {"arguments": c.arguments if args is None else args}
    return {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": args}


def message(rid: str, model: str, turn: chat.Turn, out: RequestOutput) -> dict:
    a = chat.answer(turn, out.outputs[0])
    content: list[dict] = []
    if a.reasoning:
        content.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
    if a.content:
        content.append({"type": "text", "text": a.content})
    content += [tool_use(c) for c in a.tool_calls]
    reason, sequence = stop_reason(a.finish_reason, a.stop_reason)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(out)}


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a streamed message: a new kind closes the open one."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [event("content_block_start", {"index": self.index, "content_block": block})]

    def ensure(self, kind: str, block: dict) -> list[str]:
        return [] if self.kind == kind else self.open(kind, block)

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]


async def message_events(rid: str, model: str, turn: chat.Turn, stream, first: RequestOutput) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, per block content_block_start / _delta / _stop
    (thinking, text, tool_use with its input as partial JSON), message_delta, message_stop."""
    try:
        out = first
        yield event("message_start", {"message": {
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {**usage(out), "output_tokens": 0}}})
        reader, blocks = chat.Deltas(turn), _Blocks()
        while True:
            o = out.outputs[0]
            reasoning, delta = reader.feed(o.delta_text or "", o.finish_reason is not None)
            if reasoning:
                for e in blocks.ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
                yield blocks.delta({"type": "thinking_delta", "thinking": reasoning})
            if delta.get("content"):
                for e in blocks.ensure("text", {"type": "text", "text": ""}):
                    yield e
                yield blocks.delta({"type": "text_delta", "text": delta["content"]})
            for piece in delta.get("tool_calls", []):
                fn = piece["function"]
                if "id" in piece:
                    for e in blocks.open("tool_use", {"type": "tool_use", "id": tool_use_id(piece["id"]),
                                                      "name": fn["name"], "input": {}}):
                        yield e
                if fn.get("arguments"):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
            if out.finished:
                break
            out = await stream.__anext__()
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(reader.finish_reason(out.outputs[0].finish_reason), out.outputs[0].stop_reason)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"output_tokens": len(out.outputs[0].token_ids)}})
        yield event("message_stop", {})
    except STREAM_ERRORS as e:
        status, message = error_status(e)
        yield event("error", {"error": anthropic_error(status, message)["error"]})
    finally:
        await stream.aclose()
