"""`quantize --output-format gguf` on a tiny random Llama GGUF: the file gguf-py reads holds Q4_1
(or Q8_0) blocks equal to the chosen integers, the untouched tensors byte for byte, and it loads
back in tokenmill with the logits of the safetensors checkpoint the same run writes."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.cli import build_parser
from tokenmill.compress import commands
from tokenmill.models import loader
from tokenmill.models.gguf_loader import GGUFFile, _unpermute

CPU = torch.device("cpu")
S = dict(hidden=64, layers=2, heads=4, kv_heads=2, ff=128, vocab=512)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_model) -> str:
    s, rng = S, np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    src = gguf.GGUFReader(default_model)
    get = lambda k: src.fields[k].contents()  # noqa: E731
    w = gguf.GGUFWriter(str(path), "llama")
    for fn, v in ((w.add_context_length, 512), (w.add_embedding_length, s["hidden"]), (w.add_block_count, s["layers"]),
                  (w.add_feed_forward_length, s["ff"]), (w.add_head_count, s["heads"]),
                  (w.add_head_count_kv, s["kv_heads"]), (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, s["vocab"])):
        fn(v)
    tokens = list(get("tokenizer.ggml.tokens"))[:s["vocab"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(list(get("tokenizer.ggml.token_type"))[:s["vocab"]])
    known = set(tokens)
    w.add_token_merges([m for m in get("tokenizer.ggml.merges") if "".join(m.split(" ")) in known])
    w.add_eos_token_id(2)
    h, kv = s["hidden"], s["hidden"] // s["heads"] * s["kv_heads"]
    layout = [("token_embd.weight", (s["vocab"], h), "F16")]
    for i in range(s["layers"]):
        layout += [(f"blk.{i}.attn_norm.weight", (h,), "F32"), (f"blk.{i}.attn_q.weight", (h, h), "F32"),
                   (f"blk.{i}.attn_k.weight", (kv, h), "F32"), (f"blk.{i}.attn_v.weight", (kv, h), "F32"),
                   (f"blk.{i}.attn_output.weight", (h, h), "F32"), (f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                   (f"blk.{i}.ffn_gate.weight", (s["ff"], h), "F32"), (f"blk.{i}.ffn_up.weight", (s["ff"], h), "F32"),
                   (f"blk.{i}.ffn_down.weight", (h, s["ff"]), "F32")]
    layout += [("output_norm.weight", (h,), "F32"), ("output.weight", (s["vocab"], h), "Q8_0")]
    data = []
    for name, shape, kind in layout:
        if name.endswith("norm.weight"):
            data.append((1 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
        elif kind == "Q8_0":
            data.append(gguf.quants.quantize((0.1 * rng.standard_normal(shape)).astype(np.float32),
                                             gguf.GGMLQuantizationType.Q8_0))
        else:
            data.append((0.1 * rng.standard_normal(shape)).astype(np.float16 if kind == "F16" else np.float32))
    for (name, shape, kind), d in zip(layout, data):
        w.add_tensor_info(name, d.shape, d.dtype, d.nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for d in data:
        w.write_tensor_data(d)
    w.close()
    return str(path)


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
