"""GGUF block types at their own width (quant/kquant.py: K-quants Q2_K-Q6_K, Q5_0/Q5_1, Q8_0, IQ4_NL,
IQ4_XS, MXFP4): decoding equals gguf-py's dequantization exactly, the kernels multiply by exactly those
weights (to the activations' rounding), and Llama-shaped models of mixed types give the float
model's logits on the same dequantized weights. Blocks are random bytes (with sane float16 scales):
every bit pattern a file can hold, without llama.cpp's quantizer (gguf-py cannot make K-quants or
IQ types, only read them)."""
import gguf
import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.quant import kquant

pytestmark = pytest.mark.skipif(not kernels.dot_layout(), reason="the K-quant kernels need tokenmill's CPU kernels")

def unpack_panels(w: kquant.KQuantWeight) -> torch.Tensor:
    """The float32 (N, K) weights a block type's panels hold, read back from the panel layouts
    (kernels/__init__.py, linear.cpp, kquant.cpp) and combined as gguf-py combines them."""
    p = w.panels
    n, k = w.out_features, w.in_features

    def nibbles(t: torch.Tensor) -> torch.Tensor:  # (P, K/8, 64) int4 dot layout -> (N, K)
        b = t.view(-1, k // 8, 16, 4).permute(0, 2, 1, 3)  # (P, 16 rows, octet, j)
        return torch.stack([b & 15, b >> 4], dim=3).reshape(-1, k)[:n]  # octet: j low, then 4 + j high

    def fifth(t: torch.Tensor) -> torch.Tensor:  # (P, K/32, 64) fifth bits -> (N, K) values 0 or 16
        b = t.view(-1, k // 32, 16, 4).permute(0, 2, 1, 3)  # (P, 16 rows, block, j)
        bits = torch.stack([torch.stack([(b >> o) & 1, (b >> (4 + o)) & 1], dim=3) for o in range(4)], dim=3)
        return bits.reshape(-1, k)[:n] << 4  # (.., block, octet, half, j): input 32 block + 8 octet + 4 half + j

    def rows(t: torch.Tensor) -> torch.Tensor:  # (P, G, 16) -> (N, G)
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]
    if isinstance(p, kernels.LutPanels):
        from tokenmill.quant import gguf_blocks

        table = torch.from_numpy(gguf_blocks.MXFP4_VALUES if w.kind == "MXFP4" else gguf_blocks.IQ4_VALUES).float()
        s = rows(p.s)
        if w.kind == "IQ4_XS":
            scale = rows(p.d).float().repeat_interleave(8, dim=1) * s.float()
        elif w.kind == "MXFP4":  # 2^(e - 128), as gguf-py's e8m0_to_fp32_half
            e = s.to(torch.int64)
            scale = torch.where(e < 2, (0x00200000 << e), (e - 1) << 23).to(torch.int32).view(torch.float32)
        else:
            scale = s.float()
        return table[nibbles(p.q).long()] * scale.repeat_interleave(32, dim=1)
    if isinstance(p, kernels.Int8Panels):
        return kernels.unpack_int8(p).float() * rows(p.s).float().repeat_interleave(32, dim=1)
    if isinstance(p, kernels.Int4Panels):
        q = (nibbles(p.q) | fifth(p.qh)).float()
        m = rows(p.m).float() if p.m is not None else rows(p.s).float() * -16  # Q5_0: symmetric, no minimums
        return q * rows(p.s).float().repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    if isinstance(p, kernels.Q4KPanels):
        q = (nibbles(p.q) | fifth(p.qh) if p.qh is not None else nibbles(p.q)).float()
        sc, mn = rows(p.sm[..., :16]).float(), rows(p.sm[..., 16:]).float()
        d, negmin = rows(p.dd[..., :16]).float(), rows(p.dd[..., 16:]).float()
        scale = (d.repeat_interleave(8, dim=1) * sc).repeat_interleave(32, dim=1)
        return q * scale + (negmin.repeat_interleave(8, dim=1) * mn).repeat_interleave(32, dim=1)
    def two_bits(t: torch.Tensor) -> torch.Tensor:  # (P, K/32, 128) 2-bit fields -> (N, K)
        h = t.reshape(-1, k // 32, 2, 16, 4).permute(0, 3, 1, 4, 2)  # (P, 16 rows, block, j, half)
        f = torch.stack([(h >> (2 * o)) & 3 for o in range(4)], dim=3)  # (P, 16, block, octet, j, half)
        return f.permute(0, 1, 2, 3, 5, 4).reshape(-1, k)[:n]  # input 32 block + 8 octet + 4 half + j
    if isinstance(p, kernels.Q23KPanels):
        q = two_bits(p.q2)
        if w.kind == "Q3_K":
            q = (q | (fifth(p.hb) >> 2)).float() - 4
            return (rows(p.d).float().repeat_interleave(16, dim=1) * rows(p.sc).float()).repeat_interleave(16, dim=1) * q
        d = rows(p.d.reshape(p.d.shape[0], -1, 16)).float()  # (N, 2 * K/256): d, -dmin per super-block
        sc, mn = (rows(p.sc) & 15).float(), (rows(p.sc) >> 4).float()
        scale = (d[:, 0::2].repeat_interleave(16, dim=1) * sc).repeat_interleave(16, dim=1)
        minimum = (d[:, 1::2].repeat_interleave(16, dim=1) * mn).repeat_interleave(16, dim=1)
        return q.float() * scale + minimum
    lo = nibbles(p.ql)
    hi = two_bits(p.qh)
    scale = (rows(p.d).float().repeat_interleave(16, dim=1) * rows(p.sc).float()).repeat_interleave(16, dim=1)
    return scale * ((lo | hi << 4).float() - 32)


# where each type's float16 scales sit in its block (offset, low, high): sane magnitudes, no inf/NaN
_HALVES = {"Q4_K": [(0, 1e-4, 2e-3), (2, 1e-4, 2e-3)], "Q5_K": [(0, 1e-4, 2e-3), (2, 1e-4, 2e-3)],
           "Q6_K": [(208, 1e-4, 1e-3)], "Q4_0": [(0, 1e-4, 2e-3)], "Q3_K": [(108, 1e-4, 1e-3)],
           "Q2_K": [(80, 1e-4, 1e-3), (82, 1e-4, 1e-3)], "Q5_0": [(0, 1e-4, 2e-3)],
           "Q5_1": [(0, 1e-4, 2e-3), (2, -2e-3, 2e-3)], "Q8_0": [(0, 1e-5, 1e-4)], "IQ4_NL": [(0, 1e-5, 1e-4)],
           "IQ4_XS": [(0, 1e-6, 1e-5)], "MXFP4": []}


def random_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random bytes in `kind`'s blocks: every bit pattern, with float16 scales of weight-like size
    (MXFP4: exponents for 2^-18..2^-5, and a few subnormal ones)."""
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    b = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for at, lo, hi in _HALVES[kind]:
        b[..., at:at + 2] = np.frombuffer(rng.uniform(lo, hi, (rows, cols // size)).astype(np.float16).tobytes(),
                                          np.uint8).reshape(rows, cols // size, 2)
    if kind == "MXFP4":
        b[..., 0] = rng.integers(110, 124, (rows, cols // size))
        b[::3, 0, 0], b[1::3, 0, 0] = 0, 1  # the subnormal scales, 2^-128 and 2^-127
    return b.reshape(rows, -1)


def reference(kind: str, raw: np.ndarray, cols: int) -> torch.Tensor:
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(raw.shape[0], cols))


@pytest.mark.parametrize("kind", kquant.KINDS)
@pytest.mark.parametrize("rows", [48, 40])  # 40: a partial last panel
def test_transcoded_panels_hold_exactly_the_file_weights(kind, rows):
    raw = random_blocks(np.random.default_rng(rows), rows, 768, kind)
    w = kquant.from_blocks(kind, rows, 768, lambda a, b: raw[a:b])
    assert torch.equal(unpack_panels(w), reference(kind, raw, 768))


@pytest.mark.parametrize("kind", kquant.KINDS)
@pytest.mark.parametrize("n,k", [(48, 512), (40, 256)])  # 40 rows: a partial last panel
@pytest.mark.parametrize("m", [1, 3, 7, 33])
@pytest.mark.parametrize("bits", [16, 8])
def test_kernel_equals_the_dequantized_matmul(kind, n, k, m, bits, integer_kernels):
    rng = np.random.default_rng(n + k + m)
    raw = random_blocks(rng, n, k, kind)
    w = kquant.from_blocks(kind, n, k, lambda a, b: raw[a:b])
    w.panels.act_bits = bits
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    ref = (x.double() @ reference(kind, raw, k).double().t())
    y = w.matmul(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if bits == 16 else 3e-2), err  # 16 bits: float32-level; 8 bits: llama.cpp's Q8 activations


@pytest.mark.parametrize("kind", kquant.KINDS)
@pytest.mark.parametrize("bits", [16, 8])
def test_a_row_gets_the_same_bits_in_any_number_of_rows(kind, bits, integer_kernels):
    """Batch invariance: many rows take other loops than a few (rows_avx2.h on AVX2, one block's
    weights unpacked for every row), with the same integer and float arithmetic, so a row's
    output never depends on what else shares the product."""
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, 40, 512, kind)
    w = kquant.from_blocks(kind, 40, 512, lambda a, b: raw[a:b])
    w.panels.act_bits = bits
    x = torch.from_numpy(rng.standard_normal((37, 512)).astype(np.float32))
    alone = torch.cat([w.matmul(x[i:i + 3]) for i in range(0, 37, 3)])
    assert torch.equal(w.matmul(x), alone)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
@pytest.mark.parametrize("m", [1, 33])  # 33 rows: the AMX tiles on the amx variant
def test_symmetric_types_keep_no_minimums_and_the_file_bytes(kind, m):
    """Q4_0 (int4.pack, as the loader packs it) and Q5_0 are w = d (q - 8) and d (q - 16): the panels
    keep only the scales, the kernels (integer and AMX tiles) derive the minimums."""
    from tokenmill.quant import gguf_blocks, int4

    rng = np.random.default_rng(7)
    raw = random_blocks(rng, 40, 512, kind)
    if kind == "Q4_0":
        w = int4.pack(*gguf_blocks.decode(raw, kind, 512), group_size=32)
    else:
        w = kquant.from_blocks(kind, 40, 512, lambda a, b: raw[a:b])
    assert w.panels.m is None
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    assert w.panels.nbytes() == 48 * 512 // size * nbytes  # the file's bytes (40 rows padded to 3 panels)
    x = torch.from_numpy(rng.standard_normal((m, 512)).astype(np.float32))
    ref = x.double() @ reference(kind, raw, 512).double().t()
    err = ((w.matmul(x).double() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if m == 1 or not kernels.AMX["min_rows"] else 1e-2), err  # tiles: bfloat16 x


@pytest.mark.parametrize("kind", kquant.KINDS)
def test_row_parallel_slices_add_up_to_the_whole_bit_for_bit(kind):
    """A tensor-parallel rank's input slice (whole super-blocks) sums in float64 per segment: the
    ranks' partials add up to one process's sum exactly."""
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, 32, 1024, kind)
    x = torch.from_numpy(rng.standard_normal((3, 1024)).astype(np.float32))
    whole = kquant.from_blocks(kind, 32, 1024, lambda a, b: raw[a:b])
    whole.panels.segment = 256
    per = raw.shape[1]
    halves = [kquant.from_blocks(kind, 32, 512, lambda a, b, h=h: raw[a:b, h * per // 2:(h + 1) * per // 2]) for h in (0, 1)]
    for h in halves:
        h.panels.segment = 256
    full = whole.matmul(x, partial=True)
    parts = halves[0].matmul(x[:, :512], partial=True) + halves[1].matmul(x[:, 512:], partial=True)
    assert full.dtype == torch.float64 and torch.equal(full, parts)


_Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# every other type at its own width, mixed within the fused projections (RowStacks of different panels)
MIXES = {"Q4_K_M": ("Q6_K", [_Q4_K_M, _Q4_K_M]),
         "others": ("Q8_0", [{"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q8_0", "attn_output": "IQ4_XS",
                              "ffn_gate": "Q3_K", "ffn_up": "Q5_0", "ffn_down": "IQ4_NL"},
                             {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "MXFP4", "attn_output": "Q5_0",
                              "ffn_gate": "Q8_0", "ffn_up": "Q2_K", "ffn_down": "Q3_K"}])}


def _tiny_kquant_gguf(path, mix: str = "Q4_K_M") -> None:
    """A 2-layer Llama of 256-wide tensors in one of MIXES (Q4_K_M's: Q4_K q/k/o/gate/up, Q6_K v,
    down and the tied embedding)."""
    rng = np.random.default_rng(0)
    h, ff, vocab, layers = 256, 512, 320, 2
    embed, kinds = MIXES[mix]
    w = gguf.GGUFWriter(str(path), "llama")
    for fn, v in ((w.add_context_length, 256), (w.add_embedding_length, h), (w.add_block_count, layers),
                  (w.add_feed_forward_length, ff), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                  (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, vocab)):
        fn(v)
    w.add_tensor("token_embd.weight", random_blocks(rng, vocab, h, embed), raw_dtype=gguf.GGMLQuantizationType[embed])
    for i in range(layers):
        for name, (rows, cols) in (("attn_q", (h, h)), ("attn_k", (128, h)), ("attn_v", (128, h)),
                                   ("attn_output", (h, h)), ("ffn_gate", (ff, h)), ("ffn_up", (ff, h)),
                                   ("ffn_down", (h, ff))):
            kind = kinds[i][name]
            w.add_tensor(f"blk.{i}.{name}.weight", random_blocks(rng, rows, cols, kind),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("bits", [16, 8])
def test_mixed_kquant_model_equals_the_float_model(tmp_path, bits, mix):
    from tokenmill.quant.base import RowStack
    from tokenmill.models import loader

    path = tmp_path / "kq.gguf"
    _tiny_kquant_gguf(path, mix)
    ref = loader.load(str(path), "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    kq = loader.load(str(path), "float32", torch.device("cpu"), load_tokenizer=False, activation_bits=bits)
    embed, kinds = MIXES[mix]
    for layer, want in zip(kq.model.model.layers, kinds):  # every tensor at its own type, none rounded to int8
        got = [[p.kind for p in proj.qweight.leaves()] for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        runs = lambda *ks: [k for i, k in enumerate(ks) if i == 0 or k != ks[i - 1]]  # noqa: E731 - fused runs of a kind
        assert got == [runs(want["attn_q"], want["attn_k"], want["attn_v"]), [want["attn_output"]],
                       runs(want["ffn_gate"], want["ffn_up"]), [want["ffn_down"]]]
    assert isinstance(kq.model.model.layers[0].self_attn.qkv_proj.qweight, RowStack)
    assert kq.model.tied_head_q.kind == embed and kq.model.model.embed_tokens.weight is None
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # each projection: the float one's product, to the activations' rounding
        for i in (0, 1):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"):
                pa, pb = (dict(m.model.model.layers[i].named_modules())[name] for m in (ref, kq))
                ya, yb = pa(x), pb(x)
                assert ((ya - yb).abs().max() / ya.abs().max()).item() < (1e-4 if bits == 16 else 3e-2)
    ids = torch.tensor([1, 17, 300, 42, 5, 99, 250, 3])
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        a = ref.model.compute_logits(ref.model(ids, pos))
        b = kq.model.compute_logits(kq.model(ids, pos))
        # the embedding rows the compact table looks up are the float table's, exactly
        assert torch.equal(kq.model.model.embed_tokens(ids), ref.model.model.embed_tokens(ids))
    err = ((a - b).abs().max() / a.abs().max()).item()
    # two layers of random weights amplify the projections' differences about a hundredfold: at 16
    # bits (~2e-5 each) the logits stay close; 8-bit rounding (~1e-2 each) is checked per projection
    assert bits == 8 or err < 5e-3, err
    if mix == "Q4_K_M":  # a step reads every layer and the whole table (the head) once: the file's own bytes, within 10 %
        assert kq.model.decode_weight_bytes() <= 1.1 * sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("mix", list(MIXES))
def test_decode_stack_runs_kquants_as_the_python_layers_do(tmp_path, mix):
    """The native decode stack takes every block type's panels and the stacked QKV and gate/up of
    mixed types: same tokens and logprobs, bit for bit, as the Python layers."""
    from tokenmill import LLM, SamplingParams

    path = tmp_path / "kq.gguf"
    _tiny_kquant_gguf(path, mix)
    llm = LLM(str(path), kv_cache_memory="16MiB", enable_prefix_caching=False, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    assert model.decode_stack is not None
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=7, logprobs=2, ignore_eos=True)

    def generate():
        outs = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 99, 3], list(range(40, 60)))], sp)
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]
    native = generate()
    model.decode_stack = None
    assert generate() == native
