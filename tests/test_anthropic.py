"""Anthropic's Messages API (/v1/messages) driven by the official `anthropic` SDK against a real
server on the default model: text whole and streamed (the documented event sequence), stop
sequences, prefill, tool use forced and fed back, a JSON schema, count_tokens, both ways of
sending the key, and errors in Anthropic's shape that leave the server up."""
import json

import anthropic
import httpx
import jsonschema
import pytest

from test_server import KEY, MODEL, serving

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# greedy: the SDK's 2.x create() has no temperature argument (older ones, and the API, take it)
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    with serving("--api-key", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def events(base: str, body: dict) -> list[tuple[str, dict]]:
    """The raw (event name, data) pairs of a streamed message."""
    out, body = [], {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
    with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True}, timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


def test_a_message_whole_and_streamed(server, client):
    kw = dict(model=MODEL, max_tokens=24, **GREEDY, system="You are terse.",
              messages=[{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}])
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.output_tokens <= 24 and m.usage.input_tokens + m.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"]).input_tokens
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == m.content[0].text and streamed.stop_reason == m.stop_reason
    assert streamed.usage.output_tokens == m.usage.output_tokens
    names = [n for n, _ in events(server, kw)]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == \
        ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_stop_sequences_end_the_message_and_are_named(client):
    kw = dict(model=MODEL, max_tokens=40, **GREEDY, messages=[{"role": "user", "content": "Count from 1 to 20."}])
    text = client.messages.create(**kw).content[0].text
    words = text.split()
    assert len(words) > 4, text
    stop = words[3]
    cut = text[:text.index(stop)]
    m = client.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == cut
    with client.messages.stream(**kw, stop_sequences=[stop]) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_a_prefilled_answer_is_continued(server, client):
    """A last assistant turn is the start of the answer: the model continues that text, as a
    completion of the template's rendering followed by it would."""
    user = [{"role": "user", "content": "What is the capital of France?"}]
    prefill = "The capital of France is"
    m = client.messages.create(model=MODEL, max_tokens=8, **GREEDY,
                               messages=user + [{"role": "assistant", "content": prefill}])
    head = httpx.post(server + "/tokenize", headers={"x-api-key": KEY}, json={"messages": user}).json()["tokens"]
    text = httpx.post(server + "/detokenize", headers={"x-api-key": KEY}, json={"tokens": head}).json()["prompt"]
    done = httpx.post(server + "/v1/completions", headers={"x-api-key": KEY}, timeout=120,
                      json={"prompt": text + prefill, "max_tokens": 8, "temperature": 0}).json()
    assert m.content[0].text == done["choices"][0]["text"]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_whole_streamed_and_fed_back(client, choice):
    kw = dict(model=MODEL, max_tokens=120, **GREEDY, messages=ASK, tools=[WEATHER], tool_choice=choice)
    m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    history = ASK + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                   "content": json.dumps({"temp": 21})} for u in uses]}]
    answer = client.messages.create(model=MODEL, max_tokens=30, **GREEDY, messages=history, tools=[WEATHER])
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    assert client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens > \
        client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens


def test_a_json_schema_output(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"]}
    m = client.messages.create(model=MODEL, max_tokens=60, **GREEDY, messages=[
        {"role": "user", "content": "Pick a colour and a count."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_keys_as_x_api_key_or_bearer(server):
    assert anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0).messages.count_tokens(
        model=MODEL, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body,words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"model": "claude-opus"}, "does not exist"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"temperature": -1}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
])
def test_bad_requests_get_anthropics_error_shape(server, body, words):
    full = {"model": MODEL, "max_tokens": 4, "messages": ASK, **body}
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": KEY}, json={k: v for k, v in full.items()
                                                                               if v is not None})
    assert r.status_code in (400, 404), r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")
    assert words in err["error"]["message"] and "Traceback" not in r.text
    assert httpx.get(server + "/health").status_code == 200
