"""Qwen3-Coder's tool calls (`qwen3_coder`, vLLM's name): XML blocks rather than JSON,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the raw text between its tags (one newline after the opening tag and one
before the closing tag belong to the format). The template renders an earlier call's arguments back
as text (`tojson` for objects and lists), so a value becomes JSON by the type the tool's parameter
schema gives it: a string as written; integer, number and boolean read; object and array parsed as
JSON; a value that does not read as its type stays the text it is (the client sees what the model
wrote). Pure Python."""
from __future__ import annotations

import json
import re

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _type(schema) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def value(text: str, schema) -> object:
    """A parameter's text as the JSON value its schema's type says."""
    text = text[1:] if text.startswith("\n") else text
    text = text[:-1] if text.endswith("\n") else text
    kind, bare = _type(schema), text.strip()
    if kind == "string":
        return text
    if bare == "null":
        return None
    if kind == "boolean" and bare.lower() in ("true", "false"):
        return bare.lower() == "true"
    if kind in ("integer", "number", "object", "array", None):
        try:
            parsed = json.loads(bare)
        except ValueError:
            return text
        if kind is None or (kind == "integer" and isinstance(parsed, int) and not isinstance(parsed, bool)) \
                or (kind == "number" and isinstance(parsed, (int, float)) and not isinstance(parsed, bool)) \
                or (kind == "object" and isinstance(parsed, dict)) or (kind == "array" and isinstance(parsed, list)):
            return parsed
    return text


def call(block: str, schemas: dict) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's body, or None if it holds no function."""
    m = _FUNCTION.search(block)
    if m is None:
        return None
    name = m.group(1).strip()
    params = schemas.get(name) if isinstance(schemas, dict) else None
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    args = {p.strip(): value(v, props.get(p.strip()) if isinstance(props, dict) else None)
            for p, v in _PARAM.findall(m.group(2))}
    return name, json.dumps(args, ensure_ascii=False)


def parse(text: str, schemas: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a complete output; one that holds a block without a
    function is all content, as written."""
    calls = [call(b, schemas) for b in BLOCK.findall(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    return BLOCK.sub("", text).strip() or None, calls
