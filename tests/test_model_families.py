"""Every decoder family tokenmill runs, as a tiny random model built with transformers' own config
class: logits equal transformers' for prefill, chunked prefill through the paged cache and every
decode step, with the CPU kernels on (the decode stack included) and off. Sliding windows are
shorter than the contexts, RoPE scalings run past the original context, and the length-dependent
ones (dynamic NTK, LongRoPE) are compared with transformers fed the same chunks through its cache."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.models import loader
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

from conftest import save_perturbed
from test_reference_logits import feed, paged_logits

TOL = 1e-4
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, initializer_range=0.2)


def _config(kind: str):
    """transformers' config for each case: (config, model class)."""
    import transformers as t

    if kind == "qwen3":
        return t.Qwen3Config(**BASE, max_position_embeddings=256, rope_theta=1e6), t.Qwen3ForCausalLM
    if kind == "qwen3-yarn":  # Qwen's long-context recipe: YaRN over a 32-token original context
        return t.Qwen3Config(**BASE, max_position_embeddings=32, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}), \
            t.Qwen3ForCausalLM
    if kind == "mistral-window":
        return t.MistralConfig(**BASE, max_position_embeddings=256, sliding_window=7), t.MistralForCausalLM
    if kind == "gemma2":
        return t.Gemma2Config(**BASE, max_position_embeddings=256, sliding_window=6, query_pre_attn_scalar=24,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0), t.Gemma2ForCausalLM
    if kind == "gemma3":
        return t.Gemma3TextConfig(**BASE, max_position_embeddings=256, sliding_window=6, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e6}}), t.Gemma3ForCausalLM
    if kind == "phi3-longrope":  # Phi-4-mini's shape: partial rotary, LongRoPE past 24 positions
        g = torch.Generator().manual_seed(3)
        half = int(16 * 0.75) // 2
        return t.Phi3Config(**BASE, pad_token_id=0, max_position_embeddings=96, original_max_position_embeddings=24,
                            partial_rotary_factor=0.75, rope_parameters={
                                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                "original_max_position_embeddings": 24,
                                "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
                                "long_factor": (2 + 4 * torch.rand(half, generator=g)).tolist()}), t.Phi3ForCausalLM
    if kind == "phi3-window":
        return t.Phi3Config(**BASE, pad_token_id=0, max_position_embeddings=256, sliding_window=9), t.Phi3ForCausalLM
    if kind == "llama-dynamic":
        return t.LlamaConfig(**BASE, max_position_embeddings=32, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), t.LlamaForCausalLM
    if kind == "llama-linear":
        return t.LlamaConfig(**BASE, max_position_embeddings=24, rope_parameters={
            "rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}), t.LlamaForCausalLM
    # mixtures of experts: 8 experts, 3 per token over 30+ tokens, so the routing is uneven
    moe = dict(BASE, num_hidden_layers=2)
    if kind == "qwen3-moe":  # renormalised top-k, q/k norms, a dense first layer
        return t.Qwen3MoeConfig(**moe, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=256), \
            t.Qwen3MoeForCausalLM
    if kind == "qwen2-moe":  # raw top-k weights, a sigmoid-gated shared expert, QKV bias
        return t.Qwen2MoeConfig(**moe, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, max_position_embeddings=256), \
            t.Qwen2MoeForCausalLM
    if kind == "mixtral":
        return t.MixtralConfig(**moe, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256), \
            t.MixtralForCausalLM
    if kind == "olmoe":  # whole-projection q/k norms, q/k/v clamping
        return t.OlmoeConfig(**moe, pad_token_id=0, num_experts=8, num_experts_per_tok=3, clip_qkv=2.0,
                             max_position_embeddings=256), t.OlmoeForCausalLM
    raise KeyError(kind)


KINDS = ["qwen3", "qwen3-yarn", "mistral-window", "gemma2", "gemma3", "phi3-longrope", "phi3-window",
         "llama-dynamic", "llama-linear", "qwen3-moe", "qwen2-moe", "mixtral", "olmoe"]
MOE_KINDS = {"qwen3-moe", "qwen2-moe", "mixtral", "olmoe"}
PYTHON_LAYERS = {"gemma2", "olmoe"}  # the decode stack declines these (the reason is logged)
LENGTH_DEPENDENT = {"phi3-longrope", "llama-dynamic"}


def make_family(kind: str, path: str) -> str:
    cfg, cls = _config(kind)
    torch.manual_seed(KINDS.index(kind))
    return save_perturbed(cls(cfg), path)


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_family(request.param, str(tmp_path_factory.mktemp(request.param)))


def hf_chunked(path: str, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """transformers' logits for `ids` fed in `chunks` through its own KV cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache, out, pos = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in chunks:
            x = torch.tensor([ids[pos:pos + n]])
            out.append(model(x, past_key_values=cache, use_cache=True,
                             position_ids=torch.arange(pos, pos + n)[None]).logits[0])
            pos += n
    return torch.cat(out)


def schedule(kind: str, length: int, cut: int, step: int) -> list[int]:
    """A prompt chunk of `cut`, then chunks of `step` (1 = decode steps) up to `length`."""
    chunks = [cut]
    while sum(chunks) < length:
        chunks.append(min(step, length - sum(chunks)))
    return chunks


@pytest.mark.parametrize("kernels_on", [True, False])
def test_family_logits_match_transformers(family, kernels_on, monkeypatch):
    kind, path = family
    if not kernels_on:
        monkeypatch.setenv("TOKENMILL_KERNELS", "0")
    lm = loader.load(path, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    bm = BlockManager(num_blocks=96, block_size=4)
    runner = ModelRunner(lm.model, 96, 4, torch.device("cpu"), torch.float32)
    assert (lm.model.decode_stack is not None) == (kernels_on and kind not in PYTHON_LAYERS)
    g = torch.Generator().manual_seed(0)
    # contexts longer than every window and past every scaled rotary's original length
    lengths, cuts, steps = (40, 23, 50), (9, 3, 30), (1, 1, 5)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    plans = [schedule(kind, n, c, s) for n, c, s in zip(lengths, cuts, steps)]
    refs = [hf_chunked(path, s, p) for s, p in zip(seqs, plans)]
    reqs = [Request(f"r{i}", s, SamplingParams(), set()) for i, s in enumerate(seqs)]
    done = [0] * len(seqs)
    for step in range(max(len(p) for p in plans)):
        entries, owners = [], []
        for i, (r, plan) in enumerate(zip(reqs, plans)):
            if step >= len(plan):
                continue
            n = plan[step]
            assert bm.allocate(r, done[i] + n)
            entries.append(feed(r, r.token_ids[done[i]:done[i] + n], done[i]))
            owners.append((i, done[i], n))
            done[i] += n
        got = paged_logits(runner, entries)
        offset = 0
        for i, start, n in owners:
            diff = (got[offset:offset + n] - refs[i][start:start + n]).abs().max().item()
            assert diff < TOL, f"{kind}: seq {i} positions {start}..{start + n}: max diff {diff}"
            offset += n


def test_family_dense_path_matches_transformers(family):
    """No cache (evaluation / training path): one causal pass over the whole sequence."""
    kind, path = family
    lm = loader.load(path, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        got = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(len(ids))))
    assert (got - hf_chunked(path, ids, [len(ids)])).abs().max() < TOL



@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_family_quantized_on_the_kernels(family, quantization):
    """int8 / int4 weights on the CPU kernels: the native decode stack gives the Python layers'
    tokens and logprobs bit for bit (both on the same integers), and the logits stay as near
    transformers' float ones as rounding allows."""
    from tokenmill import LLM, kernels

    from test_decode_stack import CountingStack, generate

    kind, path = family
    if not kernels.available():
        pytest.fail("tokenmill's CPU kernels did not build (see the warning above)")
    llm = LLM(path, quantization=quantization, quantization_group_size=32, kv_cache_memory="16MiB",
              enable_prefix_caching=False, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.qweight is not None
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        got = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    ref = hf_chunked(path, ids, [len(ids)])
    # rounding error of random tiny weights (g32): ~3-5 % RMS at int8, 20-50 % at int4; a wrongly
    # wired layer (a swapped shard, a missing norm) is ~100 %
    # (MoE: rounding also flips some tokens' expert choices, a discrete change: looser bounds)
    rel = ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel < (0.1 if quantization == "int8" else 0.6) * (2.5 if kind in MOE_KINDS else 1), rel
    if kind in PYTHON_LAYERS:
        assert model.decode_stack is None
        return
    counting = model.decode_stack = CountingStack(model.decode_stack)
    native = generate(llm)
    assert counting.calls >= 11
    model.decode_stack = None
    assert generate(llm) == native


def _dense_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_family_gguf_matches_hf_directory(family, tmp_path, integer_kernels):
    """The same tiny model written as GGUF (llama.cpp's layout and metadata, by the `gguf` package)
    loads to the same logits as its Hugging Face directory; as Q4_0 its 4-bit blocks load straight
    into the int4 kernels (fused Phi-3 tensors split by rows) and compute what their dequantized
    floats do."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "scripts"))
    from hf_to_gguf import hf_to_gguf

    kind, path = family
    if kind == "llama-dynamic":
        pytest.skip("GGUF has no dynamic-NTK rope type (llama.cpp's are none, linear, yarn, longrope)")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    hf = loader.load(path, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    f32 = loader.load(hf_to_gguf(path, str(tmp_path / "f32.gguf")), "float32", torch.device("cpu"),
                      load_tokenizer=False)
    assert f32.arch.layer_windows == hf.arch.layer_windows and f32.arch.rope_dim == hf.arch.rope_dim
    assert (_dense_logits(f32.model, ids) - _dense_logits(hf.model, ids)).abs().max() < TOL
    q4 = hf_to_gguf(path, str(tmp_path / "q4.gguf"), "Q4_0")
    exact = loader.load(q4, "float32", torch.device("cpu"), load_tokenizer=False, activation_bits=16)
    assert exact.model.model.layers[0].self_attn.qkv_proj.qweight is not None
    if kind in MOE_KINDS:  # each expert's slice of the stacked Q4_0 tensor, kept as 4-bit
        from tokenmill.quant.int4 import Int4Weight
        expert = exact.model.model.layers[-1].mlp.experts[1]
        assert isinstance(expert.gate_up_proj.qweight, Int4Weight) and expert.gate_up_proj.quantized_source
    floats = loader.load(q4, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    ref = _dense_logits(floats.model, ids)
    assert (_dense_logits(exact.model, ids) - ref).abs().max() < 1e-3 * ref.abs().max()


def test_sliding_window_kv_stays_bounded_and_outputs_match(tmp_path):
    """One long conversation on a model whose every layer slides (Mistral): the blocks it holds stay
    about window / block_size however long it runs, blocks before the window go back to the pool
    (full ones keep their prefix-cache key), and greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams

    path = make_family("mistral-window", str(tmp_path / "m"))  # window 7
    llm = LLM(path, block_size=4, kv_cache_memory="4MiB", skip_tokenizer_init=True, quantization="none")
    engine = llm.engine
    assert engine.scheduler.config.sliding_window == 7
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    engine.add_request("long", prompt, SamplingParams(max_tokens=120, temperature=0,
                                                                             ignore_eos=True))
    req, held, released, out = engine.scheduler.requests["long"], [], 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if "long" in engine.scheduler.requests:
            held.append(len(req.block_table) - req.released_blocks)
            released = req.released_blocks
            engine.block_manager.check_integrity([req])
    # the window's 7 positions span at most 3 blocks of 4, plus the block being filled
    assert max(held[3:]) <= 4, held
    assert released >= (30 + 120 - 7) // 4 - 2
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref.generation_config.eos_token_id = None  # ignore_eos, as the request asked
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=120, do_sample=False)[0, 30:].tolist()
    assert out.outputs[0].token_ids == want


def test_compression_refuses_families_it_cannot_write(family, tmp_path):
    """Every family serves; the compression commands write only the layouts they know, and say so
    before any work."""
    from tokenmill.compress import export
    from tokenmill.models.arch import ArchConfig

    kind, path = family
    with open(f"{path}/config.json") as f:
        arch = ArchConfig.from_hf(json.load(f))
    if arch.family in ("llama", "qwen2", "gemma"):
        cfg = export.hf_config(arch, "float32")
        assert ArchConfig.from_hf(cfg).layer_windows == arch.layer_windows
    else:
        with pytest.raises(ValueError, match="cannot be compressed here yet"):
            export.check_exportable(arch)


TEMPLATES = pathlib.Path(__file__).parent / "data" / "chat_templates"
CONVERSATION = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "  And an even one?  "}]


@pytest.mark.parametrize("name,extra", [("Qwen-Qwen3-0.6B", {}), ("Qwen-Qwen3-0.6B", {"enable_thinking": False}),
                                        ("google-gemma-2-2b-it", {}), ("microsoft-Phi-3.5-mini-instruct", {})])
def test_family_chat_templates_render_as_transformers(name, extra):
    """The families' real templates render as transformers renders them, chat_template_kwargs
    included (Qwen3's enable_thinking); Gemma's refusal of a system turn is a clear error."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from tokenmill.models.chat_template import render

    source = (TEMPLATES / f"{name}.jinja").read_text()
    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    messages = ([] if "gemma" in name else [{"role": "system", "content": "Be brief."}]) + CONVERSATION
    got = render(source, messages, True, special, None, extra)
    rendered, _ = render_jinja_template([messages], chat_template=source, add_generation_prompt=True, **special, **extra)
    assert got == rendered[0]
    if extra.get("enable_thinking") is False:
        assert got.endswith("<think>\n\n</think>\n\n")
    if "gemma" in name:
        assert "<start_of_turn>model\n7<end_of_turn>" in got
        with pytest.raises(ValueError, match="System role not supported"):
            render(source, [{"role": "system", "content": "x"}] + CONVERSATION, True, special)


def test_bad_rotary_configs_are_refused_at_load():
    from tokenmill.models.arch import ArchConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="Unsupported rope scaling type 'mrope'"):
        ArchConfig.from_hf({**cfg, "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})
    from tokenmill.models.llama import CausalLM
    arch = ArchConfig.from_hf({**cfg, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                                       "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}})
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        CausalLM(arch)
