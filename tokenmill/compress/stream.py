"""A float model opened one decoder layer at a time: what lets `quantize` run at real sizes.

The model is built without weights; the embedding and the norms are read at once (calibration
needs them from the start), each decoder layer's tensors only when the walk reaches it, dequantized
to float32, and released when the layer has been quantized and has fed the next one. Peak memory
is then the embedding, one layer in float32, the calibration activations and the output so far,
not the whole model in float32 (an 8B model's 32 GB). Tensors are read in any order the walk asks
for, from a GGUF file or a Hugging Face directory of safetensors.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Callable, Iterator

import torch

from tokenmill import resources
from tokenmill.compress import export
from tokenmill.layers.linear import Linear, deferred_weights
from tokenmill.models.arch import ArchConfig
from tokenmill.models.gguf_loader import GGUFFile, is_gguf
from tokenmill.models.llama import CausalLM, fill_weights
from tokenmill.models.tokenizer import Tokenizer

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LayerStream:
    def __init__(self, path: str) -> None:
        self.path = path
        if is_gguf(path):
            g = GGUFFile(path)
            self.arch = ArchConfig.from_gguf(g.meta, g.vocab_size(), has_output="output.weight" in g.tensors,
                                             rope_factors=g.rope_factors(), dense_layers=g.dense_layers())
            readers = list(g.hf_readers(self.arch.num_heads, self.arch.num_kv_heads))
            self.tokenizer = Tokenizer.from_gguf(g.meta)
        elif os.path.isfile(os.path.join(path, "config.json")):
            self.arch, readers = _hf_readers(path)
            self.tokenizer = Tokenizer.from_hf_dir(path)
        else:
            raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory (config.json).")
        export.check_exportable(self.arch)
        self.layers: dict[int, list] = {}
        self.top, self.head = [], []
        for item in readers:
            m = _LAYER.match(item[0])
            if m:
                self.layers.setdefault(int(m.group(1)), []).append(item)
            elif item[0] == "lm_head.weight":
                self.head.append(item)
            else:
                self.top.append(item)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"), deferred_weights():
                self.model = CausalLM(self.arch)
        finally:
            torch.set_default_dtype(prev)
        self.model.stream_quantized("none", 32)
        self.model.eval()
        self.layer_bytes = max(sum(_elements(m) for m in _linears(layer)) * 4 for layer in self.model.model.layers)
        self._fill(self.top)

    def parameters(self) -> int:
        """The model's parameter count from its shapes (the weights are not all in memory)."""
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        weights = {id(m.weight) for m in linears}
        return sum(_elements(m) for m in linears) + sum(p.numel() for p in self.model.parameters() if id(p) not in weights)

    def _fill(self, items: list) -> None:
        fill_weights(self.model, ((name, read(), extras) for name, read, extras in items))

    def check_fits(self, calibration_bytes: int) -> None:
        """Refuse, before any work, a run that would not fit: the embedding, the largest layer in
        float32 (or the untied output head, read last), the calibration's activations."""
        embed = self.arch.vocab_size * self.arch.hidden_size * 4
        head = embed if self.head else 0
        resources.check_fits(embed + max(self.layer_bytes, head), calibration_bytes, f"quantizing {self.path}")

    def load_layer(self, i: int) -> None:
        self._fill(self.layers.get(i, []))

    def release_layer(self, i: int) -> None:
        """Drop the layer's float weights (norms and biases, a few KB, stay: the output needs them)."""
        for m in _linears(self.model.model.layers[i]):
            m.weight.data = torch.empty(0)

    def load_head(self) -> None:
        """The untied output projection, read last (after every layer has been released)."""
        self._fill(self.head)


def calibration_bytes(arch: ArchConfig, samples: int, seq_len: int) -> int:
    """The walk's activations: the windows' hidden states twice (a layer's inputs and outputs),
    one window's MLP intermediates, and the four X^T X sums (float32, plus a 16-bit copy)."""
    hidden = samples * seq_len * arch.hidden_size * 4 * 2
    window = seq_len * arch.intermediate_size * 4 * 4
    k = (arch.hidden_size, arch.num_heads * arch.head_dim, arch.hidden_size, arch.intermediate_size)
    return hidden + window + sum(d * d * 6 for d in k)


def _linears(layer) -> Iterator[Linear]:
    return (m for m in layer.modules() if isinstance(m, Linear))


def _elements(m: Linear) -> int:
    return m.in_features * m.out_features


def _hf_readers(path: str) -> tuple[ArchConfig, list[tuple[str, Callable[[], torch.Tensor], dict]]]:
    from safetensors import SafetensorError, safe_open

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}/config.json is not valid JSON: {e}") from None
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{path} is already {method}-quantized; quantize starts from a float model (or a GGUF file).")
    arch = ArchConfig.from_hf(cfg)  # an unknown architecture is the first thing to say
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights.")

    def reader(file: str, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name).float()
        return read

    readers = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                readers += [(name, reader(file, name), {}) for name in f.keys()]
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from None
    return arch, readers
