"""Calibration: text -> token windows, and a layer-by-layer walk of the model that records what
each linear layer sees (input second moments X^T X for GPTQ, channel norms for Wanda, a sample of
rows for AWQ). Compression methods work one decoder layer at a time, feeding the next layer the
outputs of the already-compressed one, so errors are measured where they accumulate."""
from __future__ import annotations

import contextlib
import json
import os
import random
from dataclasses import dataclass, field

import torch

from tokenmill.layers.linear import Linear
from tokenmill.models.llama import CausalLM, DecoderLayer


def required_sources(paths: list[str] | None, flag: str, why: str) -> list[str]:
    """Every calibration source named by a repeatable `flag`, each checked before any work."""
    if not paths:
        raise ValueError(f"{flag} FILE is required {why} (a plain-text file, e.g. WikiText-2's validation split; "
                         f"repeat {flag} to mix text, code and a .jsonl of chat conversations).")
    for path in paths:
        if path.endswith(".jsonl"):
            conversations(path)
        else:
            read_text(path)
    return list(paths)


def conversations(path: str) -> list[list[dict]]:
    """A .jsonl of chats, one per line: {"messages": [{"role", "content"}, ...]} (OpenAI's form)
    or {"turns": ["...", ...]} (MT-Bench's user turns, each rendered as its own prompt)."""
    out = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e.msg}); a chat calibration file has one "
                             "conversation per line.") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            out.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("turns"), list):
            out.extend([{"role": "user", "content": str(t)}] for t in row["turns"])
        else:
            raise ValueError(f"{path} line {n} has neither a \"messages\" list nor a \"turns\" list.")
    if not out:
        raise ValueError(f"{path} holds no conversation.")
    return out


def source_tokens(tokenizer, path: str) -> list[int]:
    """A calibration source as one token stream: a text file as it reads, a .jsonl of chats
    rendered through the model's own chat template (what the served model will see)."""
    if not path.endswith(".jsonl"):
        return tokenizer.encode(read_text(path), add_special_tokens=False)
    ids: list[int] = []
    for messages in conversations(path):
        last_user = messages[-1].get("role") == "user"
        ids += tokenizer.encode_chat(messages, add_generation_prompt=last_user, split_special_tokens=False)
    return ids


def mixed_windows(sources: list[list[int]], num_samples: int, seq_len: int) -> list[torch.Tensor]:
    """`num_samples` windows drawn equally from every source (the first ones take the remainder)."""
    if num_samples < len(sources):
        raise ValueError(f"{len(sources)} calibration sources need at least as many samples; got {num_samples}.")
    per, extra = divmod(num_samples, len(sources))
    return [w for i, ids in enumerate(sources) for w in windows(ids, per + (i < extra), seq_len, seed=i)]


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


def compute_dtype(name: str = "auto") -> torch.dtype:
    """The dtype of the calibration's matrix products: bfloat16 where the CPU multiplies it
    natively (AVX512-BF16, AMX: 3-4x float32's speed; float32 sums), float32 elsewhere (AVX2
    has no bfloat16 arithmetic, so PyTorch would emulate it, slower than float32)."""
    if name not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"--compute-dtype must be auto, float32 or bfloat16; got {name!r}.")
    if name != "auto":
        return getattr(torch, name)
    import os

    from tokenmill.kernels.build import ISA_ENV, VARIANTS, cpu_flags, requested

    # TOKENMILL_CPU_ISA pins a run to a variant (an AVX2 measurement on a newer host): its instructions
    pinned = os.environ.get(ISA_ENV, "auto").strip().lower() not in ("", "auto")
    flags = VARIANTS[requested()][1] if pinned else cpu_flags()
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32


@dataclass
class InputStats:
    """What one linear layer's inputs looked like over the calibration set."""
    in_features: int
    want_xtx: bool = False
    want_sums: bool = True                   # sq, abs_sum (AWQ, pruning; GPTQ needs only X^T X)
    dtype: torch.dtype = torch.float32        # of the X^T X products (their sums are float32)
    num_rows: int = 0
    xtx: torch.Tensor | None = None          # (K, K) sum of x^T x: GPTQ's Hessian, AWQ's error metric
    sq: torch.Tensor | None = None           # (K,) sum of x^2 per input channel
    abs_sum: torch.Tensor | None = None      # (K,) sum of |x| per input channel (AWQ's activation scale)
    pending: list = field(default_factory=list)
    ROWS_PER_PRODUCT = 4096                   # rows gathered per X^T X product: fewer, larger products

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.in_features)
        self.num_rows += x.shape[0]
        if self.want_sums:
            xf = x.float()
            sq, ab = (xf * xf).sum(0), xf.abs().sum(0)
            self.sq = sq if self.sq is None else self.sq.add_(sq)
            self.abs_sum = ab if self.abs_sum is None else self.abs_sum.add_(ab)
        if self.want_xtx:
            self.pending.append(x.to(self.dtype))
            if sum(p.shape[0] for p in self.pending) >= self.ROWS_PER_PRODUCT:
                self.flush()

    def flush(self) -> None:
        """Add the pending rows' products to X^T X: only its upper blocks (`finish` mirrors them)."""
        if not self.pending:
            return
        xd = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        if self.xtx is None:
            self.xtx = torch.zeros(self.in_features, self.in_features)
        for (s, e), (s2, e2), prod in upper_gram_blocks(xd):
            self.xtx[s:e, s2:e2].add_(prod)

    def finish(self) -> None:
        self.flush()
        if self.xtx is not None:
            for (s, e), (s2, e2) in _block_pairs(self.in_features):
                if s2 > s:
                    self.xtx[s2:e2, s:e] = self.xtx[s:e, s2:e2].t()

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.num_rows, 1)


GRAM_BLOCK = 1024  # X^T X in blocks of this many columns, the lower ones mirrored (faster than one product)


def _block_pairs(k: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    cuts = [(s, min(s + GRAM_BLOCK, k)) for s in range(0, k, GRAM_BLOCK)]
    return [(a, b) for i, a in enumerate(cuts) for b in cuts[i:]]


def upper_gram_blocks(x: torch.Tensor):
    """The blocks on and above the diagonal of x^T x, as float32 ((rows), (cols), block): a
    symmetric product computed once per pair of column blocks (an 8,192-input layer: 36 of 64)."""
    if x.shape[1] <= GRAM_BLOCK:
        yield (0, x.shape[1]), (0, x.shape[1]), (x.t() @ x).float()
        return
    xt = x.t().contiguous()
    for (s, e), (s2, e2) in _block_pairs(x.shape[1]):
        yield (s, e), (s2, e2), (xt[s:e] @ xt[s2:e2].t()).float()


def linears(layer: DecoderLayer) -> dict[str, Linear]:
    return {"self_attn.qkv_proj": layer.self_attn.qkv_proj, "self_attn.o_proj": layer.self_attn.o_proj,
            "mlp.gate_up_proj": layer.mlp.gate_up_proj, "mlp.down_proj": layer.mlp.down_proj}


class LayerWalk:
    """Hidden states of the calibration windows (float32), advanced one decoder layer at a time;
    the layers' matrix products run in `dtype` (autocast), everything else in float32."""

    def __init__(self, model: CausalLM, samples: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        self.model, self.dtype = model, dtype
        self.rope = model.ropes(torch.arange(samples[0].numel()))
        with torch.no_grad():
            emb = model.model.embed_tokens
            self.hidden = [emb(s) for s in samples]
            if model.cfg.embed_scale:
                self.hidden = [h * torch.tensor(model.cfg.hidden_size ** 0.5, dtype=h.dtype) for h in self.hidden]

    @contextlib.contextmanager
    def _matmuls(self, layer: DecoderLayer):
        """Autocast to `dtype`, the linear weights cast once for the pass rather than by autocast
        at every window (autocast caches no cast of a weight that needs no gradient)."""
        if self.dtype == torch.float32:
            yield
            return
        mods = linears(layer).values()
        kept = [m.weight.data for m in mods]
        for m in mods:
            m.weight.data = m.weight.data.to(self.dtype)
        try:
            with torch.autocast("cpu", dtype=self.dtype):
                yield
        finally:
            for m, w in zip(mods, kept):
                m.weight.data = w

    @torch.no_grad()
    def stats(self, layer: DecoderLayer, want_xtx: bool = False, want_sums: bool = True) -> dict[str, InputStats]:
        """Run the layer over every window, recording its linear layers' inputs."""
        found = {name: InputStats(m.in_features, want_xtx, want_sums, self.dtype)
                 for name, m in linears(layer).items()}
        hooks = [m.register_forward_pre_hook(lambda mod, args, st=found[name]: st.add(args[0]))
                 for name, m in linears(layer).items()]
        # the down projection's product feeds only the layer's output, which this pass discards:
        # its inputs are recorded and the product skipped (a quarter of a Llama layer's work)
        down = layer.mlp.down_proj
        down.forward = lambda x: x.new_zeros(*x.shape[:-1], down.out_features)
        try:
            with self._matmuls(layer):
                for h in self.hidden:
                    layer(self.rope, h)
        finally:
            del down.forward
            for hook in hooks:
                hook.remove()
        for st in found.values():
            st.finish()
        return found

    @torch.no_grad()
    def advance(self, layer: DecoderLayer) -> None:
        """Replace the hidden states by the (compressed) layer's outputs: the next layer's inputs."""
        with self._matmuls(layer):
            for i, h in enumerate(self.hidden):  # one window's states replaced at a time: no second copy
                self.hidden[i] = layer(self.rope, h).float()
