"""Model sources: a Hugging Face directory or a single GGUF file -> (CausalLM, Tokenizer).

The format is recognised from the files themselves (GGUF magic, `config.json`), never from a
file name. Weights stream tensor by tensor into a model built on the target device and dtype
without its weights: each linear layer is packed into its kernel form as soon as its tensors are
in, so no float copy of the model exists. Before that, what the weights and the KV cache will
take is checked against the memory this process may use (`resources.check_fits`).
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator

import torch

from tokenmill import kernels, resources
from tokenmill.layers.linear import deferred_weights
from tokenmill.models import hf_quant
from tokenmill.models import weight_cache as weight_cache_mod
from tokenmill.models.arch import ArchConfig
from tokenmill.models.gguf_loader import GGUFFile, is_gguf
from tokenmill.models.llama import CausalLM, load_weights
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.quant.assembly import PREQUANTIZED, QUANT_POLICIES, packed_bytes


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ArchConfig
    tokenizer: Tokenizer | None
    activation_bits: int = 16  # what the CPU int kernels round inputs to, "auto" resolved
    from_cache: bool = False   # the packed model was mapped from the weight cache


@dataclass(frozen=True)
class _Plan:
    """How the weights are packed as they load (`CausalLM.stream_quantized`), and the bytes of
    memory to keep free beside them (the KV cache) when checking that the model fits."""
    policy: str
    group_size: int
    keep_float: bool
    activation_bits: int
    reserve_bytes: int
    cache: weight_cache_mod.Entry | None = None


def load(path: str, dtype: str, device: torch.device, load_tokenizer: bool = True,
         quantization: str = "auto", group_size: int = 32, keep_float: bool = False,
         activation_bits: int | str = "auto", tp_group=None, reserve_bytes: int = 0,
         weight_cache: str = "off") -> LoadedModel:
    """`tp_group`: this process is one rank of a tensor-parallel group (distributed/tensor_parallel
    TPGroup): the model built is the rank's shard, each tensor sliced as it is read.
    `quantization`: auto (GGUF 4-bit blocks -> int4, other block types -> int8; float
    checkpoints stay float), none, int8, int4 — see `Linear.quantize`. The int kernels run on
    CPU; on other devices weights stay in the model dtype. `activation_bits`: see ModelConfig.
    `reserve_bytes`: memory the caller will allocate next to the weights (its KV cache): a CPU
    model is refused before loading when weights and reserve exceed what this process may use.
    `weight_cache`: off, auto (the default directory, models of WEIGHT_CACHE_MIN_BYTES or more) or a
    directory: the packed CPU model is kept there and mapped on later loads (models/weight_cache)."""
    if quantization not in QUANT_POLICIES:
        raise ValueError(f"quantization must be one of {list(QUANT_POLICIES)}, got {quantization!r}.")
    if activation_bits != "auto" and activation_bits not in kernels.ACT_BITS:
        raise ValueError(f"activation_bits must be auto, 8 or 16, got {activation_bits!r}.")
    kind, files = _resolve(path)  # before anything slow (the kernels' first build)
    policy = quantization if device.type == "cpu" else "none"
    if activation_bits == "auto":
        activation_bits = kernels.auto_activation_bits() if device.type == "cpu" and kernels.available() else 16
    cache = None
    if weight_cache != "off" and device.type == "cpu" and tp_group is None:
        cache_dir = weight_cache_mod.default_dir() if weight_cache == "auto" else weight_cache
        settings = {"plan": [policy, group_size, keep_float, activation_bits], "isa": kernels.isa(),
                    "dtype": str(resolve_dtype(dtype, torch.float32, device)), "lanes": kernels.LANES}
        cache = weight_cache_mod.Entry(cache_dir, files, settings)
    plan = _Plan(policy, group_size, keep_float, activation_bits, reserve_bytes, cache)
    with resources.returning_freed_memory():
        loaded = _load(path, kind, files, dtype, device, load_tokenizer, quantization, tp_group, plan)
        if not loaded.from_cache:
            loaded.model.quantize(policy, group_size, keep_float, activation_bits)
            if cache is not None:
                cache.write_later(loaded.model, weight_cache_mod.WEIGHT_CACHE_MIN_BYTES if weight_cache == "auto" else 0)
    loaded.activation_bits = activation_bits
    return loaded


def _resolve(path: str) -> tuple[str, list[str]]:
    """("gguf", [the file]) or ("hf", [config.json, *safetensors]): what a model path is and the
    files it is read from (the weight cache's key), or a ValueError saying what the path lacks."""
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist.")
    if os.path.isfile(path):
        if not is_gguf(path):
            raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory.")
        return "gguf", [path]
    if not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return "gguf", ggufs
        raise ValueError(f"{path} has no config.json (and not exactly one .gguf file); "
                         "point --model at a Hugging Face model directory or a .gguf file.")
    return "hf", [os.path.join(path, "config.json"), *sorted(glob.glob(os.path.join(path, "*.safetensors")))]


def _load(path: str, kind: str, files: list[str], dtype: str, device: torch.device, load_tokenizer: bool,
          quantization: str, tp_group, plan: _Plan) -> LoadedModel:
    if kind == "gguf":
        _refuse_prequant(quantization, None, path)
        return _load_gguf(files[0], dtype, device, load_tokenizer, tp_group, plan)
    return _load_hf(path, dtype, device, load_tokenizer, quantization, tp_group, plan)


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
    without AVX512-BF16/AMX (orders of magnitude slower than float32)."""
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


def _build(arch: ArchConfig, dtype: torch.dtype, device: torch.device, weights: Iterator, tp_group,
           plan: _Plan) -> CausalLM:
    tp = None
    if tp_group is not None:
        from tokenmill.layers.tensor_parallel import ShardPlan
        tp = (ShardPlan.for_rank(arch, tp_group.rank, tp_group.size), tp_group)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), deferred_weights():
            model = CausalLM(arch, tp)
    finally:
        torch.set_default_dtype(prev)
    model.stream_quantized(plan.policy, plan.group_size, plan.keep_float, plan.activation_bits)
    load_weights(model, weights)
    return model.eval()


def _check_fits(source: str, tensors: list[tuple[str, int, str]], arch: ArchConfig, plan: _Plan, device: torch.device,
                tp_group) -> None:
    """`tensors`: (hf name, elements, kind) with kind float, q4 (4-bit blocks kept as int4) or
    another quantized form (`quant.assembly.packed_bytes`, which follows the packing's decisions;
    the embedding keeps its own blocks).
    Tensor-parallel ranks share the host: rank 0 checks the whole model."""
    if device.type != "cpu" or (tp_group is not None and tp_group.rank != 0):
        return
    weights = 0
    quantize = plan.policy != "none"
    for name, n, kind in tensors:
        if name == "model.embed_tokens.weight":
            weights += n * (0.6 if kind != "float" and quantize else 4)  # Q4..Q8 blocks kept as they are
            if arch.tie_word_embeddings and quantize and (kind != "float" or plan.policy in ("int8", "int4")):
                weights += n  # the tied head's int8 panels
        else:
            weights += packed_bytes(kind, n, plan.policy, plan.keep_float)
    resources.check_fits(int(weights), plan.reserve_bytes, source)


def _load_hf(path: str, dtype: str, device: torch.device, load_tokenizer: bool, quantization: str,
             tp_group, plan: _Plan) -> LoadedModel:
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
    shapes = _safetensors_shapes(files)
    check_declared_sizes(arch, shapes, path)
    weights = _safetensors_weights(files)
    qcfg = cfg.get("quantization_config")
    prequant = hf_quant.PrequantConfig.from_hf(qcfg) if qcfg else None
    _refuse_prequant(quantization, prequant.method if prequant else None, path)
    if prequant is not None:
        weights = hf_quant.convert(weights, prequant)
    _check_fits(path, [_hf_tensor(name, shape, prequant) for name, shape in shapes.items()], arch, plan, device,
                tp_group)
    cached = plan.cache.read() if plan.cache is not None else None
    model = cached or _build(arch, resolve_dtype(dtype, src, device), device, weights, tp_group, plan)
    tok = Tokenizer.from_hf_dir(path) if load_tokenizer else None
    return LoadedModel(model, arch, tok, from_cache=cached is not None)


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


def _hf_tensor(name: str, shape: tuple[int, ...], prequant) -> tuple[str, int, str]:
    """A safetensors tensor as `_check_fits` counts it: AWQ/GPTQ qweights hold 32/bits weights per int32."""
    n = 1
    for d in shape:
        n *= d
    if prequant is not None and name.endswith(".qweight"):
        return name, n * 32 // prequant.bits, "q4" if prequant.bits == 4 else "block"
    if prequant is not None and name.endswith((".qzeros", ".scales", ".g_idx")):
        return name, 0, "float"
    return name, n, "float"


def _load_gguf(path: str, dtype: str, device: torch.device, load_tokenizer: bool, tp_group,
               plan: _Plan) -> LoadedModel:
    g = GGUFFile(path)
    arch = ArchConfig.from_gguf(g.meta, g.vocab_size(), has_output="output.weight" in g.tensors,
                                rope_factors=g.rope_factors(), dense_layers=g.dense_layers())
    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor; the file is incomplete.")
    check_declared_sizes(arch, g.hf_shapes(), path)
    _check_fits(path, g.footprint(), arch, plan, device, tp_group)
    cached = plan.cache.read() if plan.cache is not None else None
    model = cached or _build(arch, resolve_dtype(dtype, torch.float32, device), device,
                             g.hf_weights(arch.num_heads, arch.num_kv_heads), tp_group, plan)
    tok = Tokenizer.from_gguf(g.meta) if load_tokenizer else None
    return LoadedModel(model, arch, tok, from_cache=cached is not None)
