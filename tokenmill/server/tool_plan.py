"""How one chat request's tool calls are produced and read back (OpenAI's `tools` and
`tool_choice`), whole or streamed; the formats themselves are server/tools.py's."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server import tools as T
from tokenmill.server.errors import APIError


@dataclass
class ToolPlan:
    """How one chat request's tool calls are produced and read back: `forced` (required / a
    named function: a JSON-schema constraint, its output read as calls) or `parser` (auto: the
    model's own format), or neither."""
    choice: object = None
    parser: str | None = None
    constraint: StructuredOutputsParams | None = None
    names: dict[str, dict] = field(default_factory=dict)  # the tools: name -> parameter schema
    prefix: str = ""  # a named call's opening in the model's own format, put at the answer's start

    @classmethod
    def of(cls, req, parser_name: str | None, template: str | None) -> "ToolPlan":
        try:
            named = T.validate_tool_choice(req.tool_choice, req.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice == "required" or named is not None:
            schema = T.forced_schema(choice, req.tools, req.parallel_tool_calls is not False)
            prefix = T.call_prefix(T.pick_parser(parser_name, template), named) if named is not None else ""
            return cls(choice, None, StructuredOutputsParams(json=schema), prefix=prefix)
        if choice == "auto" and req.tools:
            names = {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}
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


class ToolStream:
    """One streamed choice's deltas under a ToolPlan: content as it comes, tool calls the way
    OpenAI streams them (per call: id, type and name first with empty arguments, then arguments)."""

    def __init__(self, plan: ToolPlan) -> None:
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
            if self.named_id is None and (text or final):  # the call's first chunk: id, name and text so far
                self.named_id = T.ToolCall(self.plan.choice["function"]["name"], "").id
                pieces.append({"index": 0, "id": self.named_id, "type": "function",
                               "function": {"name": self.plan.choice["function"]["name"], "arguments": text}})
                self.num_calls = 1
            elif text:
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
        for c in calls:  # one entry per call and chunk, as OpenAI streams them
            pieces.append({"index": self.num_calls, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
            self.num_calls += 1
        out: dict = {}
        if content:
            out["content"] = content
        if pieces:
            out["tool_calls"] = pieces
        return out
