"""One chat turn, whichever API asked for it. /v1/chat/completions, /v1/messages (anthropic.py) and
/v1/responses each translate their request into a ChatCompletionRequest and their answer out of a
Turn's results: this is the one place that knows templates, tools, reasoning and structured
outputs, so the three APIs cannot drift apart in what they accept or how they read the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol as P
from tokenmill.server import reasoning as R
from tokenmill.server import tools as T
from tokenmill.server.errors import APIError
from tokenmill.server.params import chat_ids, conversation, sampling_params, template_kwargs
from tokenmill.server.tool_plan import ToolPlan, ToolStream


@dataclass
class Turn:
    """A chat request made ready for the engine: its prompt ids, its sampling parameters, how its
    tool calls are produced and read (ToolPlan) and which reasoning parser splits its thinking
    from its answer (None: none, or a forced tool call, which is the constraint's from its first
    token)."""
    ids: list[int]
    params: SamplingParams
    calls: ToolPlan
    thinking: str | None
    top_logprobs: int = 0


@dataclass
class Answer:
    """One finished choice, read: thinking, text, tool calls and why it ended (OpenAI's words:
    stop, length, tool_calls; `stop_reason` the stop string or token id that ended it, if any)."""
    reasoning: str | None
    content: str | None
    tool_calls: list[T.ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def prepare(req: P.ChatCompletionRequest, tok, max_model_len: int, tool_call_parser: str | None,
                  reasoning_parser: str | None,
                  off_loop: Callable[..., Awaitable]) -> Turn:
    """Validate and render `req` (template rendering and tokenization on a worker thread)."""
    if not req.messages:
        raise APIError(400, "messages must contain at least one message", param="messages")
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
        raise APIError(400, "continue_final_message continues a last message of role 'assistant' and needs "
                            "add_generation_prompt=false", param="continue_final_message")
    calls = ToolPlan.of(req, tool_call_parser, tok.chat_template)
    thinking = None if calls.forced else reasoning_parser
    ids = await off_loop(chat_ids, tok, conversation(req.messages), req.add_generation_prompt,
                         template_kwargs(req, tok.chat_template), req.tools, req.split_special_tokens,
                         max_model_len, req.continue_final_message)
    if calls.prefix and not req.continue_final_message:  # a named call opens in the model's own format
        ids = ids + tok.encode(calls.prefix, add_special_tokens=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(ids))
    top = req.top_logprobs if req.top_logprobs is not None else 0
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_params(req, max_tokens, top if req.logprobs else None, calls.constraint)
    return Turn(ids, params, calls, thinking, top)


def answer(turn: Turn, o: CompletionOutput) -> Answer:
    """A finished choice's thinking, answer text and tool calls."""
    reasoning, text = R.split(turn.thinking, o.text) if turn.thinking else (None, o.text)
    content, calls = turn.calls.parse(text or "") if text is not None else (None, [])
    finish = "tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason
    return Answer(reasoning, content, calls, finish, o.stop_reason)


class Deltas:
    """One streamed choice, read as it comes: each engine delta becomes (thinking text, OpenAI's
    delta dict with `content` and/or `tool_calls`, one entry per call index: ToolStream)."""

    def __init__(self, turn: Turn) -> None:
        self.tools = ToolStream(turn.calls)
        self.thoughts = R.StreamingReasoning(turn.thinking) if turn.thinking else None

    def feed(self, text: str, final: bool) -> tuple[str, dict]:
        reasoning = ""
        if self.thoughts is not None:
            reasoning, text = self.thoughts.feed(text, final)
        return reasoning, self.tools.delta(text, final)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if engine_reason == "stop" and self.tools.num_calls else engine_reason
