"""Rotary position embedding (rotate-half / NeoX layout) and the context-extension scalings models
ship with: linear, dynamic NTK, YaRN, LongRoPE and Llama 3 — each computed as transformers'
`modeling_rope_utils` defines it, so logits match the reference past the original context too.

cos/sin rows are looked up once per forward (`lookup`) and shared by every layer using the same
rotary, from tables that grow in fixed chunks over the positions actually seen rather than over
the whole declared context (a 128k-token YaRN model would hold tens of megabytes of table). Only the first `rotary_dim` dimensions of a head rotate (Phi-4-mini's
partial rotary factor); the rest pass through.

Two scalings depend on the length of the sequence being run, as in transformers'
`dynamic_rope_update`: dynamic NTK recomputes its base for a sequence longer than the original
context, and LongRoPE switches from its short to its long factors there. The length in force for a
token (`seq_lens`) is the last position its request feeds in that forward plus one: a whole prompt
takes its full length, a decode step its own position — what transformers computes when it runs the
same chunks with its cache. A decode with drafts scores each row as a plain decode would.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill import kernels

KINDS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ROPE_CHUNK = 1024  # positions per step of the cos/sin tables' growth


def scaling_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in KINDS:
        raise ValueError(f"Unsupported rope scaling type {kind!r}; supported: {', '.join(KINDS)}.")
    return kind


def _base_inv_freq(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    # float32 exactly as the reference implementations compute it
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, theta: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    factor = s.get("factor") or max_position / s["original_max_position_embeddings"]
    orig = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wl, high_wl = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where((wavelen <= low_wl) & (wavelen >= high_wl), mid, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        """`max_position`: the model's declared context (`max_position_embeddings`), which dynamic
        NTK and YaRN/LongRoPE (when they give no factor) take as the reference transformers does."""
        super().__init__()
        self.dim, self.theta, self.max_position = rotary_dim, theta, max_position
        self.kind = scaling_kind(scaling)
        self.scaling = dict(scaling or {})
        self.attention_factor = 1.0
        self.original = None  # dynamic / longrope: the length past which the long regime applies
        inv = _base_inv_freq(rotary_dim, theta)
        long_inv = None
        if self.kind == "linear":
            inv = inv / self.scaling["factor"]
        elif self.kind == "llama3":
            inv = _llama3(inv, self.scaling)
        elif self.kind == "yarn":
            inv, self.attention_factor = _yarn(rotary_dim, theta, self.scaling, max_position)
        elif self.kind == "dynamic":
            self.original = max_position
        elif self.kind == "longrope":
            s = self.scaling
            self.original = s.get("original_max_position_embeddings") or max_position
            factor = s.get("factor") or max_position / self.original
            attn = s.get("attention_factor")
            if attn is None:
                attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original))
            self.attention_factor = float(attn)
            shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
            for key in ("short_factor", "long_factor"):
                if len(s[key]) != rotary_dim // 2:
                    raise ValueError(f"longrope {key} has {len(s[key])} entries; the rotary dimension "
                                     f"{rotary_dim} needs {rotary_dim // 2}.")
            inv = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta ** shape)
            long_inv = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * theta ** shape)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.register_buffer("long_inv_freq", long_inv, persistent=False)
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # see _rows

    @property
    def length_dependent(self) -> bool:
        """Whether angles depend on the sequence length in force (dynamic NTK, LongRoPE)."""
        return self.original is not None

    def lookup(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions -> cos, sin of shape (T, 1, rotary_dim/2), for all layers of one step.
        `seq_lens` (T,): the sequence length in force per token (see the module docstring);
        None: the longest position here plus one, for every token (one sequence, no cache)."""
        positions = positions.to(self.inv_freq.device)
        long = None
        if self.length_dependent:
            if seq_lens is None:
                seq_lens = (positions.max() + 1).expand(positions.shape) if positions.numel() else positions
            long = seq_lens.to(positions.device) > self.original
        cos, sin = self._rows("short", self.inv_freq, positions)
        if long is not None and bool(long.any()):
            if self.kind == "longrope":
                lc, ls = self._rows("long", self.long_inv_freq, positions)
            else:
                lc, ls = self._dynamic_rows(positions, seq_lens.to(positions.device))
            cos, sin = torch.where(long[:, None], lc, cos), torch.where(long[:, None], ls, sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _rows(self, name: str, inv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of a table grown a fixed-size chunk at a time over the positions seen so far. A
        position's cos/sin must not depend on which other positions share the step (vectorised
        cos rounds differently in a vector's body and its tail), or a request would compute other
        numbers in a batch than alone, and recomputation after preemption would diverge."""
        if name not in self._tables:
            self._tables[name] = (inv.new_empty(0, inv.shape[0]), inv.new_empty(0, inv.shape[0]))
        cos, sin = self._tables[name]
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > cos.shape[0]:
            chunks_c, chunks_s = [cos], [sin]
            for start in range(cos.shape[0], top, ROPE_CHUNK):
                freqs = torch.arange(start, start + ROPE_CHUNK, dtype=torch.float32, device=inv.device)[:, None] * inv
                chunks_c.append(freqs.cos() * self.attention_factor)
                chunks_s.append(freqs.sin() * self.attention_factor)
            cos, sin = torch.cat(chunks_c), torch.cat(chunks_s)
            self._tables[name] = (cos, sin)
        return cos[positions], sin[positions]

    def _dynamic_rows(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK past the original context: angles per token, in float64 and rounded once, so
        that (up to a double rounding tie) a token's values do not depend on its neighbours."""
        freqs = positions.double()[:, None] * self._dynamic_inv(seq_lens).double()
        return freqs.cos().float(), freqs.sin().float()

    def _dynamic_inv(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """(T,) lengths -> (T, dim/2): the NTK-aware base for each length, as transformers'
        `_compute_dynamic_ntk_parameters` (lengths below the original context use it unchanged)."""
        factor, d = self.scaling["factor"], self.dim
        seq = torch.clamp(seq_lens, min=self.max_position).float()
        base = self.theta * ((factor * seq / self.max_position) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base[:, None] ** (torch.arange(0, d, 2, dtype=torch.int64).float()[None, :] / d))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) -> rotated (T, H, D); in float32 whatever x's dtype. cos/sin (T, 1, R/2) rotate
    the first R dimensions of each head (R < D: partial rotary), the rest pass through."""
    if kernels.usable_for(x):
        return kernels.rotary(x, cos, sin)
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., :r].float().chunk(2, dim=-1)
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return (torch.cat((rot, x[..., r:].float()), dim=-1) if r < x.shape[-1] else rot).to(x.dtype)
