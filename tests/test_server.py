"""The real server on a loopback port, driven by the official `openai` client (and raw HTTP
where a client library would hide what is being checked)."""
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
KEY = "sk-test-key"
MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, env_key: str | None = None, port: int | None = None, env_extra: dict | None = None):
    port = port or free_port()
    env = {**os.environ, **(env_extra or {})}
    if env_key:
        env["TOKENMILL_API_KEY"] = env_key
    # its log to a file, not a pipe: a pipe nobody reads while the server runs fills (64 KiB of
    # warnings, Ray's actor logs) and the server then blocks on its next log line
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--port",
                             str(port), "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory",
                             "512MiB", *extra], env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log_file = log
    base = f"http://127.0.0.1:{port}"
    return wait_up(proc, base, 180), base


def server_log(proc: subprocess.Popen) -> str:
    """What a server wrote to stderr so far (start_server's log file, or a pipe once it ended)."""
    log = getattr(proc, "log_file", None)
    if log is not None:
        log.seek(0)
        return log.read().decode(errors="replace")
    return proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""


def wait_up(proc: subprocess.Popen, base: str, seconds: float) -> subprocess.Popen:
    """`proc` once `base`/health answers 200; its stderr in the error if it exits first or never
    comes up (then killed first)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(server_log(proc))
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    raise RuntimeError(f"{base} did not come up within {seconds:g} s; its stderr ends:\n{server_log(proc)[-3000:]}")


@contextlib.contextmanager
def serving(*extra: str, **kw):
    """start_server's base URL while the block runs; SIGTERM and the exit awaited after it."""
    proc, base = start_server(*extra, **kw)
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    with serving("--api-key", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def headers():
    return {"Authorization": f"Bearer {KEY}"}


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=headers()).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(2))
    return total


GREEDY = dict(temperature=0, max_tokens=24)


# ---------------------------------------------------------------- completions and chat
def test_completion_stream_equals_non_stream_with_usage(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY)
    assert full.usage.completion_tokens == 24 - 0 or full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_stream_equals_non_stream_and_reports_timings(client):
    msgs = [{"role": "user", "content": "Name three fruits."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    timings = full.model_extra["timings"]
    assert timings["ttft"] > 0 and timings["queue_time"] >= 0 and timings["cached_prompt_tokens"] == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_strings_never_leak(client):
    base = client.completions.create(model=MODEL, prompt="Count: one, two, three, four,", **GREEDY).choices[0].text
    stop = base.strip().split()[1][:3]  # a piece from the middle of the greedy text
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="Count: one, two, three, four,", stop=[stop],
                                                    stream=True, **GREEDY))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(model=MODEL, prompt="Count: one, two, three, four,", stop=[stop], **GREEDY)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert stop not in text and reason == "stop" and base.startswith(text)


@pytest.mark.parametrize("content", ["한국어로 자기소개를 해 주세요.", "Reply with three emoji about the sea 🌊"])
def test_korean_and_emoji_streams_are_clean(client, content):
    msgs = [{"role": "user", "content": content}]
    # the prompt once first, so both requests compared find it cached and compute its last rows alike:
    # on AMX CPUs a whole prompt's chunk runs in bfloat16 on tiles and a cached prompt's short tail on
    # the integer kernels, which may move a close greedy choice (README, the amx variant)
    client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=1)
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full.choices[0].message.content
    assert "\ufffd" not in full.choices[0].message.content


def test_n_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7,
                                  max_tokens=8, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_tokenize_detokenize_and_models(server, client):
    r = httpx.post(server + "/tokenize", json={"prompt": "Hello world"}, headers=headers()).json()
    assert r["count"] == len(r["tokens"]) > 0
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}, headers=headers()).json()
    assert back["prompt"] == "Hello world"
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---------------------------------------------------------------- concurrency
@pytest.fixture(scope="module")
def integer_client():
    """A server on the integer kernels (TOKENMILL_AMX=0), whose results do not depend on the batch:
    on the amx variant, steps of many sequences and prompt chunks run on tiles in bfloat16 (README)."""
    proc, base = start_server(env_extra={"TOKENMILL_AMX": "0"})
    yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120), base
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def test_32_concurrent_streams_equal_their_solo_results(integer_client):
    client, server = integer_client
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    def solo(p):
        return client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12).choices[0].text

    async def run():
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)

        async def one(p):
            s = await ac.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12, stream=True)
            return "".join([c.choices[0].text async for c in s if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    together = asyncio.run(run())
    assert together == [solo(p) for p in prompts]


def test_client_disconnect_aborts_and_frees_blocks(server, client):
    idle_usage = metric(server, "tokenmill:kv_cache_usage_perc")
    aborts = metric(server, 'tokenmill:request_success_total')
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server + "/v1/completions", headers=headers(),
                      json={"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000,
                            "ignore_eos": True, "stream": True}) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(server, "tokenmill:num_requests_running") != 0
                                           or metric(server, "tokenmill:kv_cache_usage_perc") != idle_usage):
        time.sleep(0.2)
    assert metric(server, "tokenmill:num_requests_running") == 0
    assert metric(server, "tokenmill:kv_cache_usage_perc") == idle_usage
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.choices[0].text is not None and time.monotonic() - t0 < 10


def test_non_streaming_disconnect_also_aborts(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", headers=headers(), timeout=1.5,
                   json={"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(server, "tokenmill:num_requests_running") != 0:
        time.sleep(0.2)
    assert metric(server, "tokenmill:num_requests_running") == 0


# ---------------------------------------------------------------- errors
BAD = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x " * 9000}, 400, None),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_tokens"),
    # structured outputs and logit_bias: refused before anything is queued, naming the field
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
     400, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(("}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, 400,
     "guided_*"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, 400,
     "guided_decoding_backend"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "bogus": 1}}, 400, "structured_outputs.bogus"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "disable_additional_properties": "no"}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 250}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_openai_error_and_server_stays_up(server, client, path, body, status, param):
    body = {"model": MODEL, **body}
    r = httpx.post(server + path, json=body, headers=headers(), timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    assert "__" not in err["message"] and "keyword argument" not in err["message"], err  # no Python internals
    if param:
        assert err["param"] == param, err
    if "9000" in json.dumps(body) or "x x" in json.dumps(body)[:20]:
        assert re.search(r"\d+", err["message"])  # the numbers are named
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_context_overflow_message_names_the_numbers(server):
    r = httpx.post(server + "/v1/completions", headers=headers(), json={"model": MODEL, "prompt": "hello",
                                                                         "max_tokens": 9000})
    assert r.status_code == 400 and "9000" in r.json()["error"]["message"] and "8192" in r.json()["error"]["message"]


def test_malformed_json_and_oversized_body(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={**headers(), "content-type": "application/json"})
    assert r.status_code in (400, 422) and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server + "/v1/completions", content=b"x" * (9 << 20), headers={**headers(), "content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_auth(server):
    assert httpx.get(server + "/health").status_code == 200
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server + "/v1/models", headers=h)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---------------------------------------------------------------- metrics
def test_metrics_move(server, client):
    names = ["tokenmill:time_to_first_token_seconds_count", "tokenmill:inter_token_latency_seconds_count",
             "tokenmill:e2e_request_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
             "tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total", "tokenmill:request_success_total"]
    before = {n: metric(server, n) for n in names}
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    after = {n: metric(server, n) for n in names}
    assert all(after[n] > before[n] for n in names), (before, after)
    text = httpx.get(server + "/metrics", headers=headers()).text
    for gauge in ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
                  "tokenmill:num_preemptions_total"):
        assert gauge in text


# ---------------------------------------------------------------- backpressure and shutdown
def test_queue_limit_gives_503_and_sigterm_drains():
    proc, base = start_server("--max-queue-len", "1", "--max-num-seqs", "1", env_key="k1,k2")
    try:
        h = {"Authorization": "Bearer k2"}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                reqs = [c.post(base + "/v1/completions", headers=h,
                               json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 30, "ignore_eos": True})
                        for i in range(8)]
                return await asyncio.gather(*reqs)

        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert 503 in codes and 200 in codes, codes
        r503 = next(r for r in rs if r.status_code == 503)
        assert "max-queue-len" in r503.json()["error"]["message"]

        # SIGTERM while a request runs: it still completes
        async def drain():
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.ensure_future(c.post(base + "/v1/completions", headers=h,
                                                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 40,
                                                          "ignore_eos": True}))
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                return await task

        r = asyncio.run(drain())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        # uvicorn re-raises SIGTERM after its graceful shutdown, so the exit is by that signal
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    prompt = "You are a careful assistant who answers in one short sentence. " * 8 + "What is the sun?"
    hits = metric(server, "tokenmill:prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((second.usage.prompt_tokens - 1) // 16)
    assert second.model_extra["timings"]["cached_prompt_tokens"] == cached
    assert second.choices[0].text == first.choices[0].text
    assert metric(server, "tokenmill:prefix_cache_hits_total") >= hits + cached
    assert metric(server, "tokenmill:prefix_cache_queries_total") > 0


def test_a_prompt_list_streams_its_prompts_together(server):
    """Every prompt of a list is read as it generates (chunks interleave), not one prompt after the
    other while the rest queue their outputs."""
    with httpx.Client(base_url=server, timeout=120, headers=headers()) as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": ["A", "B", "C"], "max_tokens": 8,
                                                           "ignore_eos": True, "stream": True}) as r:
            order = [json.loads(line[6:])["choices"][0]["index"] for line in r.iter_lines()
                     if line.startswith("data: {")]
    assert sorted(order) == [0] * 8 + [1] * 8 + [2] * 8
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # index 2 starts before index 0 ends


# ---------------------------------------------------------------- structured outputs, logit_bias
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Lyon", "Nice"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_response_format_json_schema_stream_and_non_stream(client):
    import jsonschema

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a French person as JSON."}],
              temperature=0, max_tokens=80,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == text
    ask = [{"role": "user", "content": 'What is the capital of France? Answer as JSON like {"answer": "..."}'}]
    obj = client.chat.completions.create(**{**kw, "messages": ask, "response_format": {"type": "json_object"},
                                            "max_tokens": 200}).choices[0]
    assert obj.finish_reason == "stop" and "Paris" in json.loads(obj.message.content)["answer"]


def test_guided_fields_and_structured_outputs_on_completions(client):
    for extra, check in (({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
                         ({"structured_outputs": {"grammar": 'root ::= ("red" | "blue") " car"'}},
                          lambda t: t in ("red car", "blue car")),
                         ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                           "required": ["a"]},
                                                  "disable_additional_properties": False, "disable_any_whitespace": True}},
                          lambda t: t.startswith('{"')),  # open: the model may go on adding keys
                         ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}},
                                                           "required": ["a"]}}},
                          lambda t: json.loads(t) in ({"a": 1}, {"a": 2}))):
        r = client.completions.create(model=MODEL, prompt="Answer:", temperature=1.0, seed=3, max_tokens=40,
                                      n=3, extra_body=extra)
        assert all(check(c.text) for c in r.choices), (extra, [c.text for c in r.choices])


def test_logit_bias_bans_a_token(server, client):
    prompt = "The capital of France is"
    first = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1, logprobs=1)
    ids = httpx.post(server + "/tokenize", headers=headers(),
                     json={"prompt": first.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != first.choices[0].text


# ---------------------------------------------------------------- tool calls
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _reassemble(chunks) -> tuple[list[dict], str | None]:
    """The calls a client rebuilds from the chunks, checking OpenAI's shape on the way: one entry
    per call index in a chunk (a client may read only `tool_calls[0]`), the first with id and name."""
    calls: dict[int, dict] = {}
    finish = None
    for c in chunks:
        if not c.choices:
            continue
        entries = c.choices[0].delta.tool_calls or []
        assert len({d.index for d in entries}) == len(entries), entries
        for d in entries:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_validate_and_stream_the_same(client, choice):
    import jsonschema

    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, temperature=0,
              max_tokens=120)
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    streamed, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


def test_a_tool_result_fed_back_renders_and_answers(client):
    call = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                          temperature=0, max_tokens=80).choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], temperature=0,
                                            max_tokens=40).choices[0]
    assert answer.message.content and answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"best_of": 3}, "best_of"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": 3}, "verbosity"), ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"frobnicate": True}, "frobnicate"), ({"continue_final_message": True}, "continue_final_message"),
])
def test_refused_tool_and_unknown_fields(server, client, body, param):
    r = httpx.post(server + "/v1/chat/completions", headers=headers(),
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server + "/v1/chat/completions", headers=headers(),
                    json={"model": MODEL, "messages": ASK, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
                          "store": False, "parallel_tool_calls": True, "reasoning_effort": "low", "verbosity": "low",
                          "prompt_cache_retention": "24h", "stream_options": None})
    assert ok.status_code == 200, ok.text


def test_reasoning_effort_sets_the_templates_thinking_switch():
    """reasoning_effort reaches the template as itself and, where the template has Qwen3's
    enable_thinking, as that switch; the request's own chat_template_kwargs win."""
    from tokenmill.server import params
    from tokenmill.server.protocol import ChatCompletionRequest

    def kwargs(template, **fields):
        return params.template_kwargs(ChatCompletionRequest(messages=ASK, **fields), template)

    qwen3 = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert kwargs(qwen3) is None and kwargs(qwen3, chat_template_kwargs={"x": 1}) == {"x": 1}
    assert kwargs(qwen3, reasoning_effort="minimal") == {"reasoning_effort": "minimal", "enable_thinking": False}
    assert kwargs(qwen3, reasoning_effort="high") == {"reasoning_effort": "high", "enable_thinking": True}
    assert kwargs(qwen3, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})["enable_thinking"]
    assert kwargs("{{ messages }}", reasoning_effort="low") == {"reasoning_effort": "low"}


def test_reasoning_parser_splits_thinking_from_the_answer():
    """--reasoning-parser deepseek_r1: the text before </think> is reasoning_content (streamed as
    delta.reasoning_content), the rest content. The default model does not think, so a regex makes
    it write the shape a thinking model writes."""
    proc, base = start_server("--reasoning-parser", "deepseek_r1")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0,
                  max_tokens=60, extra_body={"guided_regex": r"Two and two[a-z ,]{0,20}\.</think>\n\nIt is [0-9]\."})
        m = client.chat.completions.create(**kw).choices[0].message
        assert m.model_extra["reasoning_content"].startswith("Two and two") and re.fullmatch(r"It is [0-9]\.", m.content)
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == (m.model_extra["reasoning_content"], m.content)
        # Anthropic's Messages API: the same split as thinking blocks (without the regex the whole
        # output is thinking, as deepseek_r1 reads an output that never closes </think>)
        import anthropic
        plain = dict(model=MODEL, messages=kw["messages"], max_tokens=16)
        thought = client.chat.completions.create(**plain, temperature=0).choices[0].message
        assert thought.content is None and thought.model_extra["reasoning_content"]
        ac = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
        msg = ac.messages.create(**plain, extra_body={"temperature": 0})
        assert [(b.type, b.thinking) for b in msg.content] == [("thinking", thought.model_extra["reasoning_content"])]
        with ac.messages.stream(**plain, extra_body={"temperature": 0}) as s:
            assert [(b.type, b.thinking) for b in s.get_final_message().content] == [(b.type, b.thinking)
                                                                                   for b in msg.content]
        # and the Responses API: a reasoning item, whole and streamed
        rkw = dict(model=MODEL, input=plain["messages"], max_output_tokens=16, temperature=0)
        r = client.responses.create(**rkw)
        assert [(o.type, o.content[0].text) for o in r.output] == [("reasoning", thought.model_extra["reasoning_content"])]
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        with client.responses.stream(**rkw) as s:
            kinds = {e.type for e in s}
            assert [(o.type, o.content[0].text) for o in s.get_final_response().output] == \
                [(o.type, o.content[0].text) for o in r.output]
        assert "response.reasoning_text.delta" in kinds
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("field,value", [
    ("suffix", "tail"), ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("best_of", 2)])
def test_every_unimplemented_field_is_refused_by_name(server, field, value):
    path, body = ("/v1/completions", {"prompt": "x"}) if field in ("suffix", "best_of") else \
        ("/v1/chat/completions", {"messages": ASK})
    if field == "web_search_options":
        value = {"search_context_size": "low"}
    r = httpx.post(server + path, headers=headers(), json={"model": MODEL, "max_tokens": 2, **body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_heavy_schema_or_a_dead_end_fails_or_costs_only_its_request(server, client):
    """A schema with thousands of long alternatives compiles on a worker thread while another
    request streams; a constraint that reaches a dead end (min_tokens forbids the end it requires)
    fails alone with a message saying so; the server serves on."""
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
        big = {"type": "object", "properties": {"pick": {"enum": [f"option-{i:05d}-" + "x" * 180 for i in range(4000)]}},
               "required": ["pick"]}
        streaming = aclient.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0, stream=True)
        heavy = aclient.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                                response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "big", "schema": big}})
        dead = aclient.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                          extra_body={"guided_choice": ["ab"], "min_tokens": 10})
        stream, heavy_r, dead_r = await asyncio.gather(streaming, heavy, dead, return_exceptions=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text, heavy_r, dead_r
    text, heavy_r, dead_r = asyncio.run(run())
    assert text
    assert json.loads(heavy_r.choices[0].message.content)["pick"].startswith("option-")
    assert isinstance(dead_r, openai.APIStatusError) and "dead end" in str(dead_r)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
