"""LoRA adapters through the server: the official openai client selects them by `model`,
/v1/models lists them with their parent, vLLM's load/unload routes change them at run time (an
adapter unloaded mid-stream finishes that stream), and the router sends a request for an adapter to
the replica that serves it."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from test_lora import make_adapter
from test_router import start_router, stop
from test_server import KEY, MODEL, serving, start_server
from tokenmill import LLM, LoRARequest, SamplingParams

H = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Tell me a story about a fox."


@pytest.fixture(scope="module")
def adapters(tiny_llama_tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    paths = {}
    for i, (name, targets) in enumerate([("a1", ["q_proj", "v_proj", "down_proj"]), ("a2", ["o_proj", "up_proj"]),
                                         ("a3", ["k_proj", "gate_proj"])]):
        make_adapter(tiny_llama_tok, str(root / name), 10 + i, targets)
        paths[name] = str(root / name)
    return tiny_llama_tok, paths


@pytest.fixture(scope="module")
def server(adapters):
    base, paths = adapters
    with serving("--model", base, "--quantization", "none", "--kv-cache-dtype", "float32", "--api-key", KEY,
                 "--max-loras", "2", "--lora-modules", f"a1={paths['a1']}",
                 '{"name": "a2", "path": "%s", "base_model_name": "tiny-llama"}' % paths["a2"],
                 "--enable-lora-runtime-updates") as url:
        yield url


@pytest.fixture(scope="module")
def offline(adapters):
    """The same model and adapters offline: what each `model` must answer."""
    base, paths = adapters
    llm = LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", kv_cache_dtype="float32",
              enable_lora=True, max_loras=3)

    def answer(name: str | None, n: int = 12) -> str:
        lr = None if name is None else LoRARequest(name, 1, paths[name])
        return llm.generate(PROMPT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), lora_request=lr,
                            use_tqdm=False)[0].outputs[0].text
    return answer


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_adapters_with_their_parent(server):
    models = {m.id: m for m in client(server).models.list().data}
    assert set(models) == {MODEL, "a1", "a2"}
    assert models["a1"].model_extra["parent"] == MODEL and models["a2"].model_extra["parent"] == "tiny-llama"
    assert models[MODEL].model_extra["parent"] is None


def test_the_model_field_selects_the_adapter(server, offline):
    c = client(server)
    texts = {}
    for name in (MODEL, "a1", "a2"):
        out = c.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert out.model == name
        texts[name] = out.choices[0].text
        assert texts[name] == offline(None if name == MODEL else name)
    assert len(set(texts.values())) == 3
    chunks = list(c.completions.create(model="a2", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == texts["a2"]
    assert {ch.model for ch in chunks} == {"a2"}
    with pytest.raises(openai.NotFoundError, match="a9"):
        c.completions.create(model="a9", prompt=PROMPT, max_tokens=2)


def test_adapters_load_and_unload_at_run_time_without_failing_a_running_stream(server, adapters, offline):
    _, paths = adapters
    c = client(server)
    body = {"lora_name": "a3", "lora_path": paths["a3"]}
    assert httpx.post(server + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(server + "/v1/load_lora_adapter", json=body, headers=H, timeout=60)
    assert r.status_code == 200 and "a3" in r.text
    again = httpx.post(server + "/v1/load_lora_adapter", json=body, headers=H, timeout=60)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"},
                     headers=H, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == \
        "LoRA adapter 'bad': /nonexistent does not exist."
    assert "a3" in {m.id for m in c.models.list().data}
    want = offline("a3", 160)

    async def unload_under_load():
        """Streams under three adapters (two slots: one waits) and the base; a3 unloaded and a4 loaded
        while they run."""
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
        started = asyncio.Event()

        async def stream(model: str, n: int) -> tuple[str, str]:
            s = await ac.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
            text, finish = [], None
            async for ch in s:
                text.append(ch.choices[0].text if ch.choices else "")
                finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
                if model == "a3" and len(text) == 3:
                    started.set()
            return "".join(text), finish

        async def change():
            await started.wait()
            async with httpx.AsyncClient(timeout=60) as h:
                gone = await h.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=H)
                new = await h.post(server + "/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": paths["a1"]},
                                   headers=H)
            return gone, new

        runs = [stream(m, 160 if m == "a3" else 40) for m in ("a3", "a1", "a2", MODEL, "a3", "a1")]
        *outs, (gone, new) = await asyncio.gather(*runs, change())
        return outs, gone, new

    outs, unloaded, loaded = asyncio.run(unload_under_load())
    assert unloaded.status_code == 200 and "removed" in unloaded.text and loaded.status_code == 200
    assert all(finish == "length" for _, finish in outs)
    assert outs[0][0] == outs[4][0] == want  # the running requests finished under their adapter
    assert outs[1][0] == outs[5][0] == offline("a1", 40)
    assert c.completions.create(model="a4", prompt=PROMPT, max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text == offline("a1", 40)
    info = [line for line in httpx.get(server + "/metrics", headers=H).text.splitlines()
            if line.startswith("tokenmill:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    gone = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=H)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert c.completions.create(model="a1", prompt=PROMPT, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text == offline("a1")


def test_the_router_sends_an_adapters_requests_to_the_replica_serving_it(adapters):
    base, paths = adapters
    common = ("--model", base, "--quantization", "none", "--kv-cache-dtype", "float32", "--api-key", KEY)
    (pa, a), (pb, b) = start_server(*common, "--lora-modules", f"a1={paths['a1']}"), start_server(*common)
    pr, router = start_router(a, b, extra=("--replica-api-key", KEY))
    try:
        c = client(router)
        assert {m.id for m in c.models.list().data} == {MODEL, "a1"}
        for i in range(4):  # every one to the replica with a1, whatever the policy would pick
            out = c.completions.create(model="a1", prompt=f"{i} {PROMPT}", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert out.model == "a1"
        direct = client(a).completions.create(model="a1", prompt=f"3 {PROMPT}", max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert out.choices[0].text == direct.choices[0].text
        off = httpx.post(b + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["a3"]}, headers=H)
        assert off.status_code == 404 and "--enable-lora-runtime-updates" in off.json()["error"]["message"]
    finally:
        stop(pr, pa, pb)
