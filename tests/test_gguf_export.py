"""`quantize` from GGUF sources: with `--output-format gguf` the file gguf-py reads holds Q4_1 (or
Q8_0) blocks equal to the chosen integers, the untouched tensors byte for byte, and it loads back
in tokenmill with the logits of the safetensors checkpoint the same run writes; and a model streams
through quantization a layer at a time, its peak memory far below its float32 size (a child process)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch

from conftest import finish_gguf, llama_gguf_writer, llama_layout
from tokenmill.cli import build_parser
from tokenmill.compress import commands
from tokenmill.models import loader
from tokenmill.models.gguf_loader import GGUFFile, _unpermute

CPU = torch.device("cpu")
S = dict(hidden=64, layers=2, heads=4, kv_heads=2, ff=128, vocab=512)


def write_llama(path, s: dict, default_model: str, layer_kind: str = "F32") -> str:
    """A random Llama-shaped GGUF (the default model's tokens as its vocabulary): F16 embedding,
    `layer_kind` layers, a Q8_0 output head."""
    rng = np.random.default_rng(0)
    w = llama_gguf_writer(path, s, default_model, context_length=512)
    layout = llama_layout(s, "F16", layer_kind, "Q8_0")
    data = []
    for name, shape, kind in layout:
        if name.endswith("norm.weight"):
            data.append((1 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
        elif kind == "Q8_0":
            data.append(gguf.quants.quantize((0.1 * rng.standard_normal(shape)).astype(np.float32),
                                             gguf.GGMLQuantizationType.Q8_0))
        else:
            data.append((0.1 * rng.standard_normal(shape)).astype(np.float16 if kind == "F16" else np.float32))
    finish_gguf(w, layout, data)
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_model) -> str:
    return write_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", S, default_model)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    words = np.random.default_rng(1).choice(["alpha", "beta", "gamma", "delta", "the", "a", "of", "run", "(x)"], 4000)
    path.write_text(" ".join(words), encoding="utf-8")
    return str(path)


def quantize(*argv: str) -> dict:
    args = build_parser().parse_args(["quantize", "--quiet", "--calib-samples", "4", "--calib-seq-len", "64", *argv])
    return commands.run_quantize(args)


def logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    model = loader.load(path, "float32", CPU, load_tokenizer=False, quantization="none").model
    return model.compute_logits(model(ids, torch.arange(ids.numel())))


@pytest.mark.parametrize("argv,kind", [(["--method", "rtn-int4", "--group-size", "32"], "Q4_1"),
                                       (["--method", "gptq", "--group-size", "64", "--act-order"], "Q4_1"),
                                       (["--method", "awq", "--group-size", "32"], "Q4_1"),
                                       (["--method", "rtn-int8"], "Q8_0")],
                         ids=["rtn-g32", "gptq-g64-act-order", "awq-g32", "rtn-int8"])
def test_gguf_output_holds_the_checkpoints_integers(tiny_gguf, calib_file, tmp_path, argv, kind):
    out, ref = str(tmp_path / "q.gguf"), str(tmp_path / "q")
    common = ["--model", tiny_gguf, "--calib", calib_file, *argv]
    quantize(*common, "--output", ref, "--dtype", "float32")
    report = quantize(*common, "--output", out, "--output-format", "gguf")
    assert report["output_format"] == "gguf"

    r, src = gguf.GGUFReader(out), gguf.GGUFReader(tiny_gguf)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert {types[n] for n in types if n.startswith("blk.") and not n.endswith("norm.weight")} == {kind}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    by_name = {t.name: t for t in r.tensors}
    for t in src.tensors:
        if t.name in ("token_embd.weight", "output.weight"):   # not quantized: copied byte for byte
            assert types[t.name] == t.tensor_type.name and np.array_equal(by_name[t.name].data, t.data)
    assert r.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()

    # gguf-py's own dequantization of the blocks equals the checkpoint's integers (Q/K rows back in HF order)
    back = loader.load(ref, "float32", CPU, load_tokenizer=False, quantization="none").model
    t = by_name["blk.1.attn_q.weight"]
    got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(S["hidden"], S["hidden"]).copy())
    want = back.model.layers[1].self_attn.qkv_proj.weight.data[:S["hidden"]]
    torch.testing.assert_close(_unpermute(got, S["heads"]), want, rtol=0, atol=2e-3 * float(want.abs().max()))

    ids = torch.randint(0, S["vocab"], (32,), generator=torch.Generator().manual_seed(0))
    got, want = logits(out, ids), logits(ref, ids)   # apart only by the float16 rounding of each block's m
    assert (got - want).abs().max() < 0.01 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9   # a random model has near-ties
    assert GGUFFile(out).architecture == "llama"


def test_gguf_output_refusals(tiny_gguf, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="GGUF source"):
        quantize("--model", tiny_llama, "--method", "rtn-int4", "--group-size", "32",
                 "--output", str(tmp_path / "a.gguf"), "--output-format", "gguf")
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"x")
    with pytest.raises(ValueError, match="exists"):
        quantize("--model", tiny_gguf, "--method", "rtn-int4", "--group-size", "32",
                 "--output", str(taken), "--output-format", "gguf")
    assert taken.read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.gguf"]   # nothing half-written left behind


def test_quantization_streams_a_layer_at_a_time(default_model, tmp_path):
    """12 layers of 64 MB each in float32 (768 MB; the file holds them as F16): quantizing holds one
    layer in float at a time, so the child's peak grows by far less than the float model."""
    shape = dict(hidden=1024, layers=12, heads=16, kv_heads=4, ff=4096, vocab=512)
    src = write_llama(tmp_path / "model.gguf", shape, default_model, layer_kind="F16")
    float_bytes = shape["layers"] * (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 1024 * 4096) * 4
    code = textwrap.dedent(f"""
        import json
        from tokenmill.cli import build_parser
        from tokenmill.compress import commands
        hwm = lambda: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
        base = hwm()
        args = build_parser().parse_args(["quantize", "--model", {src!r}, "--method", "rtn-int4", "--group-size", "128",
                                          "--output", {str(tmp_path / "q")!r}, "--quiet"])
        report = commands.run_quantize(args)
        print(json.dumps({{"base": base, "peak": hwm(), "report": report}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    grown = out["report"]["peak_rss_gb"] * 2 ** 30 - out["base"]   # the peak before the output is loaded back
    assert grown < 0.6 * float_bytes, (grown, float_bytes)   # measured 0.40 GB of 0.73 (a whole-model load: > 1.0)
    assert out["report"]["seconds_per_layer"] > 0 and out["report"]["peak_rss_gb"] > 0
