"""Writing compressed models as Hugging Face checkpoints (config.json, model.safetensors,
tokenizer files), and the one rule every compression command follows: the output directory
appears complete or not at all (built under a temporary name, renamed at the end)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator

import torch

from tokenmill.layers.linear import Linear
from tokenmill.models.arch import ArchConfig
from tokenmill.models.llama import CausalLM
from tokenmill.models.tokenizer import Tokenizer

_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "gemma": ("GemmaForCausalLM", "gemma")}
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_output_dir(path: str, overwrite: bool = False) -> None:
    """Refuse early, before any work, an output that exists (unless `overwrite`) or cannot be made."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"output {path!r} exists and is not a directory.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ValueError(f"output directory {path!r} exists and is not empty; choose another or pass --overwrite.")
    _check_parent(path)


def _check_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"cannot create {path!r}: {parent} is not a writable directory.")


@contextlib.contextmanager
def atomic_output_dir(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory beside `path`; on success it replaces `path`, on any error
    (or Ctrl-C) it is removed, so no half-written model is ever left under `path`."""
    check_output_dir(path, overwrite)
    parent = os.path.dirname(os.path.abspath(path))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.partial-", dir=parent)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a model directory is not
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o666 & ~umask)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_file(path: str, overwrite: bool = False) -> None:
    """A single-file output (GGUF): refused early if it exists (unless `overwrite`) or cannot be made."""
    if os.path.isdir(path):
        raise ValueError(f"output {path!r} is a directory; --output-format gguf writes one file.")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"output {path!r} exists; choose another name or pass --overwrite.")
    _check_parent(path)


@contextlib.contextmanager
def atomic_output_file(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary file name beside `path`, renamed onto it on success and removed on any
    error: a half-written model file never appears under `path`."""
    check_output_file(path, overwrite)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def check_exportable(arch: ArchConfig) -> None:
    """The compression commands write Llama, Qwen2 and Gemma checkpoints; the newer families' own
    config fields (norm layouts, windows, experts) are not written yet, so they are refused before
    any work rather than written as a checkpoint that would load as another model."""
    if arch.family not in _HF_ARCH:
        raise ValueError(f"tokenmill's compression commands support {', '.join(sorted(_HF_ARCH))} models; "
                         f"this is a {arch.family} model (it serves, but cannot be compressed here yet).")


def hf_config(arch: ArchConfig, dtype: str) -> dict:
    """config.json for `arch`: what transformers and our loader need to rebuild the model."""
    check_exportable(arch)
    archname, model_type = _HF_ARCH[arch.family]
    cfg = {
        "architectures": [archname], "model_type": model_type, "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": arch.hidden_act, "torch_dtype": dtype,
    }
    if arch.rope_scaling:
        cfg["rope_scaling"] = arch.rope_scaling
    if arch.family == "llama" and arch.sliding_window:  # Mistral's window: transformers' Llama has none
        cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=arch.sliding_window)
    if arch.family == "llama":
        cfg["attention_bias"] = arch.qkv_bias
        cfg["mlp_bias"] = False
    if arch.family == "gemma":
        cfg["hidden_activation"] = arch.hidden_act
    return cfg


def float_tensors(model: CausalLM, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The model's float weights under Hugging Face names (fused layers split back into q/k/v and
    gate/up); modules named in `skip` (written in a quantized form instead) are left out."""
    out: dict[str, torch.Tensor] = {}
    gemma_norm_shift = 1.0 - model.cfg.norm_offset if model.cfg.family == "gemma" else 0.0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if name in skip:
                if module.bias is not None:
                    for shard_name, rows in split_rows(name, module, module.bias.data).items():
                        out[f"{shard_name}.bias"] = rows
                continue
            if module.weight is None:
                raise ValueError(f"{name} is quantized in memory; compression starts from float weights "
                                 "(load the model with quantization='none').")
            for shard_name, rows in split_rows(name, module, module.weight.data).items():
                out[f"{shard_name}.weight"] = rows
            if module.bias is not None:
                for shard_name, rows in split_rows(name, module, module.bias.data).items():
                    out[f"{shard_name}.bias"] = rows
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            out[name] = p.data - gemma_norm_shift  # GGUF folds Gemma's +1 into the weight; HF does not
    out["model.embed_tokens.weight"] = model.model.embed_tokens.weight.data
    return out


def split_rows(name: str, module: Linear, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of a fused layer's tensor (weight, bias, or any per-output-row tensor) by shard, under
    the shards' Hugging Face module names."""
    leaf = name.rsplit(".", 1)[-1]
    if not module.shard_offsets:
        return {name: t}
    parent = name.rsplit(".", 1)[0]
    return {f"{parent}.{hf}": t[start:start + size]
            for hf, (start, size) in zip(_UNFUSED[leaf], module.shard_offsets.values())}


def write_checkpoint(out_dir: str, arch: ArchConfig, tokenizer: Tokenizer | None, tensors: dict[str, torch.Tensor],
                     dtype: str = "bfloat16", quantization_config: dict | None = None,
                     report: dict | None = None) -> None:
    """Float tensors are cast to `dtype`; integer (packed) tensors and float16 scales keep theirs."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    cast = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() and not k.endswith(".scales") else v).contiguous()
            for k, v in tensors.items()}
    save_file(cast, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(arch, dtype)
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    if tokenizer is not None:
        tokenizer.save(out_dir)
        eos = sorted(tokenizer.eos_token_ids)
        if eos:
            cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    if report is not None:
        with open(os.path.join(out_dir, "compression.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


def count_parameters(model: CausalLM) -> int:
    """Parameters of the model as a checkpoint counts them: a tied output projection once."""
    return sum(p.numel() for p in model.parameters())
