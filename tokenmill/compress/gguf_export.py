"""`quantize --output-format gguf`: the quantized model as one GGUF file that llama.cpp (and so
Ollama) runs, with exactly the integers AWQ/GPTQ/RTN chose.

Every 4-bit group becomes Q4_1 blocks of 32 inputs, value = d * q + m with d = the group's scale
and m = -zero * scale: a group of 64/128/256 inputs is 2/4/8 blocks repeating its scale, so any
group size the int4 kernels run is expressed without re-rounding a weight (m is rounded to
float16, an error under 1 % of a quantization step). Per-channel symmetric int8 (rtn-int8)
becomes Q8_0 blocks repeating the row's scale. K-quant blocks are not used: their 6-bit sub-
block scales would re-round the chosen scales. (GPTQ's act-order keeps its groups contiguous,
qalgo.gptq, so it is expressed too.)

The metadata (architecture, tokenizer, chat template) and the tensors that were not quantized
(the embedding, an untied output head) are copied from the source GGUF byte for byte; norms and
biases come from the model, which AWQ's scale folding changed.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from tokenmill.compress.export import split_rows
from tokenmill.compress.qalgo import QuantizedWeight
from tokenmill.models.gguf_loader import GGUFFile, permute_rows
from tokenmill.models.llama import CausalLM

_COPIED_OVER = ("general.architecture", "general.file_type", "general.quantization_version")


def check_source(source: str) -> None:
    """Refuse before any work what cannot become a GGUF."""
    from tokenmill.models.gguf_loader import is_gguf

    if not is_gguf(source):
        raise ValueError("--output-format gguf copies the tokenizer and metadata from a GGUF source; "
                         f"{source} is not one (convert it with llama.cpp's convert_hf_to_gguf.py first, "
                         "or write the default safetensors checkpoint).")


def q4_1_blocks(qw: QuantizedWeight) -> np.ndarray:
    """(rows, cols / 32 * 20) bytes: per block float16 d, float16 m, then 16 bytes whose low
    nibbles are the block's first 16 values and high nibbles its last 16 (llama.cpp's order)."""
    n, k = qw.q.shape
    first = qw.g_idx.view(-1, 32)
    if k % 32 or not bool((first == first[:, :1]).all()):
        raise ValueError("a group does not cover whole blocks of 32 inputs; GGUF Q4_1 cannot express it.")
    gb = first[:, 0]
    d = qw.scales[:, gb].half()
    m = (-qw.zeros[:, gb].float() * qw.scales[:, gb]).half()
    q = qw.q.to(torch.uint8).view(n, k // 32, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), m.view(torch.uint8).view(n, k // 32, 2), qs], dim=2)
    return out.reshape(n, -1).numpy()


def q8_0_blocks(qw: QuantizedWeight) -> np.ndarray:
    """(rows, cols / 32 * 34) bytes: per block float16 d, then 32 int8 values (value = d * q)."""
    n, k = qw.q.shape
    if k % 32 or qw.scales.shape[1] != 1 or not bool((qw.zeros == 128).all()):
        raise ValueError("Q8_0 holds symmetric per-row int8 weights over whole blocks of 32 inputs.")
    d = qw.scales[:, :1].half().expand(n, k // 32).contiguous()
    qs = (qw.q - 128).to(torch.int8).view(n, k // 32, 32).view(torch.uint8)
    return torch.cat([d.view(torch.uint8).view(n, k // 32, 2), qs], dim=2).reshape(n, -1).numpy()


class GGUFBlocks:
    """The quantized layers' blocks, collected a layer at a time as `quantize` finishes each
    (`add`), then written with everything else the source file holds (`write`)."""

    def __init__(self, model: CausalLM) -> None:
        self.modules = dict(model.named_modules())
        self.blocks: dict[str, tuple[torch.Tensor, int]] = {}
        self.biases: dict[str, torch.Tensor] = {}

    def add(self, results: dict[str, QuantizedWeight]) -> None:
        import gguf

        for name, qw in results.items():
            if qw.bits == 4:
                data, kind = torch.from_numpy(q4_1_blocks(qw)), gguf.GGMLQuantizationType.Q4_1
            else:
                data, kind = torch.from_numpy(q8_0_blocks(qw)), gguf.GGMLQuantizationType.Q8_0
            m = self.modules[name]
            for shard, rows in split_rows(name, m, data).items():
                self.blocks[f"{shard}.weight"] = (rows, kind)
            if m.bias is not None:
                self.biases.update((f"{shard}.bias", rows.clone())
                                   for shard, rows in split_rows(name, m, m.bias.data).items())

    def write(self, path: str, source: str, model: CausalLM, method: str) -> None:
        write_gguf(path, source, model, self.blocks, self.biases, method)


def write_gguf(path: str, source: str, model: CausalLM, blocks: dict, biases: dict, method: str) -> None:
    import gguf

    src = GGUFFile(source)
    reader = gguf.GGUFReader(source)
    heads = {"attn_q": model.cfg.num_heads, "attn_k": model.cfg.num_kv_heads}
    permute = src.architecture in ("llama", "mistral")
    params = dict(model.named_parameters())

    writer = gguf.GGUFWriter(path, src.architecture)
    for field in reader.fields.values():
        if field.name in _COPIED_OVER or field.name.startswith(("GGUF.", "quantize.")):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if method != "rtn-int8" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string("general.quantized_by", f"tokenmill quantize --method {method}")

    plan = []  # (name, array, raw type or None)
    for t in reader.tensors:
        hf = src.hf_name(t.name)
        part = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        if hf in blocks:
            data, kind = blocks[hf]
            if permute and part in heads:
                data = permute_rows(data, heads[part])
            plan.append((t.name, np.ascontiguousarray(data.numpy()), kind))
        elif hf in biases or (hf is not None and hf.endswith("norm.weight") and hf in params):
            value = (biases[hf] if hf in biases else params[hf].data).float()
            if permute and part in heads:
                value = permute_rows(value, heads[part])
            plan.append((t.name, value.numpy().copy(), None))
        else:
            if hf is not None and hf.startswith("model.layers.") and hf.endswith("proj.weight"):
                raise ValueError(f"{t.name} ({hf}) was not quantized; the GGUF would mix formats unasked.")
            plan.append((t.name, t.data, t.tensor_type))
    for name, data, kind in plan:
        if kind is None:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
        else:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in plan:
        writer.write_tensor_data(data)
    writer.close()
    if not os.path.getsize(path):
        raise ValueError(f"writing {path} failed.")
