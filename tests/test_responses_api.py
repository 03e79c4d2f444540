"""OpenAI's Responses API (/v1/responses) driven by the official `openai` SDK (sync, async,
streaming) and by the OpenAI Agents SDK's default model against a real server on the default
model: text, the event sequence, instructions, a JSON schema, forced function calls and their
outputs fed back (by previous_response_id and as items), the bounded store's GET and DELETE, and
errors that name the field."""
import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from test_server import KEY, MODEL, serving

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
GREEDY = dict(temperature=0, max_output_tokens=24)


@pytest.fixture(scope="module")
def server():
    with serving("--api-key", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_text_whole_streamed_and_async_agree(server, client):
    kw = dict(model=MODEL, input="Name three colours.", instructions="You are terse.", **GREEDY)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and [o.type for o in r.output] == ["message"] and r.output[0].status == r.status
    assert r.usage.output_tokens <= 24 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You are terse." and (r.incomplete_details is not None) == (r.status == "incomplete")
    kinds = []
    with client.responses.stream(**kw) as s:
        for event in s:
            kinds.append(event.type)
        final = s.get_final_response()
    assert final.output_text == r.output_text and final.status == r.status
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    raw = client.responses.create(**kw, stream=True)
    assert [e.sequence_number for e in raw] == list(range(len(kinds)))

    async def go():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0) as ac:
            return (await ac.responses.create(**kw)).output_text
    assert asyncio.run(go()) == r.output_text


def test_a_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"]}
    r = client.responses.create(model=MODEL, input="Pick a colour and a count.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_function_call_round_trip_stored_and_as_items(server, client):
    kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=80)
    r = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].id.startswith("fc_") and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(input="What is the weather in Paris?", tool_choice="required", **kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    named = client.responses.create(input="Weather?", tool_choice={"type": "function", "name": "get_weather"}, **kw)
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]
    # fed back by reference to the stored response, and as the whole item list: the same prompt
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temp": 21})} for c in calls]
    by_id = client.responses.create(previous_response_id=r.id, input=outputs, **kw)
    items = [{"role": "user", "content": "What is the weather in Paris?"}] + \
        [c.model_dump(exclude_none=True) for c in calls] + outputs
    by_items = client.responses.create(input=items, **kw)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens and by_id.output_text == by_items.output_text
    assert by_id.previous_response_id == r.id
    # GET and DELETE of a stored response; store: false keeps nothing
    assert client.responses.retrieve(by_id.id).output_text == by_id.output_text
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.delete(f"{server}/v1/responses/{by_id.id}", headers=h).json() == \
        {"id": by_id.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(by_id.id)
    assert httpx.delete(f"{server}/v1/responses/{by_id.id}", headers=h).status_code == 404
    gone = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id=gone.id, input="And?")
    assert e.value.body["param"] == "previous_response_id"


def test_the_store_is_bounded_by_bytes():
    from tokenmill.server.response_store import ResponseStore

    store = ResponseStore(max_bytes=3000)
    for i in range(10):
        store.put(f"r{i}", {"id": f"r{i}", "pad": "x" * 500}, [{"role": "user", "content": "y" * 300}])
    assert 1 <= len(store) < 10 and store.used <= 3000 and store.get("r9") is not None and store.get("r0") is None
    store.put("huge", {"pad": "z" * 5000}, [])
    assert store.get("huge") is None and store.delete("r9") and not store.delete("r9")


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
    ({"temperature": -1}, "temperature"), ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_name_the_field(server, body, param):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/responses", headers=h, json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Traceback" not in r.text, r.text
    ok = httpx.post(server + "/v1/responses", headers=h, timeout=60,
                    json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "metadata": {"a": "b"}, "user": "u",
                          "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
                          "truncation": "disabled", "parallel_tool_calls": False, "prompt_cache_key": "k"})
    assert ok.status_code == 200, ok.text


def test_the_agents_sdk_default_model_runs_an_agent_with_a_tool(server):
    """The OpenAI Agents SDK's default model is its Responses model: an agent whose first turn must
    call its tool (tool_choice required; the SDK resets it after the call) and then answers."""
    import agents

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "21 degrees and sunny"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server + "/v1", api_key=KEY, max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output
