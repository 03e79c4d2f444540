"""Tool-call parsing and forcing (server/tools.py): each model format read back into OpenAI's
calls, the streaming parser agreeing with the whole-text one however the text is cut, and the
schemas `required` / a named function impose."""
import json
import pathlib
import random

import jsonschema
import pytest

from tokenmill.server import tools as T

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET; UTC+1"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET; UTC+1"})]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', []),   # broken: shown as written
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {"tz": "a;b"}}',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "a;b"})]),
    ("llama3_json", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]',
     "Sure.", [("get_weather", {"city": "Rome", "unit": "c"})]),
]


BARE = [  # small models sometimes answer with the bare call object instead of their template's format
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None,
     [("get_weather", {"city": "Paris"})]),
    ("none", '{"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    ("hermes", '{"name": "not_a_tool", "arguments": {}}', '{"name": "not_a_tool", "arguments": {}}', []),
    ("none", "```json\n[1, 2]\n```", "```json\n[1, 2]\n```", []),
    ("hermes", "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
]
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer"}, "loud": {"type": "boolean"},
                                     "tags": {"type": "array"}, "note": {"type": "string"},
                                     "ratio": {"type": ["number", "null"]}}}}}
NAMES = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, ALARM)}
XML = [  # Qwen3-Coder: values typed by the tool's schema; a value that does not read as its type stays text
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=set_alarm>\n<parameter=hour>\n"
                    "7\n</parameter>\n<parameter=loud>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n"
                    "</parameter>\n<parameter=note>\n 42 \n</parameter>\n<parameter=ratio>\nnull\n</parameter>\n"
                    "</function>\n</tool_call>",
     "I'll check.", [("get_weather", {"city": "San Francisco, CA"}),
                     ("set_alarm", {"hour": 7, "loud": True, "tags": ["a", 1], "note": " 42 ", "ratio": None})]),
    ("qwen3_coder", "<tool_call>\n<function=set_alarm>\n<parameter=hour>\nseven\n</parameter>\n</function>\n"
                    "</tool_call>", None, [("set_alarm", {"hour": "seven"})]),
    ("qwen3_coder", "<tool_call>\n<parameter=hour>\n7\n</parameter>\n</tool_call>",
     "<tool_call>\n<parameter=hour>\n7\n</parameter>\n</tool_call>", []),   # no function: shown as written
    ("qwen3_coder", "Plain answer, no call.", "Plain answer, no call.", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES + BARE + XML)
def test_parsers_and_their_streaming_twins_agree(parser, text, content, calls):
    got_content, got = T.parse(parser, text, NAMES)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    rng = random.Random(0)
    for _ in range(30):  # any cut of the text into deltas gives the same calls and content
        s, pos, streamed, streamed_calls = T.StreamingParser(parser, NAMES), 0, "", []
        while pos < len(text):
            step = rng.randint(1, 7)
            c, k = s.feed(text[pos:pos + step])
            streamed, streamed_calls, pos = streamed + c, streamed_calls + k, pos + step
        c, k = s.finish()
        streamed, streamed_calls = streamed + c, streamed_calls + k
        assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls
        assert (streamed.strip() or None) == (content.strip() if content else None)


def test_parser_is_picked_from_the_template_or_named():
    assert T.pick_parser(None, "... <tool_call>\n{{ tool }} ...") == "hermes"
    assert T.pick_parser(None, "[TOOL_CALLS] ...") == "mistral"
    assert T.pick_parser(None, "<|python_tag|>") == "llama3_json"
    assert T.pick_parser(None, "{{ messages }}") is None
    coder = (pathlib.Path(__file__).parent / "data" / "chat_templates" / "Qwen3-Coder.jinja").read_text()
    assert T.pick_parser(None, coder) == "qwen3_coder"
    assert T.pick_parser("mistral", "<tool_call>") == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        T.pick_parser("xml", None)


def test_forced_schemas_validate_what_they_should():
    named = {"type": "function", "function": {"name": "get_time"}}
    schema = T.forced_schema(named, [WEATHER, TIME], True)
    jsonschema.validate({"tz": "UTC"}, schema)
    assert [c.name for c in T.forced_calls(named, '{"tz": "UTC"}')] == ["get_time"]
    schema = T.forced_schema("required", [WEATHER, TIME], True)
    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "x"}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"tz": 1}}], schema)   # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, T.forced_schema("required", [WEATHER, TIME], False))   # one call at most
    assert [c.name for c in T.forced_calls("required", json.dumps(calls))] == ["get_weather", "get_time"]
    for choice, tools, words in (("required", None, "needs tools"), ({"type": "function", "function": {"name": "x"}},
                                                                      [WEATHER], "not among the tools"),
                                 ("sometimes", [WEATHER], "tool_choice must be"),
                                 ("auto", [{"type": "function"}], r"tools\[0\]")):
        with pytest.raises(ValueError, match=words):
            T.validate_tool_choice(choice, tools)


def test_history_tool_calls_reach_the_template_with_object_arguments():
    """OpenAI sends an earlier call's arguments as JSON text; templates render them with tojson, so
    they are handed over as an object (a string would be quoted twice)."""
    from tokenmill.server import protocol as P
    from tokenmill.server.params import conversation

    msgs = [P.ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        P.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1")]
    conv = conversation(msgs)
    assert conv[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[1] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}


def test_qwen3_coder_calls_read_back_from_the_templates_own_rendering():
    """An assistant turn with calls, rendered by Qwen3-Coder's own template (what the model learnt
    to write), parses back to the same calls and arguments."""
    from tokenmill.models import chat_template
    from tokenmill.server import protocol as P
    from tokenmill.server.params import conversation

    template = (pathlib.Path(__file__).parent / "data" / "chat_templates" / "Qwen3-Coder.jinja").read_text()
    calls = [("get_weather", {"city": "Paris", "unit": "c"}),
             ("set_alarm", {"hour": 7, "loud": False, "tags": ["x", {"y": 2}], "note": "wake up\nnow", "ratio": 0.5})]
    msg = P.ChatMessage(role="assistant", content="Checking.", tool_calls=[
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)])
    text = chat_template.render(template, conversation([msg]), False, {}, [WEATHER, TIME, ALARM], None)
    answer = text.split("<|im_start|>assistant", 1)[1].removesuffix("<|im_end|>\n")
    content, got = T.parse("qwen3_coder", answer, NAMES)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser,close", [("hermes", "}\n</tool_call>"), ("llama3_json", "}"), ("mistral", "}]")])
def test_a_named_calls_prefix_is_its_formats_own_opening(parser, close):
    """A forced named call starts the answer with its format's opening (call_prefix); the opening,
    the constrained arguments and the format's close read back as that call in the format."""
    args = {"city": "Paris", "unit": "c"}
    text = T.call_prefix(parser, "get_weather") + json.dumps(args) + close
    assert [(c.name, json.loads(c.arguments)) for c in T.parse(parser, text, NAMES)[1]] == [("get_weather", args)]
    assert T.call_prefix("qwen3_coder", "get_weather") == T.call_prefix(None, "get_weather") == ""
