"""A request's fields -> what the engine takes: SamplingParams (with the constraint from
whichever field carries it) and prompt token ids (on a worker thread, bounded before tokenizing)."""
from __future__ import annotations

import dataclasses
import json

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import protocol as P
from tokenmill.server.errors import APIError, bad_request


def sampling_params(req, max_tokens: int | None, logprobs: int | None,
                     tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    kw = dict(n=req.n, max_tokens=max_tokens, logprobs=logprobs, seed=req.seed, stop=req.stop,
              stop_token_ids=req.stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    kw["structured_outputs"] = structured_outputs(req)
    if tool_constraint is not None:
        if kw["structured_outputs"] is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with another "
                                "constraint (response_format, structured_outputs, guided_*)", param="tool_choice")
        kw["structured_outputs"] = tool_constraint
    try:
        kw["logit_bias"] = req.logit_bias
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad_request(e) from None


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_BACKENDS = {None, "auto", "guidance", "llguidance"}
_SO_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def structured_outputs(req) -> StructuredOutputsParams | None:
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
            return response_format(fmt)
        if so is not None:
            unknown = sorted(set(so) - _SO_FIELDS)
            if unknown:
                raise APIError(400, f"structured_outputs.{unknown[0]:.60} is not a field tokenmill takes; it takes "
                                    f"{', '.join(sorted(_SO_FIELDS))}", param=f"structured_outputs.{unknown[0]:.60}")
            return StructuredOutputsParams(**so)
        if guided:
            return StructuredOutputsParams(**guided, whitespace_pattern=req.guided_whitespace_pattern)
        if req.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern needs guided_json")
    except ValueError as e:
        raise APIError(400, str(e), param=given[0] if given else None) from None
    return None


def response_format(fmt: dict) -> StructuredOutputsParams | None:
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


def completion_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if len(prompt) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt may hold at most {P.MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    return list(prompt)


def prompt_ids(tok, text: str, add_special_tokens: bool, split_special_tokens: bool,
                max_model_len: int | None) -> list[int]:
    """A prompt's ids (on a worker thread); one that cannot fit max_model_len even at the
    vocabulary's longest token is refused without tokenizing it."""
    check_fits(tok, len(text), max_model_len, "prompt")
    return tok.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)


def check_fits(tok, chars: int, max_model_len: int | None, param: str) -> None:
    """Text longer than max_model_len tokens of the vocabulary's longest token cannot fit: refused
    before it is tokenized (None: no bound, as for /tokenize)."""
    if max_model_len is not None and chars > max_model_len * tok.max_token_chars:
        raise APIError(400, f"the {param} has {chars} characters, more than the model's context of {max_model_len} "
                            f"tokens can hold (no token is longer than {tok.max_token_chars} characters); shorten it.",
                       param=param)


def chat_ids(tok, conv: list[dict], add_generation_prompt: bool, kwargs, tools, split_special_tokens: bool,
              max_model_len: int | None, continue_final_message: bool = False) -> list[int]:
    """The conversation's ids (on a worker thread), bounded like prompt_ids."""
    check_fits(tok, sum(len(v) for m in conv for v in m.values() if isinstance(v, str)), max_model_len, "messages")
    try:
        return tok.encode_chat(conv, add_generation_prompt, tools, kwargs, split_special_tokens, continue_final_message)
    except ValueError as e:
        param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        raise APIError(400, str(e), param=param) from None


def template_kwargs(req, chat_template: str | None) -> dict | None:
    """The chat template's variables: the request's chat_template_kwargs, and reasoning_effort both
    as a variable (templates that read it, as gpt-oss's does) and, for a template with Qwen3's
    `enable_thinking` switch, as that switch ("none" and "minimal" turn thinking off) unless the
    request sets the switch itself."""
    effort, given = req.reasoning_effort, dict(req.chat_template_kwargs or {})
    if effort is None:
        return req.chat_template_kwargs
    derived = {"reasoning_effort": effort}
    if chat_template and "enable_thinking" in chat_template:
        derived["enable_thinking"] = effort not in ("none", "minimal")
    return {**derived, **given}


def conversation(messages: list[P.ChatMessage]) -> list[dict]:
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
            msg["tool_calls"] = [template_call(c) for c in msg["tool_calls"]]
        conv.append(msg)
    return conv


def template_call(call):
    """An assistant's earlier tool call as chat templates expect it: OpenAI sends the arguments as
    JSON text, templates render them with `tojson` (a string would come out quoted twice)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call
