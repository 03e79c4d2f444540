"""Single-file GGUF models: metadata, tensors, tokenizer and chat template.

The `gguf` package parses the header; tensors are handed to the model unread, as BlockTensors
(quant/gguf_tensor.py) that each layer reads into its own packed form, a run of rows at a time.
This module maps llama.cpp tensor names onto Hugging Face names, undoes llama.cpp's Q/K row
permutation for Llama-family files (it converts rotate-half RoPE to interleaved; our rotary is
rotate-half), and turns every way a file can be broken into a ValueError that says so.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator

import numpy as np
import torch

from tokenmill.models.gguf_header import read_header
from tokenmill.quant.gguf_tensor import FLOAT_TYPES, open_tensor, read_float

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, every expert's projection stacked in one 3-D tensor, a shared expert
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2/3 name their four norms differently (llama.cpp's ffn_norm is the MLP's input norm in both)
_SANDWICH_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            _, self.meta, infos = read_header(path)
        except Exception as e:  # noqa: BLE001 - struct errors, bad UTF-8, impossible sizes: a broken file
            raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated?): "
                             f"{type(e).__name__}: {e}") from None
        self.tensors = {t.name: t for t in infos}
        self.layer_names = dict(_LAYER_NAMES)
        if self.architecture in ("gemma2", "gemma3"):
            self.layer_names.update(_SANDWICH_NAMES)
        if self.architecture == "phi3" and not any(n.endswith("ffn_gate.weight") for n in self.tensors):
            self.layer_names["ffn_up"] = "mlp.gate_up_proj"  # gate and up fused, gate first
        bad = sorted({t.tensor_type.name for t in infos} - SUPPORTED_TYPES)
        if bad:
            raise ValueError(f"{path} uses GGUF tensor types {bad}, which tokenmill cannot load; "
                             f"supported: {sorted(SUPPORTED_TYPES)}. Re-quantize the model to one of those.")

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's Hugging Face name and logical shape (rows, cols), read from the header
        alone: what the metadata's sizes are checked against before anything is allocated."""
        shapes = {}
        for name, t in self.tensors.items():
            hf = self.hf_name(name)
            shape = tuple(int(d) for d in reversed(t.shape))
            if hf is not None and "{e}" in hf:
                shapes.update((hf.format(e=e), shape[1:]) for e in range(shape[0]))
            elif hf is not None:
                shapes[hf] = shape
        return shapes

    def footprint(self) -> list[tuple[str, int, str]]:
        """(hf name, elements, kind) of every tensor the model loads, kind float, q4 (Q4_0/Q4_1,
        kept as int4) or the block type's name: what the memory check counts."""
        out = []
        for name, t in self.tensors.items():
            hf = self.hf_name(name)
            if hf is not None:
                kind = t.tensor_type.name
                out.append((hf, int(t.n_elements), "float" if kind in FLOAT_TYPES else
                            "q4" if kind in ("Q4_0", "Q4_1") else kind))
        return out

    def dense_layers(self) -> tuple[int, ...]:
        """In a mixture-of-experts file: the layers without a router (a dense MLP)."""
        blocks = {int(m.group(1)) for n in self.tensors if (m := _BLK.match(n))}
        return tuple(sorted(b for b in blocks if f"blk.{b}.ffn_gate_inp.weight" not in self.tensors))

    @property
    def architecture(self) -> str:
        return self.meta.get("general.architecture", "?")

    def vocab_size(self) -> int:
        return int(self.tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in self.tensors else 0

    def hf_weights(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, object, dict]]:
        """Yield (hf_name, tensor, extras) for every tensor in the file: float types as float32
        tensors, block types as BlockTensors (read when a layer packs them); extras `quantized`:
        stored in a block format. A stacked expert tensor yields one tensor per expert."""
        for hf, read, extras in self.hf_readers(num_heads, num_kv_heads):
            yield hf, read(), extras

    def hf_readers(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, Callable[[], object], dict]]:
        """`hf_weights` with each tensor not read yet: (hf_name, a function reading it, extras), so
        a caller can take the tensors in any order, a few at a time (quantization, layer by layer)."""
        permute = self.architecture in ("llama", "mistral")
        opened: dict[str, object] = {}  # the stacked expert tensor being sliced (read once for its experts)
        for name, t in self.tensors.items():
            hf = self.hf_name(name)
            if hf is None:
                continue
            kind = t.tensor_type.name
            shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: (rows, cols)
            quantized = kind not in FLOAT_TYPES
            extras = {"quantized": quantized}
            if len(shape) == 3:  # one tensor per expert, its rows a slice of the stacked ones
                rows = shape[1]
                for e in range(shape[0]):
                    yield hf.format(e=e), (lambda n=name, e=e: self._expert(n, e, rows, opened)), extras
                continue
            heads = (num_heads if "attn_q" in name else num_kv_heads) \
                if permute and name.endswith(("attn_q.weight", "attn_k.weight")) else 0
            yield hf, (lambda n=name, h=heads, one=hf.endswith("shared_expert_gate.weight") and len(shape) == 1:
                       self._read(n, h, one)), extras

    def _open(self, name: str):
        t = self.tensors[name]
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            return (open_tensor(self.path, int(t.data_offset), kind, shape, name) if kind not in FLOAT_TYPES
                    else read_float(self.path, int(t.data_offset), kind, shape))
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - unreadable offsets or sizes: a broken file
            raise ValueError(f"tensor {name} in {self.path} could not be read ({type(e).__name__}: {e}); "
                             "the file is corrupt or truncated.") from None

    def _expert(self, name: str, e: int, rows: int, opened: dict):
        if name not in opened:
            opened.clear()
            opened[name] = self._open(name)
        w = opened[name]
        return w[e * rows:(e + 1) * rows] if self.tensors[name].tensor_type.name not in FLOAT_TYPES else w[e]

    def _read(self, name: str, heads: int, vector_gate: bool):
        w = self._open(name)
        if vector_gate:
            w = w[None]  # llama.cpp stores the (1, hidden) gate as a vector
        if heads:
            quantized = self.tensors[name].tensor_type.name not in FLOAT_TYPES
            w = w.permute_rows(_unpermute(torch.arange(w.shape[0]), heads).numpy()) if quantized else _unpermute(w, heads)
        return w

    def rope_factors(self) -> tuple[list[float], list[float]] | None:
        """(short, long) LongRoPE factors, which llama.cpp stores as tensors, or None."""
        if not all(n in self.tensors for n in _ROPE_FACTORS):
            return None
        return tuple(self._dequantize(self.tensors[n]).reshape(-1).tolist() for n in _ROPE_FACTORS)

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of GGUF tensor `name`, or None for a tensor the model does not load."""
        m = _BLK.match(name)
        if m:
            layer, part, kind = m.groups()
            if part not in self.layer_names:
                return None
            return f"model.layers.{layer}.{self.layer_names[part]}.{kind}"
        base, _, kind = name.rpartition(".")
        return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None

    def _dequantize(self, t) -> np.ndarray:
        import gguf

        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: (rows, cols)
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            return data.astype(np.float32, copy=False).reshape(shape)
        except Exception as e:
            raise ValueError(f"tensor {t.name} in {self.path} could not be read ({type(e).__name__}: {e}); "
                             "the file is corrupt or truncated.") from None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `permute` of Q/K rows (the inverse of `_unpermute`), for any per-row tensor:
    weights, biases, or a quantized tensor's rows of block bytes."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
