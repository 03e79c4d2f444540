"""Quantized weights: exact GGUF 4-bit decoding, and every kernel against dequantize + matmul."""
import gguf
import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.layers.linear import FusedLinear, Linear
from tokenmill.quant import gguf_blocks, int4, int8


def bf16_reference(x, w):
    """What the kernels compute: bfloat16 activations times the dequantized weight."""
    return x.to(torch.bfloat16).float() @ w.float().t()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_decode_exactly(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(8, 128)
    q, scale, minimum = gguf_blocks.decode(raw, kind, 128)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert np.array_equal(int4.dequantize(q, scale, minimum).numpy(), ref)


@pytest.fixture(params=["tokenmill", "torch"])
def backend(request, monkeypatch):
    """Both int kernels: tokenmill's own (float32, exact scales) and PyTorch's (bf16)."""
    if request.param == "torch":
        monkeypatch.setenv("TOKENMILL_KERNELS", "0")
    elif not kernels.available():
        pytest.fail("tokenmill's CPU kernels did not build (see the warning above)")
    return request.param


@pytest.mark.parametrize("m", [1, 5, 64, 200])
def test_int4_kernel_matches_dequantized_matmul(m, backend, integer_kernels):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    q, scale, minimum = int4.quantize_rtn(w, 32)
    packed = int4.pack(q, scale, minimum, 32)
    x = torch.randn(m, 256)
    got = packed.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (m, 96)
    if backend == "tokenmill":  # exact weights (the dot layout's scales and mins in float16), 16-bit activations
        assert packed.panels is not None
        if packed.panels.dot:
            scale, minimum = scale.half().float(), minimum.half().float()
        ref = x.double() @ int4.dequantize(q, scale, minimum).double().t()
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
        return
    # PyTorch's kernel keeps scales and zeros in bfloat16: compare against that rounding
    sz = packed.scales_zeros.float()
    deq = (q.float().reshape(96, 8, 32) - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    ref = bf16_reference(x, deq.reshape(96, 256))
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    if m >= int4.DEQUANT_MIN_ROWS:  # dequantized once, float GEMM: those very weights and inputs, float32 sums
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    # and RTN itself stays close to the float weight
    assert (int4.dequantize(q, scale, minimum) - w).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("m", [1, 7])
def test_int8_kernel_matches_dequantized_matmul(m, backend):
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    qw = int8.quantize_rtn(w)
    x = torch.randn(m, 128)
    ref = bf16_reference(x, int8.dequantize(qw))
    assert (qw.matmul(x) - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (int8.dequantize(qw) - w).abs().max() <= w.abs().max() / 127


def test_fused_layer_packs_exact_shards_and_falls_back_to_int8(backend):
    torch.manual_seed(2)
    layer = FusedLinear(64, {"a": 32, "b": 16})
    shards = {}
    for name, rows in (("a", 32), ("b", 16)):
        w = torch.randn(rows, 64)
        parts = int4.quantize_rtn(w, 32)
        deq = int4.dequantize(*parts)
        layer.weight_loader(layer.weight, deq, name, int4_parts=parts, quantized=True)
        shards[name] = deq
    layer.quantize("auto", 32)
    assert isinstance(layer.qweight, int4.Int4Weight) and layer.weight is None
    x = torch.randn(3, 64)
    ref = bf16_reference(x, torch.cat([shards["a"], shards["b"]]))
    assert (layer(x) - ref).abs().max() <= 0.02 * ref.abs().max()

    mixed = FusedLinear(64, {"a": 32, "b": 16})
    mixed.weight_loader(mixed.weight, shards["a"], "a", int4_parts=int4.quantize_rtn(shards["a"], 32), quantized=True)
    mixed.weight_loader(mixed.weight, shards["b"], "b", quantized=True)   # e.g. a Q8_0 shard
    mixed.quantize("auto", 32)
    assert isinstance(mixed.qweight, int8.Int8Weight)

    plain = Linear(64, 16)
    plain.weight_loader(plain.weight, torch.randn(16, 64))
    plain.quantize("auto", 32)
    assert plain.qweight is None and plain.weight is not None      # float checkpoints stay float
    plain.quantize("int4", 32)
    assert isinstance(plain.qweight, int4.Int4Weight)
    odd = Linear(64, 8)                                             # the int4 packing needs rows % 16
    odd.weight_loader(odd.weight, torch.randn(8, 64))
    odd.quantize("int4", 32)
    assert isinstance(odd.qweight, int8.Int8Weight)


def test_int4_group_size_must_divide(tiny_llama):
    from tokenmill.models import loader

    with pytest.raises(ValueError, match=r"int4 group size must be one of \(32, 64, 128, 256\), got 48"):
        loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="int4",
                    group_size=48)
    with pytest.raises(ValueError, match=r"group size 128 does not divide the input dimension \d+"):
        loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="int4",
                    group_size=128)
    with pytest.raises(ValueError, match="quantization must be one of"):
        loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="fp4")


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_default_model_runs_quantized_and_stays_close(default_model, activation_bits):
    """GGUF Q4_1 layers become int4 (exactly, up to bf16 scales) and the Q8_0 embedding an int8
    output head; next-token logits stay close to the dequantized float model's, with 16-bit or
    8-bit activations in the kernels (the head keeps 16)."""
    from tokenmill.models import loader

    ref = loader.load(default_model, "float32", torch.device("cpu"), quantization="none")
    q = loader.load(default_model, "float32", torch.device("cpu"), quantization="auto",
                    activation_bits=activation_bits)
    layer0 = q.model.model.layers[0]
    assert isinstance(layer0.self_attn.qkv_proj.qweight, int4.Int4Weight)
    assert isinstance(layer0.mlp.gate_up_proj.qweight, int4.Int4Weight)
    assert q.model.tied_head_q is not None
    if layer0.mlp.down_proj.qweight.panels is not None:
        assert layer0.mlp.down_proj.qweight.panels.act_bits == activation_bits
        assert q.model.tied_head_q.panels.act_bits == 16
    ids = torch.tensor(ref.tokenizer.encode("The quick brown fox jumps over the lazy dog because"))
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        a = ref.model.compute_logits(ref.model(ids, pos))
        b = q.model.compute_logits(q.model(ids, pos))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (pa.exp() * (pa - pb)).sum(-1).mean()
    assert kl < 0.05, kl


def test_auto_activation_bits_are_16_and_an_explicit_width_wins(tiny_llama):
    """auto: 16-bit activations on every variant (8 flips the default model's answers); an explicit
    width always wins."""
    from tokenmill.models import loader

    want = 16
    assert kernels.auto_activation_bits() == want
    for asked, expect in (("auto", want), (16, 16), (8, 8)):
        m = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="int4",
                        activation_bits=asked)
        assert m.activation_bits == expect
        panels = m.model.model.layers[0].mlp.down_proj.qweight.panels
        if panels is not None:
            assert panels.act_bits == expect


def test_keep_float_serves_large_batches_from_the_float_weight(backend):
    from tokenmill.layers.linear import FLOAT_MIN_ROWS

    torch.manual_seed(3)
    w = torch.randn(32, 64)
    parts = int4.quantize_rtn(w, 32)
    deq = int4.dequantize(*parts)
    layer = Linear(64, 32)
    layer.weight_loader(layer.weight, deq, int4_parts=parts, quantized=True)
    layer.quantize("auto", 32, keep_float=True)
    assert isinstance(layer.qweight, int4.Int4Weight) and layer.float_weight is not None
    small, big = torch.randn(4, 64), torch.randn(FLOAT_MIN_ROWS + 1, 64)
    assert torch.equal(layer(big), big @ deq.t())                 # exact float path
    ref = bf16_reference(small, deq)
    assert (layer(small) - ref).abs().max() <= 0.02 * ref.abs().max()  # int4 kernel path
