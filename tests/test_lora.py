"""LoRA adapters: PEFT's format and llama.cpp's LoRA GGUF on a tiny random Llama, against
transformers + peft on the same weights; requests for different adapters and the base batched in
one step; prefix caching keyed by adapter; unloading while requests run; and what is refused."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import make_tiny_hf
from tokenmill import LLM, LoRARequest, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8, 9, 10, 11], [200, 3, 3, 4, 90, 17, 250, 31, 64, 2, 8, 100, 101, 7, 6, 5, 4,
                                                       3, 2, 1, 0, 9]]


def make_adapter(base: str, path: str, seed: int, targets, r: int = 8, alpha: int = 16, **kw):
    """A random PEFT adapter saved at `path` (B not zero: every pair matters); the peft model."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    m = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                   init_lora_weights=False, **kw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    m.save_pretrained(path)
    return m.eval()


def write_gguf_adapter(peft_dir: str, out: str, alpha: float, heads: int, kv_heads: int) -> str:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf writes it for a Llama: Q/K rows of B in
    llama.cpp's rotary order."""
    import gguf
    from safetensors.torch import load_file

    from tokenmill.models.gguf_loader import permute_rows

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    w = gguf.GGUFWriter(out, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for key, t in sorted(load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()):
        parts = key.split(".")
        layer, proj, kind = parts[4], ".".join(parts[5:7]), parts[7]
        if kind == "lora_B" and proj in ("self_attn.q_proj", "self_attn.k_proj"):
            t = permute_rows(t, heads if proj == "self_attn.q_proj" else kv_heads)
        w.add_tensor(f"blk.{layer}.{names[proj]}.weight.lora_{kind[-1].lower()}", t.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf("llama", str(root / "base"))
    peft_models = {
        "a1": make_adapter(base, str(root / "a1"), 1, ALL),
        "a2": make_adapter(base, str(root / "a2"), 2, ["q_proj", "v_proj"], r=4, alpha=8, use_rslora=True),
        "a3": make_adapter(base, str(root / "a3"), 3, ["o_proj", "gate_proj", "up_proj", "down_proj"], r=16, alpha=8,
                           alpha_pattern={"down_proj": 32}),
    }
    reqs = {n: LoRARequest(n, i + 1, str(root / n)) for i, n in enumerate(peft_models)}
    return base, root, peft_models, reqs


@pytest.fixture(scope="module")
def llm(setup):
    base = setup[0]
    return LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", kv_cache_dtype="float32",
               enable_lora=True, max_loras=2, skip_tokenizer_init=True)


def greedy(model, prompt: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return ids[len(prompt):], lps


def run(llm, prompts, lora, n: int = 8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0,
                        logprobs=1, ignore_eos=True), lora_request=lora, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)]) for o in outs]


@pytest.mark.parametrize("name", ["a1", "a2", "a3"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_peft(setup, llm, name):
    _, _, peft_models, reqs = setup
    for prompt in PROMPTS:
        want, want_lp = greedy(peft_models[name], prompt)
        (got, got_lp), = run(llm, [prompt], reqs[name])
        assert got == want
        assert max(abs(a - b) for a, b in zip(want_lp, got_lp)) < 1e-4


def test_llama_cpp_lora_gguf_equals_the_peft_adapter(setup, llm, tmp_path):
    base, root, peft_models, reqs = setup
    cfg = json.load(open(os.path.join(base, "config.json")))
    path = write_gguf_adapter(str(root / "a1"), str(tmp_path / "a1.gguf"), 16.0, cfg["num_attention_heads"],
                              cfg["num_key_value_heads"])
    want, want_lp = greedy(peft_models["a1"], PROMPTS[0])
    (got, got_lp), = run(llm, [PROMPTS[0]], LoRARequest("a1-gguf", 9, path))
    assert got == want and max(abs(a - b) for a, b in zip(want_lp, got_lp)) < 1e-4


def test_a_batch_mixing_three_adapters_and_the_base_equals_each_run_alone(setup, llm):
    """Three adapters in two slots: the scheduler holds one back while two run, and the slots swap."""
    reqs = setup[3]
    loras = [None, reqs["a1"], reqs["a2"], reqs["a3"], reqs["a1"], None, reqs["a3"], reqs["a2"]]
    prompts = [PROMPTS[i % 2] for i in range(len(loras))]
    together = run(llm, prompts, loras, n=12)
    for p, lr, (tokens, lps) in zip(prompts, loras, together):
        (alone, alone_lps), = run(llm, [p], lr, n=12)
        assert alone == tokens  # float32 GEMMs of other widths: logprobs equal to their last bits
        assert max(abs(a - b) for a, b in zip(alone_lps, lps)) < 1e-5
    assert len({tuple(t) for t, _ in together[:4]}) == 4  # every adapter changes the output


def test_quantized_base_batches_adapters_without_merging(setup, integer_kernels):
    base, _, _, reqs = setup
    llm = LLM(base, dtype="float32", quantization="int8", kv_cache_memory="64MiB", enable_lora=True, max_loras=4,
              skip_tokenizer_init=True)
    loras = [None, reqs["a1"], reqs["a2"], reqs["a3"]]
    together = run(llm, [PROMPTS[1]] * 4, loras, n=10)
    assert [run(llm, [PROMPTS[1]], lr, n=10)[0] for lr in loras] == together
    assert len({tuple(t) for t, _ in together}) == 4
    proj = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert proj.qweight is not None and proj.weight is None  # the base stays quantized, one copy


def test_prefix_cache_blocks_belong_to_their_adapter(setup, llm):
    reqs = setup[3]
    prompt = list(range(1, 60))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def cached(lora):
        out = llm.generate([{"prompt_token_ids": prompt}], sp, lora_request=lora, use_tqdm=False)[0]
        return out.metrics.num_cached_tokens, list(out.outputs[0].token_ids)

    first = cached(reqs["a1"])
    assert cached(None)[0] == 0 and cached(reqs["a2"])[0] == 0  # another adapter never reads a1's blocks
    again = cached(reqs["a1"])
    assert again[0] >= 48 and again[1] == first[1]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_an_adapter_equals_plain_decoding(setup, llm, method):
    """The draft (n-gram, or the base model itself without the adapter) proposes; the target verifies
    under the request's adapter, so the tokens are the adapter's own."""
    base, _, _, reqs = setup
    sc = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        sc.update(model=base, quantization="none", disable_by_batch_size=None)
    spec = LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", kv_cache_dtype="float32",
               enable_lora=True, skip_tokenizer_init=True, speculative_config=sc)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    out = spec.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        lora_request=reqs["a2"], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == run(llm, [prompt], reqs["a2"], n=16)[0][0]
    assert out.metrics.num_draft_tokens > 0  # drafts were proposed and verified under the adapter


def test_unloading_waits_for_running_requests_and_refuses_new_ones(setup, llm):
    reqs = setup[3]
    engine = llm.engine
    want = run(llm, [PROMPTS[0]], reqs["a3"], n=12)[0][0]
    engine.add_request("u1", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       lora_request="a3")
    engine.step()
    engine.remove_lora("a3")
    assert "a3" not in [lr.lora_name for lr in engine.list_loras()]
    with pytest.raises(ValueError, match="no LoRA adapter named 'a3'"):
        engine.add_request("u2", PROMPTS[0], SamplingParams(max_tokens=2), lora_request="a3")
    assert "a3" in engine.runner.lora.host  # still serving u1
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert list(final.outputs[0].token_ids) == want
    assert "a3" not in engine.runner.lora.host
    engine.add_lora(reqs["a3"])  # and back
    assert run(llm, [PROMPTS[0]], reqs["a3"], n=12)[0][0] == want


def test_bad_adapters_are_refused_with_the_reason(setup, llm, tmp_path):
    base, root, _, reqs = setup
    with pytest.raises(ValueError, match="rank 16, over this engine's max_lora_rank 8.*--max-lora-rank 16"):
        LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=8,
            skip_tokenizer_init=True).generate([[1, 2]], lora_request=reqs["a3"], use_tqdm=False)
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "small")
    make_adapter(str(tmp_path / "small"), str(tmp_path / "wrong"), 4, ALL)
    with pytest.raises(ValueError, match="trained on another model"):
        llm.engine.add_lora(LoRARequest("wrong", 20, str(tmp_path / "wrong")))
    make_adapter(base, str(tmp_path / "embed"), 5, ["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.engine.add_lora(LoRARequest("embed", 21, str(tmp_path / "embed")))
    (tmp_path / "notes.txt").write_text("not an adapter")
    with pytest.raises(ValueError, match="neither a PEFT adapter directory"):
        llm.engine.add_lora(LoRARequest("txt", 22, str(tmp_path / "notes.txt")))
    dora = make_adapter(base, str(tmp_path / "dora"), 6, ["q_proj"], use_dora=True)
    assert dora is not None
    with pytest.raises(ValueError, match="DoRA"):
        llm.engine.add_lora(LoRARequest("dora", 23, str(tmp_path / "dora")))
    with pytest.raises(ValueError, match="already loaded from"):
        llm.engine.add_lora(LoRARequest("a1", 24, str(root / "a2")))
    plain = LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[1, 2]], lora_request=reqs["a1"], use_tqdm=False)
    assert run(llm, [PROMPTS[0]], None)  # the engine serves on
    assert "wrong" not in llm.engine.runner.lora.host


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segmented_kernel_equals_per_row_products(dtype):
    """Runs of one slot longer and shorter than a block and a register tile, parts with and without
    an adapter, parts whose widths are not whole vectors, ranks under the slots' width, rows of the
    base in between; slots in float32 and float16."""
    from tokenmill import kernels
    from tokenmill.layers.lora import LoRABank, LoRARows

    if not kernels.available():
        pytest.skip("CPU kernels not built")
    torch.manual_seed(0)
    bank = LoRABank([40, 24, 24], 72, 3, 16, dtype=dtype)
    adapters = []
    for slot, (ranks, scale) in enumerate([((16, 8, 0), 0.5), ((4, 0, 4), 2.0), ((1, 16, 16), 1.0)]):
        parts = {p: (torch.randn(r, 72).to(dtype).float(), (torch.randn(n, r) * scale).to(dtype).float(), 1.0)
                 for p, (r, n) in enumerate(zip(ranks, (40, 24, 24))) if r}
        bank.put(slot, parts)
        adapters.append(parts)
    slots = [0] * 37 + [-1, 1, 2, 2, -1, 0, 1] + [2] * 12 + [1]
    x = torch.randn(len(slots), 72)
    want = torch.randn(len(slots), 88)
    got = want.clone()
    for t, s in enumerate(slots):
        for p, (a, b, scale) in (adapters[s].items() if s >= 0 else []):
            lo = bank.offsets[p]
            want[t, lo:lo + b.shape[0]] += (x[t] @ a.t() @ b.t()) * scale
    runs, start = [], 0
    for t in range(1, len(slots) + 1):
        if t == len(slots) or slots[t] != slots[start]:
            runs.append((start, t, slots[start]))
            start = t
    rows = LoRARows(torch.tensor(slots), runs)
    with torch.no_grad():  # the kernel: blocks for every thread (one pass each), then one block (two passes)
        torch.testing.assert_close(bank.add_(got.clone(), x, rows), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bank.add_(got[:9].clone(), x[:9], LoRARows(torch.zeros(9, dtype=torch.long),
                                                                                [(0, 9, 0)])), want[:9], rtol=1e-4,
                                   atol=1e-4)
    with torch.enable_grad():  # the path without it (what other devices take)
        torch.testing.assert_close(bank.add_(got.clone(), x, rows), want, rtol=1e-4, atol=1e-4)


def test_slots_that_do_not_fit_are_refused_with_the_numbers(setup):
    with pytest.raises(ValueError, match=r"LoRA slots do not fit in memory: 1000000 adapters of rank up to 512 need "
                                         r"[0-9.]+ GiB.*Lower --max-loras"):
        LLM(setup[0], dtype="float32", quantization="none", kv_cache_memory="64MiB", enable_lora=True,
            max_loras=1_000_000, max_lora_rank=512, skip_tokenizer_init=True)


def test_lora_modules_flag_forms():
    from tokenmill.server.lora_api import parse_modules

    mods = parse_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat.gguf", "base_model_name": "llama"}'])
    assert [(m.lora_name, m.lora_path, m.base_model_name) for m in mods] == [("sql", "/a/sql", None),
                                                                             ("chat", "/a/chat.gguf", "llama")]
    assert len({m.lora_int_id for m in mods}) == 2
    for bad, msg in ((["sql"], "name=path"), (["a=/x", "a=/y"], "twice"), (['{"name": "a"}'], "name"),
                     (["{nope"], "not valid JSON"), (["a b=/x"], "letters, digits")):
        with pytest.raises(ValueError, match=msg):
            parse_modules(bad)


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_other_families_match_peft(family, tmp_path):
    """Qwen2 (q/k/v biases under the adapter's delta) and Gemma (GeLU, norm offset, embedding scale)."""
    base = make_tiny_hf(family, str(tmp_path / family))
    ref = make_adapter(base, str(tmp_path / "ad"), 7, ALL, r=8, alpha=32)
    llm = LLM(base, dtype="float32", quantization="none", kv_cache_memory="64MiB", kv_cache_dtype="float32",
              enable_lora=True, skip_tokenizer_init=True)
    want, want_lp = greedy(ref, PROMPTS[1])
    (got, got_lp), = run(llm, [PROMPTS[1]], LoRARequest("ad", 1, str(tmp_path / "ad")))
    assert got == want and max(abs(a - b) for a, b in zip(want_lp, got_lp)) < 1e-4
