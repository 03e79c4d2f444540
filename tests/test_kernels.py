"""tokenmill's CPU kernels against their references: the int4/int8 panel GEMMs against
dequantize + matmul in float64 (float layout) or its exact integer emulation (dot layout, x
rounded to 8- or 16-bit integers per 32 inputs), paged decode and context attention against
gather-then-SDPA, the pointwise ops against PyTorch, over the shapes that exercise row tiles, padded
panels, block chunks, GQA groups and both cache dtypes."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.layers.attention import EIGHT_BIT, decode_reference, store_kv_quantized
from tokenmill.quant import int4, int8

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_KERNELS=0")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the CPU kernels must build here (gcc and ninja are dependencies of the tests)"


# how far from the float64 product each activation width may land (relative to the largest output)
CLOSE_TO_FLOAT = {16: 1e-4, 8: 3e-2}


def quantized_x(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dot layout's activations: per 32 inputs, xq = round(x * qmax / amax), d = amax / qmax
    with qmax = 127 * 256 (16 bits) or 127 (8 bits)."""
    qmax = 127.0 * 256.0 if bits == 16 else 127.0
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, qmax) / amax  # a true division, as the kernel does (qmax / amax is reciprocal * qmax)
    xq = torch.round(xb * torch.where(amax > 0, inv, torch.zeros_like(amax)))
    return xq.double(), (amax / qmax).double()                    # (M, K/32, 32), (M, K/32, 1)


def int4_reference(x, q, scale, minimum, bits):
    """float64 dequantize + matmul, and what the dot layout computes: the rounded x times the
    exact weights (the minimum term too sees the rounded x)."""
    dot = kernels.dot_layout() and (q.shape[1] // scale.shape[1]) % 32 == 0
    if dot:  # the dot layout keeps scales and minimums in float16: those are its exact weights
        scale, minimum = scale.half().float(), minimum.half().float()
    deq = int4.dequantize(q, scale, minimum).double()
    exact = x.double() @ deq.t()
    if not dot:
        return exact, exact
    xq, d = quantized_x(x, bits)
    return (xq * d).reshape(x.shape) @ deq.t(), exact


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("n,k,group", [(96, 256, 32), (40, 64, 64), (576, 1536, 128), (16, 32, 32), (32, 64, 16)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 21])
def test_int4_panels_equal_their_reference(n, k, group, m, bits, integer_kernels):
    torch.manual_seed(n + m)
    q, scale, minimum = int4.quantize_rtn(torch.randn(n, k), group)
    x = torch.randn(m, k)
    w = kernels.pack_int4(q, scale, minimum)
    w.act_bits = bits
    got = kernels.int4_linear(x, w)
    ref, exact = int4_reference(x, q, scale, minimum, bits)
    assert got.shape == (m, n)
    assert (got - ref).abs().max() <= 5e-5 * ref.abs().max()  # allows a rounding tie broken otherwise
    bound = CLOSE_TO_FLOAT[bits] if w.dot else 1e-4
    assert (got - exact).abs().max() <= bound * exact.abs().max()


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_row_gets_the_same_bits_in_any_number_of_rows(group, bits, integer_kernels):
    """Many rows run other loops than a few (rows_avx2.h); a row's output must not depend on them."""
    torch.manual_seed(group + bits)
    q, scale, minimum = int4.quantize_rtn(torch.randn(40, 512), group)
    w = kernels.pack_int4(q, scale, minimum)
    w.act_bits = bits
    x = torch.randn(37, 512)
    alone = torch.cat([kernels.int4_linear(x[i:i + 3], w) for i in range(0, 37, 3)])
    assert torch.equal(kernels.int4_linear(x, w), alone)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("n,k", [(64, 128), (40, 96), (49, 576)])
@pytest.mark.parametrize("m", [1, 8, 13])
def test_int8_panels_equal_their_reference(n, k, m, bits):
    torch.manual_seed(n * m)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) / 100
    x = torch.randn(m, k)
    w = kernels.pack_int8(q, scale)
    w.act_bits = bits
    got = kernels.int8_linear(x, w)
    deq = q.double() * scale.double()[:, None]
    exact = x.double() @ deq.t()
    ref = exact
    if w.dot:
        xq, d = quantized_x(x, bits)
        ref = (xq * d).reshape(x.shape) @ deq.t()
    assert got.shape == (m, n)
    assert (got - ref).abs().max() <= 5e-5 * ref.abs().max()
    bound = CLOSE_TO_FLOAT[bits] if w.dot else 1e-4
    assert (got - exact).abs().max() <= bound * exact.abs().max()


@pytest.mark.skipif(not kernels.dot_layout(), reason="summation in segments is the dot layout's")
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 5, 13])
def test_slices_partial_sums_add_up_to_the_whole_bit_for_bit(kind, m, bits):
    """A row-parallel projection cut at segment bounds, as tensor-parallel ranks hold it: the
    slices' float64 partial sums, added in rank order, are the whole projection's float64 sums
    bit for bit, and rounded they are its float32 output. 40 outputs: a partial 16-row panel."""
    torch.manual_seed(m + bits)
    n, k, segment, cut = 40, 768, 256, 512  # slices of two segments and of one
    w = torch.randn(n, k)
    if kind == "int4":
        q, scale, minimum = int4.quantize_rtn(w, 32)
        product = kernels.int4_linear

        def pack(a, b, seg):
            return kernels.pack_int4(q[:, a:b], scale[:, a // 32:b // 32], minimum[:, a // 32:b // 32])
    else:
        q8, scale8 = int8.rtn_parts(w)
        product = kernels.int8_linear

        def pack(a, b, seg):
            return kernels.pack_int8(q8[:, a:b], scale8)

    def panels(a, b, seg):
        p = pack(a, b, seg)
        p.act_bits, p.segment = bits, seg
        return p
    x = torch.randn(m, k)
    whole = panels(0, k, segment)
    total = product(x, whole, partial=True)
    assert total.dtype == torch.float64 and total.shape == (m, n)
    shares = product(x[:, :cut], panels(0, cut, segment), partial=True) + \
        product(x[:, cut:].contiguous(), panels(cut, k, 0), partial=True)
    assert torch.equal(shares, total)
    assert torch.equal(product(x, whole), total.float())
    plain = panels(0, k, 0)  # one float32 sum: the output rounds it once more, unchanged
    assert torch.equal(product(x, plain), product(x, plain, partial=True).float())
    with pytest.raises(RuntimeError, match="segment of 48 inputs must be a multiple of 32"):
        product(x, panels(0, k, 48))


def test_results_do_not_depend_on_the_thread_count():
    torch.manual_seed(0)
    w = kernels.pack_int4(*int4.quantize_rtn(torch.randn(160, 128), 32))
    x = torch.randn(11, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.int4_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, kernels.int4_linear(x, w))  # panels never split: identical sums


def test_linear_rejects_mismatched_shapes():
    w = kernels.pack_int4(*int4.quantize_rtn(torch.randn(32, 64), 32))
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        kernels.int4_linear(torch.randn(2, 32), w)


KV_DTYPES = [torch.float32, torch.float16, torch.int8, torch.float8_e5m2]


def _cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Random K or V values (num_blocks, bs, Hkv, D) as a cache of `dtype` (8-bit: rows quantized as
    the engine's PyTorch path writes them)."""
    if dtype not in EIGHT_BIT:
        return x.to(dtype)
    nb, bs, h, d = x.shape
    cache = torch.zeros(nb, bs, h, d + 4 if dtype == torch.int8 else d, dtype=dtype)
    rows = x.reshape(-1, h, d)
    store_kv_quantized(rows, rows, cache, torch.zeros_like(cache), torch.arange(nb * bs), use_kernel=False)
    return cache


def _paged(b, lens, bs, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // bs) for n in lens]
    num_blocks = sum(widths) + 5
    k_cache = _cache(torch.randn(num_blocks, bs, hkv, d, generator=g), dtype)
    v_cache = _cache(torch.randn(num_blocks, bs, hkv, d, generator=g), dtype)
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the cache
    width = max(widths)
    tables = torch.zeros(b, width, dtype=torch.long)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = perm[used:used + w]
        used += w
    lens_t = torch.tensor(lens, dtype=torch.long)
    mask = (torch.arange(width * bs)[None, :] < lens_t[:, None])[:, None, None, :]
    q = torch.randn(b, hq, d, generator=g)
    return q, k_cache, v_cache, tables, lens_t, mask


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("lens,bs,hq,hkv,d", [
    ([1, 16, 17, 300], 16, 9, 3, 64),    # SmolLM2's heads; block edges; one token
    ([70, 5], 32, 8, 2, 128),            # blocks longer than the 16-token chunk
    ([33, 40, 8], 8, 4, 4, 64),          # no GQA, short blocks
    ([100], 16, 14, 2, 64),              # Qwen2.5-0.5B's grouping (7 query heads per KV head)
    ([50, 3], 16, 16, 1, 32),            # 16 query heads per KV head: past the grouped kernel's 8
    ([140, 1000, 129], 128, 6, 2, 48),   # contexts over several 128-position items (AVX2), windows across
                                         # their edges, blocks longer than an item, 48-wide heads
])
@pytest.mark.parametrize("window", [0, 7, 24])
def test_paged_decode_attention_equals_gather_then_sdpa(lens, bs, hq, hkv, d, dtype, window):
    q, kc, vc, tables, lens_t, mask = _paged(len(lens), lens, bs, hq, hkv, d, dtype, seed=len(lens) + bs)
    scale = d ** -0.5
    if window:
        mask = mask & (torch.arange(mask.shape[-1]) >= (lens_t - window)[:, None, None, None])
    ref = decode_reference(q, kc, vc, tables, mask, scale, head_dim=d)
    if window:  # blocks wholly before a sliding window are never read: they may have been handed back
        for i, n in enumerate(lens):
            tables[i, :max(0, n - window) // bs] = -1
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens_t, scale, window)
    assert got.shape == q.shape
    # int8 keys meet a query rounded to int16 per head on AVX-512 (15 bits; decode_avx512.h)
    assert (got - ref).abs().max() <= (1e-4 if dtype == torch.int8 else 2e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("start,n,bs,hq,hkv,d", [
    (1008, 48, 16, 9, 3, 64),   # SmolLM2: a question after a cached 1,000-token prompt
    (0, 37, 16, 9, 3, 64),      # no earlier context: plain causal
    (250, 3, 8, 14, 2, 64),     # Qwen2.5-0.5B's grouping; short blocks; a tiny chunk
    (31, 40, 32, 4, 4, 128),    # no GQA; blocks longer than the 32-token chunk; query tiles of 32 + rest
    (5, 1, 16, 4, 2, 16),       # one query
])
@pytest.mark.parametrize("window", [0, 9, 40])
def test_paged_context_attention_equals_gather_then_sdpa(start, n, bs, hq, hkv, d, dtype, window,
                                                        integer_kernels):
    from tokenmill.layers.attention import _attend, read_blocks
    g = torch.Generator().manual_seed(start + n)
    width = -(-(start + n) // bs)
    num_blocks = width + 6
    kc = _cache(torch.randn(num_blocks, bs, hkv, d, generator=g), dtype)
    vc = _cache(torch.randn(num_blocks, bs, hkv, d, generator=g), dtype)
    table = torch.randperm(num_blocks, generator=g)[:width]
    q = torch.randn(n, hq, d, generator=g)
    scale = d ** -0.5
    q_pos = torch.arange(start, start + n)[:, None]
    mask = torch.arange(width * bs)[None, :] <= q_pos
    if window:
        mask &= torch.arange(width * bs)[None, :] > q_pos - window
    ref = _attend(q[None], read_blocks(kc, table[None], d, torch.float32),
                  read_blocks(vc, table[None], d, torch.float32), scale, mask[None, None])[0]
    if window:  # blocks wholly before the first query's window are never read
        table = table.clone()
        table[:max(0, start - window + 1) // bs] = -1
    got = kernels.paged_context_attention(q, kc, vc, table, start, scale, window)
    assert got.shape == q.shape
    assert (got - ref).abs().max() <= 2e-5
    with pytest.raises(RuntimeError, match="does not cover"):
        kernels.paged_context_attention(q, kc, vc, table[:-1], start, scale, window)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_store_kv_writes_rows_as_pytorch_rounds_them(dtype):
    """The kernels' cache writes (one pass per row, also the decode stack's) equal the PyTorch path's
    bit for bit: round to nearest even, int8 by the row's max |x| / 127, a zero row scale 0; and read
    back within half a step."""
    from tokenmill.layers.attention import read_blocks, store_kv
    g = torch.Generator().manual_seed(3)
    hkv, d, bs, nb = 3, 64, 16, 4
    width = d + 4 if dtype == torch.int8 else d
    k = torch.randn(20, hkv, d, generator=g) * 3
    v = torch.randn(20, hkv * 2, d, generator=g)[:, :hkv]  # strided token rows, as views into qkv are
    k[0, 1] = 0.0  # an all-zero row
    k[1, 0, :4] = torch.tensor([0.5, 1.5, -2.5, 1e-30]) * (k[1, 0].abs().max() / 127)  # ties at the scale
    slots = torch.randperm(nb * bs, generator=g)[:20]
    kc, vc = torch.zeros(nb, bs, hkv, width, dtype=dtype), torch.zeros(nb, bs, hkv, width, dtype=dtype)
    kernels.store_kv(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    if dtype in EIGHT_BIT:
        store_kv_quantized(k, v, kr, vr, slots, use_kernel=False)
    else:
        store_kv(k.to(dtype), v.to(dtype), kr, vr, slots)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    if dtype == torch.int8:  # keys smoothed per channel (models/kv_smoothing.py): the same bits both ways
        smooth = torch.rand(hkv, d, generator=g) * 4 + 0.1
        ks, kt, vt = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(vc)
        kernels.store_kv(k, v, ks, torch.zeros_like(vc), slots, smooth)
        store_kv_quantized(k, v, kt, vt, slots, use_kernel=False, k_smooth=smooth)
        assert torch.equal(ks, kt) and not torch.equal(ks, kc)
    back = read_blocks(kc, torch.arange(nb)[None], d, torch.float32)[0][slots]
    step = {torch.int8: k.abs().amax(-1, keepdim=True) / 127, torch.float8_e5m2: k.abs() / 4,
            torch.float16: k.abs() / 1024, torch.float32: 0 * k}[dtype]
    assert ((back - k).abs() <= step / 2 + 1e-30).all()
    assert back[0, 1].abs().max() == 0


def test_paged_decode_attention_rejects_bad_block_ids():
    q, kc, vc, tables, lens_t, _ = _paged(1, [20], 16, 4, 2, 64, torch.float32, seed=0)
    tables[0, 1] = kc.shape[0] + 7
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)


def test_rms_norm_and_rotary_equal_pytorch():
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64)
    x = torch.randn(5, 7, 64)
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    cos, sin = rope.lookup(torch.tensor([0, 3, 17, 99, 127]))
    qkv = torch.randn(5, 14 * 64)
    qk = qkv[:, :12 * 64].view(5, 12, 64)                  # a strided view, as the model passes it
    ref_norm, ref_rot = norm(x), apply_rotary(qk, cos, sin)  # grad mode: PyTorch's ops
    with torch.inference_mode():                             # inference: the kernels
        got_norm, got_rot = norm(x), apply_rotary(qk, cos, sin)
    assert (got_norm - ref_norm).abs().max() <= 1e-5 and (got_rot - ref_rot).abs().max() <= 1e-5
    assert got_rot.is_contiguous()


def test_silu_mul_equals_pytorch():
    torch.manual_seed(0)
    gu = torch.randn(5, 2 * 100) * 6  # 100: six full vectors and a tail; large |x| for exp's range
    gu[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -88.5])
    ref = F.silu(gu[:, :100]) * gu[:, 100:]
    got = kernels.silu_mul(gu)
    assert got.shape == (5, 100)
    assert torch.allclose(got, ref, rtol=2e-6, atol=1e-30)


def test_argmax_equals_torch_with_ties_and_nans():
    torch.manual_seed(0)
    x = torch.randn(6, 1000)             # 62 full vectors and a tail
    x[1, 17] = x[1, 900] = 50.0          # a tie: the first wins
    x[2, 999] = 60.0                     # the maximum in the tail
    x[3, 5], x[3, 700] = float("nan"), float("nan")  # NaN wins, the first one
    x[4] = float("-inf")
    x[5, 2] = float("inf")
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    assert torch.equal(kernels.argmax(x[:, :999]), x[:, :999].argmax(dim=-1))  # strided rows


def test_paged_decode_attention_takes_strided_rows():
    q, kc, vc, tables, lens_t, mask = _paged(3, [5, 40, 17], 16, 6, 2, 64, torch.float16, seed=3)
    wide = torch.randn(3, 9, 64)
    wide[:, :6] = q                      # q as a view into a wider row, as the decode stack passes it
    got = kernels.paged_decode_attention(wide[:, :6], kc, vc, tables, lens_t, 0.125)
    assert torch.equal(got, kernels.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125))


@pytest.mark.parametrize("lens, heads, d", [([7, 2, 11, 7, 1, 33], 12, 32), ([5, 17, 64, 65], 4, 64),
                                            ([3], 2, 16), ([130, 9], 2, 128), ([48, 48, 48], 3, 48)])
def test_encoder_attention_equals_sdpa_per_input(lens, heads, d):
    """Bidirectional attention within each input of a ragged batch (models/encoder.py): lengths off
    the kernel's key chunks and row tiles, one-token inputs, head sizes 16-128."""
    torch.manual_seed(len(lens) + d)
    q, k, v = (torch.randn(sum(lens), heads, d) * 2 for _ in range(3))
    starts = torch.tensor([0, *lens]).cumsum(0)
    got = kernels.encoder_attention(q, k, v, starts, d ** -0.5)
    want = torch.cat([F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)))[0]
                      .transpose(0, 1) for s, e in zip(starts[:-1].tolist(), starts[1:].tolist())])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-5)  # float32 sums in another order


def test_encoder_attention_rejects_what_it_cannot_run():
    q = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.encoder_attention(q, q, q, torch.tensor([0, 4]), 1.0)
    q = torch.randn(4, 2, 16)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        kernels.encoder_attention(q, q, q, torch.tensor([0, 3]), 1.0)
