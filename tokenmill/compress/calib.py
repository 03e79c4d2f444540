"""Calibration: text -> token windows, and a layer-by-layer walk of the model that records what
each linear layer sees (input second moments X^T X for GPTQ, channel norms for Wanda, a sample of
rows for AWQ). Compression methods work one decoder layer at a time, feeding the next layer the
outputs of the already-compressed one, so errors are measured where they accumulate."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch

from tokenmill.layers.linear import Linear
from tokenmill.models.llama import CausalLM, DecoderLayer


def required(path: str | None, flag: str, why: str) -> str:
    """`path` of a text file the command needs. There is no default: an install carries no corpus,
    and which text calibrates (or trains, or evaluates) a model is the user's choice."""
    if path is None:
        raise ValueError(f"{flag} FILE is required {why} (a plain-text file, e.g. WikiText-2's validation split).")
    read_text(path)  # fail on a missing file before loading anything
    return path


def read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"calibration/training text {path!r} not found; pass a text file.")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} is empty.")
    return text


def windows(token_ids: list[int], num_samples: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """`num_samples` windows of `seq_len` tokens at seeded random offsets (AutoGPTQ's recipe)."""
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need at least 1 sample of at least 2 tokens; got {num_samples} x {seq_len}.")
    if len(token_ids) < seq_len:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}.")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(token_ids) - seq_len + 1) for _ in range(num_samples)]
    return [torch.tensor(token_ids[s:s + seq_len], dtype=torch.long) for s in starts]


@dataclass
class InputStats:
    """What one linear layer's inputs looked like over the calibration set."""
    in_features: int
    want_xtx: bool = False
    rows_per_call: int = 0                   # rows of each forward's input kept as the sample
    num_rows: int = 0
    xtx: torch.Tensor | None = None          # (K, K) sum of x^T x
    sq: torch.Tensor | None = None           # (K,) sum of x^2 per input channel
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.in_features).float()
        self.num_rows += x.shape[0]
        self.sq = (x * x).sum(0) if self.sq is None else self.sq + (x * x).sum(0)
        if self.want_xtx:
            self.xtx = x.t() @ x if self.xtx is None else self.xtx.addmm_(x.t(), x)
        if self.rows_per_call:
            g = torch.Generator().manual_seed(len(self.rows))
            self.rows.append(x[torch.randperm(x.shape[0], generator=g)[: self.rows_per_call]].clone())

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def linears(layer: DecoderLayer) -> dict[str, Linear]:
    return {"self_attn.qkv_proj": layer.self_attn.qkv_proj, "self_attn.o_proj": layer.self_attn.o_proj,
            "mlp.gate_up_proj": layer.mlp.gate_up_proj, "mlp.down_proj": layer.mlp.down_proj}


class LayerWalk:
    """Hidden states of the calibration windows, advanced one decoder layer at a time."""

    def __init__(self, model: CausalLM, samples: list[torch.Tensor]) -> None:
        self.model = model
        self.rope = model.ropes(torch.arange(samples[0].numel()))
        with torch.no_grad():
            emb = model.model.embed_tokens
            self.hidden = [emb(s) for s in samples]
            if model.cfg.embed_scale:
                self.hidden = [h * torch.tensor(model.cfg.hidden_size ** 0.5, dtype=h.dtype) for h in self.hidden]

    @torch.no_grad()
    def stats(self, layer: DecoderLayer, want_xtx: bool = False, max_rows: int = 0) -> dict[str, InputStats]:
        """Run the layer over every window, recording its linear layers' inputs (and a sample of
        about `max_rows` input rows each)."""
        per_call = -(-max_rows // len(self.hidden)) if max_rows else 0
        found = {name: InputStats(m.in_features, want_xtx, per_call) for name, m in linears(layer).items()}
        hooks = [m.register_forward_pre_hook(lambda mod, args, st=found[name]: st.add(args[0]))
                 for name, m in linears(layer).items()]
        try:
            for h in self.hidden:
                layer(self.rope, h)
        finally:
            for hook in hooks:
                hook.remove()
        return found

    @torch.no_grad()
    def advance(self, layer: DecoderLayer) -> None:
        """Replace the hidden states by the (compressed) layer's outputs: the next layer's inputs."""
        self.hidden = [layer(self.rope, h) for h in self.hidden]
