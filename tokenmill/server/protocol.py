"""Request and response schemas of the OpenAI-compatible API (plus vLLM's extra sampling fields).

Requests validate types here; value ranges are checked once, by SamplingParams, so the API and
the Python front end reject exactly the same things with the same words.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, no effect: tokenmill pads no stream events


def _refuse(what: str):
    """A validator for a field tokenmill knows but does not implement: any value other than the
    ones that ask for nothing is a 400 naming the field (never a silent drop)."""
    def check(value):
        if value not in (None, False, "", [], {}):
            raise ValueError(f"{what} is not supported by tokenmill")
        return value
    return check


class _SamplingFields(BaseModel):
    # a field this schema does not know is refused with a 400 naming it (OpenAI's own behaviour):
    # tokenmill never drops a request field silently. The fields below that have no effect on the
    # result are accepted on purpose (README: "Request fields").
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted, no effect on the output: bookkeeping fields of OpenAI's API
    user: str | None = None
    metadata: dict[str, Json] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None      # prefix caching is automatic
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # likewise; blocks live while they fit
    safety_identifier: str | None = None
    priority: int = 0  # lower goes first under --scheduling-policy priority; ignored under fcfs
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # prefix-cache namespace (vLLM)
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Json] | None = None
    structured_outputs: dict[str, Json] | None = None
    guided_json: str | dict[str, Json] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # known, not implemented: refused unless they ask for nothing
    best_of: Annotated[int | None, AfterValidator(lambda v: _refuse("best_of > 1")(v if v not in (0, 1) else None))] = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # the prompt is the client's own template: its special-token text acts as control tokens
    # unless this says to read it as text (Hugging Face's name)
    split_special_tokens: bool = False
    suffix: Annotated[str | None, AfterValidator(_refuse("suffix (insertion)"))] = None


# Bounds on how much structure one request may carry (its bytes are capped by the server).
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_PROMPTS = 1024  # prompts in one completions request; each becomes a request in the engine
MAX_JSON_DEPTH = 32  # free-form JSON (template kwargs, tools, extra message fields) goes to templates


def _shallow(value: Any) -> Any:
    """Refuses free-form JSON nested deeper than MAX_JSON_DEPTH: templates and JSON encoders
    recurse per level, and a few MiB of body can nest thousands of levels (beyond ~1000 the
    parser itself refuses the body). Walks containers only, without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


Json = Annotated[Any, AfterValidator(_shallow)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | Annotated[list[dict[str, Json]], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    @model_validator(mode="after")
    def _shallow_extras(self) -> "ChatMessage":
        for value in (self.model_extra or {}).values():
            _shallow(value)
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the answer continues the last (assistant) message
    chat_template_kwargs: dict[str, Json] | None = None
    tools: list[dict[str, Json]] | None = None
    # special-token text inside messages is read as text, so no message can forge a turn;
    # false lets it act as control tokens
    split_special_tokens: bool = True
    tool_choice: str | dict[str, Json] | None = None
    parallel_tool_calls: bool | None = None
    audio: Annotated[dict[str, Json] | None, AfterValidator(_refuse("audio output"))] = None
    modalities: list[str] | None = None
    prediction: Annotated[dict[str, Json] | None, AfterValidator(_refuse("predicted outputs"))] = None
    web_search_options: Annotated[dict[str, Json] | None, AfterValidator(_refuse("web search"))] = None
    functions: Annotated[list[dict[str, Json]] | None, AfterValidator(_refuse("functions (use tools)"))] = None
    function_call: Annotated[str | dict[str, Json] | None, AfterValidator(_refuse("function_call (use tools)"))] = None
    # the template's thinking switch where it has one (params.template_kwargs); otherwise no effect
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect: the model's own length

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value):
        if value not in (None, ["text"]):
            raise ValueError("only the text modality is supported")
        return value


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    split_special_tokens: bool | None = None  # default: as the route it stands for (prompt False, messages True)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Timings(BaseModel):
    """Per-request timings (seconds): why was this request slow?"""
    queue_time: float | None = None
    ttft: float | None = None
    decode_tokens_per_s: float | None = None
    e2e: float | None = None
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0            # speculative decoding: drafts verified for this request
    accepted_draft_tokens: int = 0   # of those, accepted


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
