"""OpenAI's Responses API (`POST /v1/responses`, GET and DELETE of a stored response) on the chat
core: `input` items and `instructions` become chat messages (after the stored conversation of
`previous_response_id`), tools, `text.format` and `reasoning` become chat's fields, and the Turn's
answer becomes output items (`reasoning`, `message`, `function_call`). Streaming: responses_events.py.
What each field does is listed in the README ("Responses")."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from tokenmill.outputs import RequestOutput
from tokenmill.server import chat
from tokenmill.server import protocol as P
from tokenmill.server.errors import APIError

Items = Annotated[list[dict[str, P.Json]], Field(max_length=P.MAX_MESSAGES)]
_no = P._refuse


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | Items
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: P.StreamOptions | None = None
    tools: list[dict[str, P.Json]] | None = None
    tool_choice: str | dict[str, P.Json] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, P.Json] | None = None           # format: text | json_object | json_schema; verbosity
    reasoning: dict[str, P.Json] | None = None      # effort -> the template's switch; summary accepted
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # accepted, no effect on the output (README: "Responses")
    metadata: dict[str, P.Json] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None               # bounds built-in tool calls, of which there are none
    truncation: Literal["disabled"] | None = None   # "auto" would drop turns silently: refused
    # known, not implemented: refused unless they ask for nothing
    background: Annotated[bool | None, AfterValidator(_no("background"))] = None
    conversation: Annotated[str | dict[str, P.Json] | None, AfterValidator(_no("conversation"))] = None
    prompt: Annotated[dict[str, P.Json] | None, AfterValidator(_no("prompt (stored prompt templates)"))] = None
    top_logprobs: Annotated[int | None, AfterValidator(_no("top_logprobs"))] = None
    context_management: Annotated[list[dict[str, P.Json]] | None, AfterValidator(_no("context_management"))] = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ request -> chat
def _text(content, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(part.get(key), str):
            raise APIError(400, f"{where}.content[{j}]: only text parts are supported (input_text, output_text), "
                                f"got {str(kind)[:40]!r}", param="input")
        parts.append(part[key])
    return "".join(parts)


def conversation(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: message items by role, function calls as an assistant's
    tool_calls (consecutive ones in one turn), their outputs as `tool` messages, reasoning items as
    the next assistant turn's reasoning_content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thinking = ""
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param="input")
            msg = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and thinking:
                msg["reasoning_content"], thinking = thinking, ""
            out.append(msg)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not thinking):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thinking:
                    out[-1]["reasoning_content"], thinking = thinking, ""
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking += "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise APIError(400, f"{where}: input items of type {str(kind)[:40]!r} are not supported; tokenmill takes "
                                "message, function_call, function_call_output and reasoning", param="input")
    return out


def tools(given: list[dict] | None) -> list[dict] | None:
    if not given:
        return None
    out = []
    for i, t in enumerate(given):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: {str(t.get('type'))[:40]!r} tools are not supported; tokenmill runs "
                                "function tools (the client runs them)", param="tools")
        if not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}] needs a name", param="tools")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': …}",
                   param="tool_choice")


def text_format(text: dict | None) -> tuple[dict | None, str | None]:
    """(chat's response_format, verbosity) of `text`."""
    text = text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise APIError(400, f"text.{unknown[0]:.60} is not a field tokenmill takes (format, verbosity)", param="text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None, text.get("verbosity")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}, text.get("verbosity")
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}, \
            text.get("verbosity")
    raise APIError(400, "text.format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', 'name', "
                        "'schema'}", param="text")


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[P.ChatCompletionRequest, list[dict]]:
    """(the chat request, the conversation without instructions: what a stored response keeps)."""
    turns = history + conversation(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + turns
    fmt, verbosity = text_format(req.text)
    reasoning = req.reasoning or {}
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise APIError(400, f"reasoning.{unknown[0]:.60} is not a field tokenmill takes (effort, summary)",
                       param="reasoning")
    kw = dict(model=req.model, messages=messages, tools=tools(req.tools), tool_choice=tool_choice(req.tool_choice),
              parallel_tool_calls=req.parallel_tool_calls, response_format=fmt, verbosity=verbosity,
              reasoning_effort=reasoning.get("effort"), max_completion_tokens=req.max_output_tokens,
              temperature=req.temperature, top_p=req.top_p, metadata=req.metadata, user=req.user)
    try:
        return P.ChatCompletionRequest(**kw), turns
    except ValidationError as e:  # a value chat refuses (an effort, a verbosity): named as this API names it
        er = e.errors()[0]
        name = _NAMES.get(str(er["loc"][0]), str(er["loc"][0])) if er["loc"] else "input"
        raise APIError(400, f"{name}: {er['msg']}", param=name.split(".")[0]) from None


_NAMES = {"reasoning_effort": "reasoning.effort", "verbosity": "text.verbosity", "messages": "input",
          "max_completion_tokens": "max_output_tokens"}


# ------------------------------------------------------------------ answer -> output items
def output_items(a: chat.Answer) -> list[dict]:
    items: list[dict] = []
    if a.reasoning:
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": a.reasoning}], "status": "completed"})
    if a.content:
        items.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": a.content, "annotations": [], "logprobs": []}]})
    items += [function_call(c.id, c.name, c.arguments) for c in a.tool_calls]
    return items


def function_call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def assistant_turn(items: list[dict]) -> list[dict]:
    """The output items as the conversation a later request continues (previous_response_id)."""
    return conversation([i for i in items if i["type"] in ("message", "function_call", "reasoning")]) if items else []


def usage(out: RequestOutput, reasoning_tokens: int) -> dict:
    cached = out.metrics.num_cached_tokens if out.metrics else 0
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": prompt + completion}


def response(rid: str, req: ResponsesRequest, model: str, created: int, status: str, output: list[dict],
             usage_: dict | None, finish: str | None = None, error: dict | None = None) -> dict:
    """The response object, as created (in_progress) and as finished."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage_, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
            "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "service_tier": req.service_tier, "prompt_cache_key": req.prompt_cache_key,
            "safety_identifier": req.safety_identifier}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"
