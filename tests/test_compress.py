"""Compression on tiny random models: the AWQ/GPTQ layouts, the algorithms' guarantees, checkpoints
that load back with the matching kernels, pruning's exact sparsity and shapes, distillation that
resumes, and every command's refusal of bad input without leaving a half-written directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.compress import calib, distill, export, prune, qalgo
from tokenmill.compress import quantize as quant
from tokenmill.layers.linear import Linear
from tokenmill.models import loader
from tokenmill.quant import int4, int8, packed

CLI = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING"]
CPU = torch.device("cpu")


def load(path: str, quantization: str = "none", tokenizer: bool = False, activation_bits: int | str = "auto"):
    return loader.load(path, "float32", CPU, load_tokenizer=tokenizer, quantization=quantization,
                       activation_bits=activation_bits)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(ids.numel())))


def samples(n: int = 8, length: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 128), (32, 576, 128)])
def test_awq_and_gptq_layouts_round_trip(n, k, group):
    g = torch.Generator().manual_seed(n + k)
    g_idx = packed.default_g_idx(k, group)
    num_groups = int(g_idx.max()) + 1
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (n, num_groups), generator=g)
    scales = torch.rand(n, num_groups, generator=g).half().float()
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack_awq(packed.pack_awq(q, zeros, scales)),
                                                 (q, zeros, scales)))
    perm_idx = g_idx[torch.randperm(k, generator=g)]  # act-order: any assignment of inputs to groups
    for bits in (4, 8):
        qb = torch.randint(0, 2 ** bits, (n, k), generator=g)
        zb = torch.randint(0, 2 ** bits, (n, num_groups), generator=g)
        out = packed.unpack_gptq(packed.pack_gptq(qb, zb, scales, perm_idx, bits), bits)
        assert all(torch.equal(a, b) for a, b in zip(out, (qb, zb, scales, perm_idx)))


def test_layouts_put_the_bits_where_other_engines_read_them():
    q = torch.arange(8)[None, :].repeat(16, 1)                    # output n, input k: value k
    awq = packed.pack_awq(q, torch.zeros(16, 1, dtype=torch.long), torch.ones(16, 1))
    assert awq["qweight"].shape == (8, 2) and awq["qweight"][3, 0].item() == 0x33333333
    col = torch.arange(8)[:, None].repeat(1, 8)                    # N=8 outputs with values 0..7
    word = packed.pack_awq(col, torch.zeros(8, 1, dtype=torch.long), torch.ones(8, 1))["qweight"][0, 0].item()
    assert word == 0x75316420                                      # AWQ's interleaved order 0 2 4 6 1 3 5 7
    gp = packed.pack_gptq(q, torch.full((16, 1), 8), torch.ones(16, 1), torch.zeros(8, dtype=torch.long), 4)
    assert gp["qweight"].shape == (1, 16) and gp["qweight"][0, 0].item() == 0x76543210
    assert gp["qzeros"][0, 0].item() == 0x77777777                 # zero 8 stored as 7 (the v1 format)


def test_kernel_layout_of_act_order_and_partial_groups():
    g_idx = packed.default_g_idx(576, 128)                         # 4 groups of 128 and one of 64
    perm, size, groups = packed.kernel_layout(g_idx, int4.GROUP_SIZES)
    assert perm is None and size == 64 and groups.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    shuffled = g_idx[torch.randperm(576, generator=torch.Generator().manual_seed(0))]
    perm, size, groups = packed.kernel_layout(shuffled, int4.GROUP_SIZES)
    assert torch.equal(shuffled[perm], g_idx) and size == 64


# ------------------------------------------------------------------ algorithms
def _layer_problem(seed: int, n: int = 64, k: int = 128, rows: int = 1024):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)   # correlated inputs, as real activations
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, :4] *= 20.0                                                  # a few outlier channels
    return w, x


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_lowers_the_layer_output_error_below_rtn(seed, act_order):
    w, x = _layer_problem(seed)
    err_rtn = qalgo.output_error(w, qalgo.rtn(w, 4, 32).dequantize(), x)
    err_gptq = qalgo.output_error(w, qalgo.gptq(w, x.t() @ x, 4, 32, act_order=act_order).dequantize(), x)
    assert err_gptq < 0.8 * err_rtn


def _textbook_gptq(w, h, bits, group_size, act_order, damp):
    """GPTQ as the paper writes it: the upper Cholesky factor U of the damped H^-1, one column at a
    time, its rounding error fed to the later columns through U's row; a group's grid drawn from the
    weights fed back so far at its first column (static groups: from the original weights)."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    hp = h[perm][:, perm].double()
    hp += damp * torch.diagonal(hp).mean() * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(hp), upper=True)
    cur = w[:, perm].double().clone()
    grids = {}
    if act_order or group_size == -1:
        grids = {g: qalgo.grid(w[:, s:e], bits, False) for g, (s, e) in enumerate(qalgo.group_bounds(k, group_size))}
    q = torch.zeros(n, k, dtype=torch.long)
    for j in range(k):
        g = int(perm[j]) // size
        if g not in grids:
            grids[g] = qalgo.grid(cur[:, j:j + size].float(), bits, False)
        scale, zero = grids[g]
        qc = qalgo.quantize_cols(cur[:, j:j + 1].float(), scale, zero, bits)[:, 0]
        q[:, perm[j]] = qc.long()
        err = (cur[:, j] - ((qc - zero) * scale).double()) / u[j, j]
        cur[:, j:] -= err[:, None] * u[j, j:][None, :]
    return q


@pytest.mark.parametrize("group,act_order", [(32, False), (64, True), (-1, False), (64, False)])
def test_gptq_equals_the_textbook_algorithm(group, act_order):
    """The blocked, factorization-only GPTQ (`qalgo._feedback`: no inverse Hessian, updates in
    sub-blocks) rounds as the column-by-column algorithm on the inverse's Cholesky factor does; K =
    200 gives a shorter last group at 64."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 200, generator=g)
    x = torch.randn(600, 200, generator=g) * (0.2 + 3 * torch.rand(200, generator=g))
    h = x.t() @ x
    got = qalgo.gptq(w, h, 4, group, act_order=act_order, damp=0.01).q
    want = _textbook_gptq(w, h, 4, group, act_order, 0.01)
    assert (got != want).float().mean() < 0.002  # a value on a rounding edge may fall either way


def test_blocked_input_products_equal_x_transposed_x(monkeypatch):
    monkeypatch.setattr(calib, "GRAM_BLOCK", 48)  # 130 inputs: blocks of 48, 48, 34
    st = calib.InputStats(130, want_xtx=True)
    xs = [torch.randn(n, 130) for n in (70, 5000, 33)]
    for x in xs:
        st.add(x)
    st.finish()
    x = torch.cat(xs)
    torch.testing.assert_close(st.xtx, x.t() @ x, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(st.sq, (x * x).sum(0))
    assert st.num_rows == x.shape[0]


@pytest.mark.parametrize("group", [32, 64, -1])
def test_search_helpers_equal_their_definitions(group):
    """The searches' vectorised RTN equals `rtn` (clipped or not, with a shorter last group), and
    the Hessian form of the output error equals the error on the rows themselves."""
    w, x = _layer_problem(0)
    w = torch.cat([w, w[:, :32]], dim=1)                              # K = 160: a partial last group at 64
    x = torch.cat([x, x[:, :32]], dim=1)
    groups = len(qalgo.group_bounds(w.shape[1], group))
    clip = 0.6 + 0.4 * torch.rand(w.shape[0], groups, generator=torch.Generator().manual_seed(1))
    for c in (None, clip):
        torch.testing.assert_close(qalgo.fake_quant(w, 4, group, c), qalgo.rtn(w, 4, group, clip=c).dequantize())
    w_hat = qalgo.rtn(w, 4, group).dequantize()
    assert qalgo.hessian_error(w, w_hat, x.t() @ x, x.shape[0]) == pytest.approx(qalgo.output_error(w, w_hat, x),
                                                                               rel=1e-4)


def _text(n: int, seed: int, vocab: int = 256, length: int = 64) -> list[torch.Tensor]:
    """Windows of a "text": Zipf-distributed tokens over a seeded permutation of the vocabulary, so
    two seeds are two texts with different frequent tokens, as two domains are."""
    g = torch.Generator().manual_seed(seed)
    weights, order = 1 / torch.arange(1, vocab + 1, dtype=torch.float), torch.randperm(vocab, generator=g)
    return [order[torch.multinomial(weights, length, replacement=True, generator=g)] for _ in range(n)]


@pytest.mark.parametrize("trial", [0, 1])
def test_gptq_beats_rtn_per_layer_on_a_text_it_was_not_calibrated_on(tiny_llama, trial):
    """Every linear layer's output error on held-out inputs (another text, walked through the same
    model) is below RTN's with the defaults: act-order, Hessian shrinkage, a mixed calibration."""
    model = load(tiny_llama).model
    cfg = quant.QuantizeConfig("gptq", group_size=32)
    mixed = _text(6, 10 + trial) + _text(5, 30 + trial) + _text(5, 40 + trial)   # three calibration sources
    walk, held = calib.LayerWalk(model, mixed), calib.LayerWalk(model, _text(16, 20 + trial))
    ratios = []
    for layer in model.model.layers:
        cal, out = walk.stats(layer, want_xtx=True), held.stats(layer, want_xtx=True)
        for name, lin in calib.linears(layer).items():
            w, h = lin.weight.data, out[name].xtx
            rtn = qalgo.hessian_error(w, qalgo.rtn(w, 4, 32).dequantize(), h, out[name].num_rows)
            q = qalgo.gptq(w, cal[name].xtx, 4, 32, act_order=cfg.uses_act_order, damp=cfg.damp, shrink=cfg.shrink)
            ratios.append(qalgo.hessian_error(w, q.dequantize(), h, out[name].num_rows) / rtn)
        walk.advance(layer)
        held.advance(layer)
    assert max(ratios) <= 1.0 and sum(ratios) / len(ratios) < 0.9, ratios


@pytest.mark.parametrize("seed", range(5))
def test_awq_scale_search_never_increases_the_loss_over_rtn(seed):
    w, x = _layer_problem(seed)
    if seed % 2:
        x = torch.randn_like(x)                                       # no outliers: scaling may not help
    s, loss_rtn, loss_awq = qalgo.awq_scales(w, x.t() @ x, x.abs().mean(0), x.shape[0], 4, 32)
    assert loss_awq <= loss_rtn
    assert loss_rtn == pytest.approx(qalgo.output_error(w, qalgo.rtn(w, 4, 32).dequantize(), x), rel=1e-4)
    assert loss_awq == pytest.approx(qalgo.output_error(w, qalgo.rtn(w * s, 4, 32).dequantize() / s, x), rel=1e-4)
    xs = x[:256] / s
    clip = qalgo.awq_clip(w * s, xs.t() @ xs, 4, 32)
    assert ((clip > 0.49) & (clip <= 1.0)).all()


# ------------------------------------------------------------------ checkpoints
def _quantize_to_dir(src: str, out: str, **cfg) -> tuple:
    loaded = load(src)
    qcfg = quant.QuantizeConfig(calib_samples=8, calib_seq_len=64, **cfg)
    results = quant.quantize_model(loaded.model, qcfg, samples() if qcfg.calibrated else None, progress=False)
    tensors = export.float_tensors(loaded.model, skip=set(results))
    tensors.update(quant.checkpoint_tensors(loaded.model, results, qcfg))
    with export.atomic_output_dir(out) as tmp:
        export.write_checkpoint(tmp, loaded.arch, None, tensors, "float32", qcfg.hf_quantization_config())
    return loaded.model, qcfg


@pytest.mark.parametrize("cfg", [dict(method="awq", group_size=32), dict(method="gptq", group_size=32),
                                 dict(method="gptq", group_size=32, act_order=True),
                                 dict(method="gptq", group_size=64, allow_partial_groups=True),
                                 dict(method="rtn-int4", group_size=32), dict(method="rtn-int8")],
                         ids=["awq", "gptq", "gptq-act-order", "gptq-partial-groups", "rtn-int4", "rtn-int8"])
def test_quantized_checkpoint_loads_with_its_kernels_and_matches_dequantized_logits(tiny_model, tmp_path, cfg):
    fake_quant, qcfg = _quantize_to_dir(tiny_model, str(tmp_path / "q"), **cfg)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3))
    reference = logits(fake_quant, ids)                    # the float model holding the dequantized weights
    method = qcfg.hf_quantization_config()["quant_method"]
    dequantized = load(str(tmp_path / "q"), "none").model
    torch.testing.assert_close(logits(dequantized, ids), reference, rtol=1e-5, atol=1e-5)
    # 16-bit activations: this checks the integers the kernels serve, not the rounding of 8-bit
    # activations (the AVX2 default), whose cost RESULTS measures on the real model
    served = load(str(tmp_path / "q"), method, activation_bits=16).model
    kinds = {type(m.qweight) for n, m in served.named_modules() if isinstance(m, Linear) and "layers" in n}
    assert kinds == {int8.Int8Weight if qcfg.bits == 8 else int4.Int4Weight}   # the stored ints, on the kernels
    got = logits(served, ids)
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()    # bf16 activations in PyTorch's kernels
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_prequantized_format_must_match_the_flag(tiny_llama, tmp_path):
    _quantize_to_dir(tiny_llama, str(tmp_path / "g"), method="gptq", group_size=32)
    with pytest.raises(ValueError, match="needs a AWQ checkpoint"):
        load(str(tmp_path / "g"), "awq")
    with pytest.raises(ValueError, match="already GPTQ-quantized"):
        load(str(tmp_path / "g"), "int4")
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        load(tiny_llama, "gptq")


def test_awq_scales_fold_exactly_into_the_float_model(tiny_llama):
    """Before rounding, scaling W by s and dividing what precedes it by s changes nothing."""
    loaded = load(tiny_llama)
    ids = torch.randint(0, 256, (16,))
    before = logits(loaded.model, ids)
    layer = loaded.model.model.layers[0]
    s = torch.rand(loaded.arch.hidden_size) + 0.5
    layer.self_attn.qkv_proj.weight.data.mul_(s)
    quant._fold_into_norm(layer.input_layernorm, s, loaded.arch.norm_offset)
    torch.testing.assert_close(logits(loaded.model, ids), before, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ pruning
@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("sparsity", [0.25, 0.5, 0.7])
def test_unstructured_pruning_reaches_the_requested_sparsity(tiny_llama, method, sparsity):
    model = load(tiny_llama).model
    prune.prune_unstructured(model, method, sparsity, samples())
    for layer in model.model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            zeros = int((m.weight == 0).sum())
            if method == "magnitude":
                assert zeros == round(sparsity * m.weight.numel())
            else:  # Wanda compares within each output row
                assert ((m.weight == 0).sum(1) == round(sparsity * m.in_features)).all()


def test_two_four_pattern_holds(tiny_llama):
    model = load(tiny_llama).model
    prune.prune_unstructured(model, "2:4", 0.5, samples())
    w = model.model.layers[1].mlp.down_proj.weight
    assert ((w.view(w.shape[0], -1, 4) == 0).sum(-1) == 2).all()


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("method,sparsity,field,expect", [
    ("heads", "0.5", "num_attention_heads", 2), ("ffn", "0.34", "intermediate_size", 64),
    ("layers", "0.5", "num_hidden_layers", 1)])
def test_structured_pruning_makes_a_smaller_model_that_serves(tiny_llama_tok, calib_text, tmp_path, method,
                                                               sparsity, field, expect):
    out = tmp_path / method
    r = _cli("prune", "--model", tiny_llama_tok, "--method", method, "--sparsity", sparsity, "--calib", calib_text,
             "--calib-samples", "4", "--calib-seq-len", "64", "--output", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    report = json.loads((out / "compression.json").read_text())
    assert cfg[field] == expect and report["parameters"] < report["source_parameters"]
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", kv_cache_memory="64MiB")
    ours = {"num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
            "num_hidden_layers": "num_layers"}[field]
    assert getattr(llm.engine.arch, ours) == expect
    outs = llm.generate(["hello", "a b c"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


def test_pruned_model_serves_over_http(tiny_llama_tok, calib_text, tmp_path):
    import openai

    from test_server import start_server

    out = tmp_path / "ffn"
    r = _cli("prune", "--model", tiny_llama_tok, "--method", "ffn", "--sparsity", "0.34", "--calib", calib_text,
             "--calib-samples", "4", "--calib-seq-len", "64", "--output", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    proc, base = start_server("--model", str(out))
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        c = client.completions.create(model="smollm2", prompt="hello", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == 6
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------------------------------ distillation
def test_distillation_lowers_the_kl_and_resumes_exactly(tiny_llama, tmp_path, monkeypatch):
    teacher = load(tiny_llama).model
    arch, tensors, _ = prune.prune_structured(load(tiny_llama).model, "ffn", 0.34, samples())
    with export.atomic_output_dir(str(tmp_path / "student")) as tmp:
        export.write_checkpoint(tmp, arch, None, tensors, "float32")
    train = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(5)).tolist()
    cfg = distill.DistillConfig(steps=12, batch_size=2, seq_len=32, lr=1e-3, warmup_steps=1, save_every=5,
                                eval_every=0)

    straight = load(str(tmp_path / "student")).model
    held_out = samples(4, 32, seed=9)

    def kl(student) -> float:
        with torch.no_grad():
            return sum(float(distill._loss(teacher, student, ids, cfg)) for ids in held_out)

    before = kl(straight)
    history = distill.distill(teacher, straight, train, None, cfg, str(tmp_path / "w1"), progress=False)
    assert kl(straight) < 0.97 * before  # random teacher, random text: slow but steady

    resumed = load(str(tmp_path / "student")).model
    real_loss, calls = distill._loss, {"n": 0}

    def crash_in_step_eight(*a, **k):  # after the checkpoint of step 5
        calls["n"] += 1
        if calls["n"] > 7 * cfg.batch_size:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(distill, "_loss", crash_in_step_eight)
    with pytest.raises(KeyboardInterrupt):
        distill.distill(teacher, resumed, train, None, cfg, str(tmp_path / "w2"), progress=False)
    monkeypatch.setattr(distill, "_loss", real_loss)
    resumed = load(str(tmp_path / "student")).model                   # a fresh process would start like this
    history2 = distill.distill(teacher, resumed, train, None, cfg, str(tmp_path / "w2"), progress=False)
    assert [h["loss"] for h in history2] == [h["loss"] for h in history]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args,message", [
    (["quantize", "--method", "awq", "--calib", "/nonexistent.txt"], "not found"),
    (["quantize", "--method", "gptq", "--group-size", "64"], "does not divide the input dimension 96"),
    (["quantize", "--method", "rtn-int4", "--group-size", "48"], "--group-size must be one of"),
    (["quantize", "--method", "fp8"], "--method must be one of"),
    (["quantize", "--method", "gptq", "--hessian-shrink", "1"], "--hessian-shrink must lie in [0, 1)"),
    (["quantize", "--method", "awq", "--act-order"], "it does not apply to awq"),
    (["quantize", "--method", "gptq", "--awq-clip"], "it does not apply to gptq"),
    (["quantize", "--method", "rtn-int4", "--output-format", "gguf"], "not one"),
    (["prune", "--method", "wanda", "--sparsity", "1.0"], "strictly between 0 and 1"),
    (["prune", "--method", "magnitude", "--sparsity", "0"], "strictly between 0 and 1"),
    (["prune", "--method", "2:4", "--sparsity", "0.3"], "exactly half"),
    (["prune", "--method", "layers", "--sparsity", "0.1"], "removes 0 of 2 layers"),
    (["distill", "--student", "SELF", "--steps", "0"], "--steps >= 1"),
])
def test_commands_refuse_bad_input_and_write_nothing(tiny_llama_tok, calib_text, tmp_path, args, message):
    out = tmp_path / "out"
    args = [a.replace("SELF", tiny_llama_tok) for a in args]
    model_flag = ["--teacher", tiny_llama_tok] if args[0] == "distill" else ["--model", tiny_llama_tok]
    calib_flag = [] if "--calib" in args else (["--data", calib_text] if args[0] == "distill" else ["--calib", calib_text])
    r = _cli(*args, *model_flag, *calib_flag, "--output", str(out), "--quiet")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


def test_calibration_mixes_sources_and_renders_chats_with_the_template(default_model, tmp_path):
    from tokenmill.models.gguf_loader import GGUFFile
    from tokenmill.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(default_model).meta)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"turns": ["Write a haiku.", "Now in French."]}) + "\n\n" + json.dumps({"messages": chat}))
    render = lambda m, gen: tok.encode_chat(m, add_generation_prompt=gen, split_special_tokens=False)  # noqa: E731
    want = render([{"role": "user", "content": "Write a haiku."}], True) + \
        render([{"role": "user", "content": "Now in French."}], True) + render(chat, False)
    ids = calib.source_tokens(tok, str(path))
    assert ids == want and tok.encode("<|im_start|>", add_special_tokens=False)[0] in ids  # the control token itself
    windows = calib.mixed_windows([list(range(1000)), list(range(1000, 2000)), list(range(2000, 3000))], 8, 16)
    assert [int(w[0]) // 1000 for w in windows] == [0, 0, 0, 1, 1, 1, 2, 2] and all(len(w) == 16 for w in windows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["a"]}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        calib.required_sources([str(bad)], "--calib", "for gptq")
    with pytest.raises(ValueError, match="--calib FILE is required"):
        calib.required_sources(None, "--calib", "for gptq")


def test_unsupported_architecture_is_refused(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    r = _cli("quantize", "--model", str(d), "--method", "rtn-int8", "--output", str(tmp_path / "out"))
    assert r.returncode == 2 and "Unsupported model architecture 'GPT2LMHeadModel'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_failure_mid_write_leaves_no_directory(tmp_path):
    with pytest.raises(RuntimeError):
        with export.atomic_output_dir(str(tmp_path / "out")) as tmp:
            (open(os.path.join(tmp, "model.safetensors"), "w")).close()
            raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == []
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        export.check_output_dir(str(tmp_path / "taken"))


def test_quantize_command_end_to_end(tiny_llama_tok, calib_text, tmp_path):
    out = tmp_path / "awq"
    r = _cli("quantize", "--model", tiny_llama_tok, "--method", "awq", "--group-size", "32", "--calib", calib_text,
             "--calib-samples", "4", "--calib-seq-len", "64", "--output", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": None}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.q_proj.qweight", "model.layers.0.self_attn.q_proj.qzeros",
            "model.layers.0.self_attn.q_proj.scales", "model.layers.1.mlp.down_proj.qweight"} <= names
    assert not any(n.endswith("proj.weight") for n in names if ".layers." in n)
    r = _cli("eval", "ppl", "--model", str(out), "--data", calib_text, "--max-tokens", "600", "--context-len", "128",
             "--stride", "64")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["perplexity"] > 1
