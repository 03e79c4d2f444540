"""Model sources: a Hugging Face directory or a single GGUF file -> (CausalLM, Tokenizer).

The format is recognised from the files themselves (GGUF magic, `config.json`), never from a
file name. Weights stream tensor by tensor into a model built on the target device and dtype.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator

import torch

from tokenmill import kernels
from tokenmill.layers.linear import PREQUANTIZED, QUANT_POLICIES
from tokenmill.models import hf_quant
from tokenmill.models.arch import ArchConfig
from tokenmill.models.gguf_loader import GGUFFile, is_gguf
from tokenmill.models.llama import CausalLM, load_weights
from tokenmill.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ArchConfig
    tokenizer: Tokenizer | None
    activation_bits: int = 16  # what the CPU int kernels round inputs to, "auto" resolved


def load(path: str, dtype: str, device: torch.device, load_tokenizer: bool = True,
         quantization: str = "auto", group_size: int = 32, keep_float: bool = False,
         activation_bits: int | str = "auto", tp_group=None) -> LoadedModel:
    """`tp_group`: this process is one rank of a tensor-parallel group (distributed/tensor_parallel
    TPGroup): the model built is the rank's shard, each tensor sliced as it is read.
    `quantization`: auto (GGUF 4-bit blocks -> int4, other block types -> int8; float
    checkpoints stay float), none, int8, int4 — see `Linear.quantize`. The int kernels run on
    CPU; on other devices weights stay in the model dtype. `activation_bits`: see ModelConfig."""
    if quantization not in QUANT_POLICIES:
        raise ValueError(f"quantization must be one of {list(QUANT_POLICIES)}, got {quantization!r}.")
    if activation_bits != "auto" and activation_bits not in kernels.ACT_BITS:
        raise ValueError(f"activation_bits must be auto, 8 or 16, got {activation_bits!r}.")
    loaded = _load(path, dtype, device, load_tokenizer, quantization, tp_group)
    if device.type != "cpu":
        quantization = "none"
    if activation_bits == "auto":
        activation_bits = kernels.auto_activation_bits() if device.type == "cpu" and kernels.available() else 16
    loaded.model.quantize(quantization, group_size, keep_float, activation_bits)
    loaded.activation_bits = activation_bits
    return loaded


def _load(path: str, dtype: str, device: torch.device, load_tokenizer: bool, quantization: str,
          tp_group=None) -> LoadedModel:
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist.")
    if os.path.isfile(path):
        if not is_gguf(path):
            raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory.")
        _refuse_prequant(quantization, None, path)
        return _load_gguf(path, dtype, device, load_tokenizer, tp_group)
    if not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            _refuse_prequant(quantization, None, path)
            return _load_gguf(ggufs[0], dtype, device, load_tokenizer, tp_group)
        raise ValueError(f"{path} has no config.json (and not exactly one .gguf file); "
                         "point --model at a Hugging Face model directory or a .gguf file.")
    return _load_hf(path, dtype, device, load_tokenizer, quantization, tp_group)


def _refuse_prequant(quantization: str, found: str | None, path: str) -> None:
    """`quantization="awq"/"gptq"` names the checkpoint's format; it must be what the files hold,
    and a pre-quantized checkpoint is not re-quantized by another method."""
    if quantization in PREQUANTIZED and quantization != found:
        raise ValueError(f"quantization={quantization!r} needs a {quantization.upper()} checkpoint (config.json "
                         f"with quantization_config.quant_method={quantization!r}); {path} is "
                         f"{'a ' + found.upper() + ' checkpoint' if found else 'not one'}.")
    if found and quantization in ("int8", "int4"):
        raise ValueError(f"{path} is already {found.upper()}-quantized; load it with quantization='auto' or "
                         f"{found!r} (or 'none' for its dequantized float weights), not {quantization!r}.")


def resolve_dtype(dtype: str, source: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype on CUDA; float32 on CPU, where bf16/fp16 GEMMs are slow
    without AVX512-BF16/AMX (measured ~100x slower here)."""
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return source if source in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}.")
    return table[dtype]


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


def check_declared_sizes(arch: ArchConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """The sizes a config or GGUF header declares must be those of the tensors the file holds,
    before the model is allocated: a corrupt or hostile file declaring a million layers or a
    hidden size of 2^20 over a few kilobytes of tensors would otherwise allocate (or build for
    minutes) the model it declares. Names without an expected shape (quantized layouts) are
    checked for their layer index only."""
    h, hd, ff = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    per_layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * ff, h),
                 "self_attn.q_norm.weight": (q,) if arch.qk_norm_full else (hd,),
                 "self_attn.k_norm.weight": (kv,) if arch.qk_norm_full else (hd,),
                 "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
    top = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,),
           "lm_head.weight": (arch.vocab_size, h)}
    layers = set()
    for name, shape in shapes.items():
        m = _LAYER.match(name)
        if m:
            layers.add(int(m.group(1)))
        want = per_layer.get(m.group(2)) if m else top.get(name)
        if want is not None and tuple(shape) != want:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(shape)} but the model's configuration "
                             f"declares {want}; the file is corrupt or its configuration belongs to another model.")
    if layers != set(range(arch.num_layers)):
        raise ValueError(f"{source} declares {arch.num_layers} layers but holds tensors for {len(layers)}; the "
                         f"file is corrupt or incomplete, or its configuration belongs to another model.")


def _build(arch: ArchConfig, dtype: torch.dtype, device: torch.device, weights: Iterator, tp_group=None) -> CausalLM:
    tp = None
    if tp_group is not None:
        from tokenmill.distributed.tensor_parallel import ShardPlan
        tp = (ShardPlan.for_rank(arch, tp_group.rank, tp_group.size), tp_group)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(arch, tp)
    finally:
        torch.set_default_dtype(prev)
    load_weights(model, weights)
    return model.eval()


def _load_hf(path: str, dtype: str, device: torch.device, load_tokenizer: bool, quantization: str,
             tp_group=None) -> LoadedModel:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}/config.json is not valid JSON: {e}") from None
    arch = ArchConfig.from_hf(cfg)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not loaded: "
                         "they can execute code; convert them to safetensors).")
    src = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(cfg.get("torch_dtype") or cfg.get("dtype"),
                                                                       torch.float32)
    check_declared_sizes(arch, _safetensors_shapes(files), path)
    weights = _safetensors_weights(files)
    qcfg = cfg.get("quantization_config")
    prequant = hf_quant.PrequantConfig.from_hf(qcfg) if qcfg else None
    _refuse_prequant(quantization, prequant.method if prequant else None, path)
    if prequant is not None:
        weights = hf_quant.convert(weights, prequant)
    model = _build(arch, resolve_dtype(dtype, src, device), device, weights, tp_group)
    tok = Tokenizer.from_hf_dir(path) if load_tokenizer else None
    return LoadedModel(model, arch, tok)


def _safetensors_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers only."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from None
    return shapes


def _safetensors_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from safetensors import SafetensorError

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from None


def _load_gguf(path: str, dtype: str, device: torch.device, load_tokenizer: bool, tp_group=None) -> LoadedModel:
    g = GGUFFile(path)
    arch = ArchConfig.from_gguf(g.meta, g.vocab_size(), has_output="output.weight" in g.tensors,
                                rope_factors=g.rope_factors(), dense_layers=g.dense_layers())
    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor; the file is incomplete.")
    check_declared_sizes(arch, g.hf_shapes(), path)
    model = _build(arch, resolve_dtype(dtype, torch.float32, device), device,
                   g.hf_weights(arch.num_heads, arch.num_kv_heads), tp_group)
    tok = Tokenizer.from_gguf(g.meta) if load_tokenizer else None
    return LoadedModel(model, arch, tok)
