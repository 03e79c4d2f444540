"""Tool calls: what the model writes, turned into OpenAI's `tool_calls`, and the constraints that
make `tool_choice: required` / a named function always produce a valid call. Pure Python.

Models write calls in their family's format; a parser per format (vLLM's names):
- `hermes` (Qwen2.5, Hermes, many fine-tunes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  one block per call, text around them is content;
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": …, "parameters": {…}}` (optionally after
  `<|python_tag|>`), several joined by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": …, "arguments": {…}}`;
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=…><parameter=…>…</parameter></function></tool_call>`,
  XML whose values take their types from the tool's schema (tool_xml.py).
The parser is `--tool-call-parser`, or picked from the chat template (the format it renders).

`required` and a named function do not rely on the model's format: the output is held by a JSON
schema (vLLM does the same) — a named function's arguments object, or for `required` a list of
`{"name", "parameters"}` objects, one schema per tool — so the call always parses and its arguments
validate against the tool's parameter schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.server import tool_xml

PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def pick_parser(name: str | None, template: str | None) -> str | None:
    """The parser to use: the one named, else the format the chat template renders, else None."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")
        return name
    t = template or ""
    if "<function=" in t and "<parameter=" in t:  # before hermes: its blocks are <tool_call> too
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return None


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _calls_of(texts: list[str], args_key: str) -> list[ToolCall] | None:
    """Each text as one call, or None if any is not a well-formed call."""
    calls = []
    for t in texts:
        try:
            call = _call(json.loads(t), args_key)
        except ValueError:
            call = None
        if call is None:
            return None
        calls.append(call)
    return calls


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare(text: str, names: dict[str, dict]) -> list[ToolCall] | None:
    """An output that is nothing but a call object (or a list of them) naming one of the tools,
    possibly in a ```json fence: small models answer in this shape instead of their template's."""
    body = text.strip()
    m = _FENCE.match(body)
    body = m.group(1) if m else body
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(o, dict) and o.get("name") in names for o in items):
        return None
    return _calls_of([json.dumps(o) for o in items], "arguments")


def parse(parser: str, text: str, names: dict[str, dict] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete output; an output that does not hold well-formed calls is
    all content (a model that meant to call a tool but wrote broken JSON is shown as it wrote it).
    `names`: the request's tools (name -> parameter schema); an output that is only a call object
    naming one of them is read as that call whatever the format."""
    if parser == "qwen3_coder":
        content, found = tool_xml.parse(text, names or {})
        calls = [ToolCall(name, args) for name, args in found]
    else:
        content, calls = _parse_format(parser, text)
    if not calls and names:
        bare = _bare(text, names)
        if bare:
            return None, bare
    return content, calls


def _parse_format(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    if parser == "none":  # a template without a tool-call format: only bare call objects are calls
        return text, []
    if parser == "hermes":
        calls = _calls_of(_HERMES.findall(text), "arguments")
        if not calls:
            return text, []
        return _HERMES.sub("", text).strip() or None, calls
    if parser == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        try:
            items = json.loads(tail.strip()) if marker else None
        except ValueError:
            items = None
        calls = None if items is None else _calls_of([json.dumps(o) for o in (items if isinstance(items, list)
                                                                                else [items])], "arguments")
        return (head.strip() or None, calls) if calls else (text, [])
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = _calls_of(_split_json_objects(body), "parameters") if body.startswith("{") else None
        return (None, calls) if calls else (text, [])
    raise ValueError(f"unknown tool call parser {parser!r}")


def _split_json_objects(body: str) -> list[str]:
    """`{…}; {…}` -> the objects' texts (semicolons inside strings are left alone)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


# ---------------------------------------------------------------- streaming
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "qwen3_coder": "<tool_call>"}


class StreamingParser:
    """Feeds on text deltas; returns the content that can go out now and the calls that are
    complete. Content is held back only while it may be the start of a call marker; from the
    marker on, text is buffered, and each call goes out once it is complete (hermes: at its
    closing tag; the others at the end of the output)."""

    def __init__(self, parser: str, names: dict[str, dict] | None = None) -> None:
        self.parser = parser
        self.names = names or {}
        self.buf = ""
        self.in_calls = False
        self.bare = bool(self.names)  # the output may still turn out to be a bare call object (held back)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        if self.bare:
            head = self.buf.lstrip()[:7]
            if not head or head.startswith("{") or "```json".startswith(head) or head == "```json":
                return "", []   # '{' or a json fence: held to the end, where finish() decides
            self.bare = False
        if self.parser == "llama3_json":
            stripped = self.buf.lstrip()
            if not self.in_calls and stripped and not (stripped.startswith("{") or
                                                       "<|python_tag|>".startswith(stripped[:14]) or
                                                       stripped.startswith("<|python_tag|>")):
                out, self.buf = self.buf, ""
                self.parser = "none"  # plain text from the first character: no calls in this output
                return out, []
            if stripped and not self.in_calls and (stripped.startswith("{") or stripped.startswith("<|python_tag|>")):
                self.in_calls = True
            return "", []
        if self.parser == "none":
            out, self.buf = self.buf, ""
            return out, []
        marker = _MARKERS[self.parser]
        content = ""
        if not self.in_calls:
            at = self.buf.find(marker)
            if at < 0:
                keep = partial_suffix(self.buf, marker)
                content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return content, []
            content, self.buf = self.buf[:at], self.buf[at:]
            self.in_calls = True
        calls: list[ToolCall] = []
        if self.parser in ("hermes", "qwen3_coder"):  # a block goes out at its closing tag
            while True:
                m = _HERMES.match(self.buf.lstrip())
                if m is None:
                    break
                parsed = parse(self.parser, m.group(0), self.names)[1]
                if not parsed:
                    break
                calls += parsed
                self.buf = self.buf.lstrip()[m.end():]
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the output: the last calls, or (if it never formed calls)
        the held-back text as content."""
        if self.bare:
            calls = _bare(self.buf, self.names)
            if calls:
                self.buf = ""
                return "", calls
            self.bare = False
            content, more = self.feed("")  # not a call object: the held text goes the usual way
            rest_content, rest_calls = self.finish()
            return content + rest_content, more + rest_calls
        rest, self.buf = self.buf, ""
        if self.parser == "none" or not rest.strip():
            return rest, []
        content, calls = parse(self.parser, rest, self.names)
        if not calls:
            return rest, []
        return content or "", calls


def partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the beginning of `marker` (streamed text
    held back until it is known not to be a marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------- forced calls
def call_prefix(parser: str | None, name: str) -> str:
    """What the model's own format writes before a call's arguments. A named forced call starts
    the answer with it (appended to the prompt) and the constraint holds what follows to the
    arguments' schema: the model writes the arguments where its training put them. Without it a
    model trained on `{"name": …, "arguments": …}` reads the first key of a forced arguments object
    as its call's `name` (Qwen2.5-Coder-0.5B answered {"name": "Person", …} for a Person tool)."""
    n = json.dumps(name, ensure_ascii=False)
    if parser == "hermes":
        return f'<tool_call>\n{{"name": {n}, "arguments": '
    if parser == "llama3_json":
        return f'{{"name": {n}, "parameters": '
    if parser == "mistral":
        return f'[TOOL_CALLS][{{"name": {n}, "arguments": '
    return ""  # qwen3_coder writes XML, not JSON; a template without a format has nothing to open


def _functions(tools: list[dict]) -> dict[str, dict]:
    out = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …, 'parameters': …}}}}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params
    return out


def validate_tool_choice(tool_choice, tools: list[dict] | None) -> str | None:
    """The named function of `tool_choice` (None for none/auto/required); ValueError for a choice
    that cannot be honoured."""
    fns = _functions(tools or [])
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        if not fns:
            raise ValueError("tool_choice 'required' needs tools")
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in fns:
            raise ValueError(f"tool_choice names function {name!r:.60}, which is not among the tools")
        return name
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': …}}")


def forced_schema(tool_choice, tools: list[dict], parallel: bool) -> dict:
    """The JSON schema an output must follow under `required` or a named function."""
    fns = _functions(tools)
    name = validate_tool_choice(tool_choice, tools)
    if name is not None:
        return fns[name]
    one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
            "required": ["name", "parameters"], "additionalProperties": False} for n, p in fns.items()]
    schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(tool_choice, text: str) -> list[ToolCall]:
    """The calls of an output written under `forced_schema` (empty if it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    return [ToolCall(o["name"], json.dumps(o["parameters"], ensure_ascii=False)) for o in value]
