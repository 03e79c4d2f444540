"""Loading without a float copy of the model: GGUF tensors read a run of rows at a time
(quant/gguf_tensor.py) equal gguf-py's dequantization, slice like the tensors they stand for, and a
model of a few hundred MB loads and serves within the file's bytes x 1.15 + KV cache + 0.5 GB."""
import json
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch

from conftest import finish_gguf, llama_gguf_writer, llama_layout
from tokenmill.quant import gguf_tensor, int8


def _write_tensors(path, tensors: dict[str, np.ndarray], kinds: dict[str, str]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, data in tensors.items():
        qtype = gguf.GGMLQuantizationType[kinds[name]]
        w.add_tensor(name, gguf.quants.quantize(data, qtype) if kinds[name] != "F32" else data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    data = {k: rng.standard_normal((96, 256)).astype(np.float32) for k in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "F32")}
    path = tmp_path_factory.mktemp("g") / "blocks.gguf"
    _write_tensors(path, {f"t.{k}": v for k, v in data.items()}, {f"t.{k}": k for k in data})
    reader = gguf.GGUFReader(str(path))
    return path, {t.name: t for t in reader.tensors}


def _open(path, t) -> gguf_tensor.BlockTensor:
    shape = tuple(int(d) for d in reversed(t.shape))
    return gguf_tensor.open_tensor(str(path), int(t.data_offset), t.tensor_type.name, shape, t.name)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_block_tensor_reads_what_gguf_dequantizes(blocks_file, kind):
    path, tensors = blocks_file
    t = tensors[f"t.{kind}"]
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(96, 256).astype(np.float32))
    bt = _open(path, t)
    assert bt.shape == (96, 256) and bt.quantized
    assert torch.equal(bt.dequantize(), ref)
    q, scale = bt.int8_parts()  # what int8.quantize_rtn makes of the float, row for row
    rq, rs = int8.rtn_parts(ref)
    assert torch.equal(q, rq) and torch.equal(scale, rs)
    parts = bt.int4_parts()
    if kind in ("Q4_0", "Q4_1"):
        from tokenmill.quant import int4
        assert torch.equal(int4.dequantize(*parts), ref)
    else:
        assert parts is None
    # rows, block-aligned columns (a view of the file) and columns inside a block (the float slice)
    assert torch.equal(bt[8:40].dequantize(), ref[8:40])
    assert isinstance(bt[:, 64:192], gguf_tensor.BlockTensor) and torch.equal(bt[:, 64:192].dequantize(), ref[:, 64:192])
    assert torch.equal(bt[:, 16:48], ref[:, 16:48])
    order = np.random.default_rng(1).permutation(96)
    assert torch.equal(bt.permute_rows(order).dequantize(), ref[order])
    assert torch.equal(bt.permute_rows(order)[10:20][:, 32:64].dequantize(), ref[order][10:20, 32:64])


def test_block_tensor_in_small_chunks_reads_the_same(blocks_file, monkeypatch):
    path, tensors = blocks_file
    t = tensors["t.Q8_0"]
    whole = _open(path, t).dequantize()
    monkeypatch.setattr(gguf_tensor, "CHUNK_BYTES", 3 * 256 * 4)  # three rows per read
    assert torch.equal(_open(path, t).dequantize(), whole)
    assert torch.equal(_open(path, t).int8_parts()[0], int8.rtn_parts(whole)[0])


def test_truncated_file_is_a_clear_error(blocks_file, tmp_path):
    path, tensors = blocks_file
    cut = tmp_path / "cut.gguf"
    raw = path.read_bytes()
    cut.write_bytes(raw[:int(tensors["t.Q8_0"].data_offset) + 100])
    bt = _open(cut, tensors["t.Q8_0"])
    with pytest.raises(ValueError, match="truncated"):
        bt.dequantize()


# A Llama-shaped file of ~200 MB: Q4_0 layers, Q8_0 embedding and output, written from random
# block bytes (the values do not matter for memory, and random bytes cost nothing to make)
SHAPE = dict(hidden=1024, layers=12, heads=16, kv_heads=4, ff=4096, vocab=32000)


def _random_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)  # every block's scale d
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory, default_model):
    s, rng = SHAPE, np.random.default_rng(0)
    path = tmp_path_factory.mktemp("big") / "llama-q4_0.gguf"
    w = llama_gguf_writer(path, s, default_model)
    layout = llama_layout(s, "Q8_0", "Q4_0", "Q8_0")
    data = [np.ones(shape, np.float32) if kind == "F32" else _random_blocks(rng, *shape, kind) for _, shape, kind in layout]
    finish_gguf(w, layout, data)
    return str(path), sum(d.nbytes for d in data)


def test_a_few_hundred_mb_model_loads_within_its_bytes(llama_file):
    """A child process (its own peak): load, answer, report its peak RSS; the bound is the file's tensor
    bytes x 1.15 + KV cache + 0.5 GB (torch's own ~0.3 GB included)."""
    path, tensor_bytes = llama_file
    kv = 64 << 20
    # the peak is reset (clear_refs 5) once torch is imported and the kernels are loaded (built, if
    # this is their first use): what is measured is the load and the answer
    code = textwrap.dedent(f"""
        import json
        from tokenmill import LLM, SamplingParams, kernels
        kernels.available()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        llm = LLM(model={path!r}, kv_cache_memory={kv})
        out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, ignore_eos=True))
        hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
        print(json.dumps({{"peak": hwm * 1024, "tokens": len(out[0].outputs[0].token_ids)}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 4
    bound = tensor_bytes * 1.15 + kv + (512 << 20)
    print(f"peak RSS {got['peak'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert got["peak"] <= bound, f"peak RSS {got['peak'] / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"
