"""`tokenmill router` in front of real `tokenmill serve` replicas on loopback, driven by the official
`openai` client: passthrough, auth and error shapes, disconnects, cache-aware placement, a replica
killed and restarted, saturation; and `serve --data-parallel-size 2` as one command."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from test_server import KEY, MODEL, free_port, metric, start_server, wait_up

pytestmark = pytest.mark.slow
H = {"Authorization": f"Bearer {KEY}"}
GREEDY = dict(temperature=0, max_tokens=16)


def start_router(*replicas: str, extra=()):
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "router", "--port", str(port),
           "--api-key", KEY, "--health-interval", "0.3", "--eject-after", "1", "--readmit-after", "1", *extra]
    for r in replicas:
        cmd += ["--replica", r]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    return wait_up(proc, base, 60), base


def stop(*procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def fleet():
    """Two replicas and a cache_aware router over them."""
    (pa, a), (pb, b) = start_server("--api-key", KEY), start_server("--api-key", KEY)
    pr, router = start_router(a, b)
    yield router, a, b
    stop(pr, pa, pb)


def test_stream_and_non_stream_through_the_router_equal_a_direct_replica(fleet):
    router, a, _ = fleet
    via = openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=a + "/v1", api_key=KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three fruits."}]
    full = direct.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    want = full.choices[0].message.content
    assert via.chat.completions.create(model=MODEL, messages=msgs, **GREEDY).choices[0].message.content == want
    chunks = list(via.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    comp = via.completions.create(model=MODEL, prompt="The capital of France is", **GREEDY)
    assert comp.choices[0].text == direct.completions.create(model=MODEL, prompt="The capital of France is",
                                                             **GREEDY).choices[0].text
    assert [m.id for m in via.models.list().data] == [MODEL]
    tok = httpx.post(router + "/tokenize", headers=H, json={"prompt": "Hello"}).json()
    assert tok == httpx.post(a + "/tokenize", headers=H, json={"prompt": "Hello"}).json()


def test_stored_responses_are_reached_on_the_replica_that_holds_them(fleet):
    """Each replica keeps its own stored responses: chains by previous_response_id (whole and
    streamed), GET and DELETE through the router reach the replica that made the response, however
    the policy would spread them; and the chain's answers equal a direct replica's."""
    router, a, _ = fleet
    via = openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=a + "/v1", api_key=KEY, max_retries=0, timeout=120)
    for client in (via, direct):
        last, texts = None, []
        for i, word in enumerate(["Hello.", "Name a colour.", "And a fruit.", "And a city."]):
            kw = dict(model=MODEL, input=word, previous_response_id=last, temperature=0, max_output_tokens=8)
            if i % 2:
                with client.responses.stream(**kw) as s:
                    r = s.get_final_response()
            else:
                r = client.responses.create(**kw)
            last = r.id
            texts.append(r.output_text)
            assert client.responses.retrieve(r.id).output_text == r.output_text
        if client is via:
            chain, chain_last = texts, last
    assert chain == texts
    assert httpx.delete(f"{router}/v1/responses/{chain_last}", headers=H).json()["deleted"] is True
    assert httpx.delete(f"{router}/v1/responses/{chain_last}", headers=H).status_code == 404


def test_auth_and_error_shapes_are_the_replicas(fleet):
    router, a, _ = fleet
    for base in (router, a):
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = {"model": MODEL, "prompt": "x", "max_tokens": -5}
    via, direct = (httpx.post(b + "/v1/completions", headers=H, json=bad) for b in (router, a))
    assert via.status_code == direct.status_code == 400 and via.json() == direct.json()
    r = httpx.post(router + "/v1/chat/completions", headers={**H, "content-type": "application/json"}, content=b"{no")
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.get(router + "/v1/nothing-here", headers=H)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.delete(router + "/v1/models", headers=H)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="no-such-model", prompt="x", max_tokens=2)
    assert httpx.get(router + "/metrics").status_code == 401 and httpx.get(router + "/health").status_code == 200


def test_cache_aware_sends_a_conversation_back_to_its_replica(fleet):
    router, a, b = fleet
    system = "You are a patient tutor. You explain each step of your reasoning in plain words. " * 6
    hits_before = metric(a, "tokenmill:prefix_cache_hits_total") + metric(b, "tokenmill:prefix_cache_hits_total")
    homes = set()
    for q in ("What is a prime number?", "What is a square number?", "What is an even number?"):
        r = httpx.post(router + "/v1/chat/completions", headers=H, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": q}], **GREEDY})
        assert r.status_code == 200
        homes.add(r.headers["x-tokenmill-replica"])
    assert len(homes) == 1  # one after another, no load: the prefix decides
    hits = metric(a, "tokenmill:prefix_cache_hits_total") + metric(b, "tokenmill:prefix_cache_hits_total")
    assert hits - hits_before >= 2 * 16 * 5  # the later two found the system prompt's ~100 tokens of blocks
    assert metric(router, 'tokenmill:router_routing_decisions_total{policy="cache_aware",reason="prefix"}') >= 2
    text = httpx.get(router + "/metrics/replicas", headers=H).text
    assert f'tokenmill:prefix_cache_hits_total{{model_name="{MODEL}",replica="{a}"}}' in text
    assert "tokenmill:router_" not in text


def test_client_disconnect_through_the_router_frees_the_replicas_blocks(fleet):
    router, a, b = fleet
    idle = {x: metric(x, "tokenmill:kv_cache_usage_perc") for x in (a, b)}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", router + "/v1/completions", headers=H,
                      json={"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 2000,
                            "ignore_eos": True, "stream": True}) as r:
            replica = (a, b)[int(r.headers["x-tokenmill-replica"])]
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    assert metric(replica, "tokenmill:num_requests_running") == 1
                    break  # leaving the loop closes the stream: the client is gone
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(replica, "tokenmill:num_requests_running") != 0
                                           or metric(replica, "tokenmill:kv_cache_usage_perc") != idle[replica]):
        time.sleep(0.2)
    assert metric(replica, "tokenmill:num_requests_running") == 0
    assert metric(replica, "tokenmill:kv_cache_usage_perc") == idle[replica]
    # a non-streaming request abandoned before its answer is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router + "/v1/completions", headers=H, timeout=2,
                   json={"model": MODEL, "prompt": "Count to a thousand.", "max_tokens": 2000, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum(metric(x, "tokenmill:num_requests_running") for x in (a, b)):
        time.sleep(0.2)
    assert sum(metric(x, "tokenmill:num_requests_running") for x in (a, b)) == 0
    assert metric(router, "tokenmill:router_replica_in_flight") == 0


def test_a_killed_replica_is_ejected_its_requests_retried_and_readmitted_on_restart():
    (pa, a), (pb, b) = start_server("--api-key", KEY), start_server("--api-key", KEY)
    pr, router = start_router(a, b, extra=("--policy", "round_robin"))
    port_b = b.rsplit(":", 1)[1]
    try:
        async def load():
            async with httpx.AsyncClient(timeout=180) as c:
                async def plain(i):
                    return await c.post(router + "/v1/completions", headers=H,
                                        json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 60,
                                              "ignore_eos": True})

                async def streamed(i, started: asyncio.Event):
                    events = []
                    async with c.stream("POST", router + "/v1/completions", headers=H,
                                        json={"model": MODEL, "prompt": f"Tale {i}:", "max_tokens": 400,
                                              "ignore_eos": True, "stream": True}) as r:
                        where = r.headers["x-tokenmill-replica"]
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                                started.set()
                    return where, events
                flags = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.ensure_future(streamed(i, flags[i])) for i in range(2)]
                for f in flags:
                    await f.wait()
                plains = [asyncio.ensure_future(plain(i)) for i in range(6)]
                await asyncio.sleep(0.5)
                pb.kill()  # SIGKILL: no goodbye
                return await asyncio.gather(*streams), await asyncio.gather(*plains)

        streams, plains = asyncio.run(load())
        # every request that had not started streaming from the dead replica succeeds (retried elsewhere)
        assert [r.status_code for r in plains] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in plains)
        for where, events in streams:
            if where == "0":
                assert events[-1] == "[DONE]" and "error" not in events[-2]
            else:  # started on the killed one: an error event in OpenAI's shape, never a silent cut
                assert json.loads(events[-2])["error"]["code"] == 502 and events[-1] == "[DONE]"
        assert {w for w, _ in streams} == {"0", "1"}
        assert metric(router, f'tokenmill:router_replica_healthy{{replica="{b}"}}') == 0
        for _ in range(4):  # all new requests go to the live one
            r = httpx.post(router + "/v1/completions", headers=H, timeout=60,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == "0"
        assert metric(router, "tokenmill:router_ejections_total") >= 1
        pb2, b2 = start_server("--api-key", KEY, port=int(port_b))
        try:
            assert b2 == b
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not metric(router, f'tokenmill:router_replica_healthy{{replica="{b}"}}'):
                time.sleep(0.2)
            seen = {httpx.post(router + "/v1/completions", headers=H, timeout=60,
                               json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).headers["x-tokenmill-replica"]
                    for _ in range(4)}
            assert seen == {"0", "1"}
        finally:
            stop(pb2)
    finally:
        stop(pr, pa, pb)


def test_saturated_replicas_queue_then_503_in_openai_shape():
    pa, a = start_server("--api-key", KEY)
    pr, router = start_router(a, extra=("--max-concurrency-per-replica", "1", "--max-queue-len", "1"))
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(router + "/v1/completions", headers=H,
                                                     json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 20,
                                                           "ignore_eos": True}) for i in range(5)))
        codes = [r.status_code for r in asyncio.run(burst())]
        assert codes.count(200) >= 2 and 503 in codes, codes  # one running + one queued get through
        r503 = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert r503.json()["error"]["type"] == "server_overloaded" and r503.json()["error"]["code"] == 503
        assert metric(router, 'tokenmill:router_rejected_total{reason="queue_full"}') >= 1
        stop(pa)  # no replica left: 503 at once, the router stays up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(router + "/health").status_code == 200:
            time.sleep(0.2)
        r = httpx.post(router + "/v1/completions", headers=H, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "no healthy replica" in r.json()["error"]["message"]
        assert httpx.get(router + "/health").json()["error"]["code"] == 503
    finally:
        stop(pr, pa)


def test_serve_data_parallel_pins_replicas_restarts_one_that_dies_and_drains_on_sigterm():
    port = free_port()
    env = dict(os.environ, TOKENMILL_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--port",
                             str(port), "--served-model-name", MODEL, "--data-parallel-size", "2",
                             "--kv-cache-memory", "512MiB"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and metric_or_zero(base, "tokenmill:router_replica_healthy") < 2:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.5)
        kids = psutil.Process(proc.pid).children()
        assert len(kids) == 2
        cores = sorted(tuple(k.cpu_affinity()) for k in kids)
        available = sorted(os.sched_getaffinity(0))
        if len(available) >= 2:
            assert not set(cores[0]) & set(cores[1]) and sorted(cores[0] + cores[1]) == available
        assert all("--threads" in k.cmdline() for k in kids)
        assert all(KEY not in " ".join(k.cmdline()) for k in kids)  # keys travel in the environment
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
        assert out.usage.completion_tokens >= 1 and out.choices[0].message.content
        # a replica that dies is started again and re-admitted
        kids[0].kill()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(psutil.Process(proc.pid).children()) < 2
                                               or metric_or_zero(base, "tokenmill:router_replica_healthy") < 2):
            time.sleep(0.5)
        assert metric_or_zero(base, "tokenmill:router_replica_healthy") == 2

        async def drain():  # SIGTERM while a request runs: it completes, then everything exits
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.ensure_future(c.post(base + "/v1/completions", headers=H,
                                                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 40,
                                                          "ignore_eos": True}))
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                return await task
        kids = psutil.Process(proc.pid).children()
        r = asyncio.run(drain())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=90) in (0, -signal.SIGTERM)
        assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()


def metric_or_zero(base: str, name: str) -> float:
    try:
        return metric(base, name)
    except httpx.HTTPError:
        return 0.0
