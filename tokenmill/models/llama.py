"""One decoder for the Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2), Qwen2 (QKV bias),
Qwen3 (q/k norms), Gemma (norm offset, embedding scale, GeLU), Gemma 2 and 3 (sandwich norms,
soft-capping, sliding-window layers, a local rotary) and Phi-3 (partial rotary, LongRoPE): the
differences are flags of ArchConfig. Fused QKV and gate/up projections.

Input is a flat ragged batch: `input_ids` and `positions` of shape (T,), all requests' tokens
back to back, no padding; attention finds the request boundaries in the ForwardContext.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.layers.tensor_parallel import row_parallel_bounds
from tokenmill.layers.attention import Attention, get_forward_context
from tokenmill.layers.embedding import Embedding
from tokenmill.layers.linear import FusedLinear, Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.arch import ArchConfig
from tokenmill.models.moe import SparseMoE
from tokenmill.quant.assembly import FILE_FORMATS, QuantArgs

# The int8 copy of a tied embedding serves up to a decode step's worth of rows (one per running
# request: 64 by default); past that (perplexity over whole windows) the float table does.
HEAD_INT8_MAX_ROWS = 64

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


Ropes = tuple  # (cos, sin) of the global rotary, then of the local one where the model has one


class SelfAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                    bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        elif cfg.qk_norm_full:
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_full, self.clip = cfg.qk_norm, cfg.qk_norm_full, cfg.clip_qkv
        self.window = cfg.window(layer)
        # Gemma 3's sliding layers rotate with their own base: the second of the step's ropes
        self.rope_index = 1 if self.window and cfg.local_rope_theta is not None else 0
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale, self.window, cfg.attn_softcap)

    def forward(self, ropes: Ropes, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm_full:  # OLMoE: norms over whole projections, then the clamp
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)     # (T, Hq+Hkv, D)
        if self.qk_norm:
            qk = self._norm_heads(qk)
        qk = apply_rotary(qk, *ropes[self.rope_index])
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)    # (T, Hkv, D)
        o = self.attn(q, k, v)                              # (T, Hq, D)
        return self.o_proj(o.reshape(-1, self.q_size))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of q and k (in place in the projection's output on the CPU kernels, the
        same arithmetic as the decode stack's)."""
        if kernels.usable_for(qk):
            kernels.head_rms_norm_(qk[:, :self.num_heads], self.q_norm.factor(), self.q_norm.eps)
            kernels.head_rms_norm_(qk[:, self.num_heads:], self.k_norm.factor(), self.k_norm.eps)
            return qk
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": self.inter, "up": self.inter})
        self.down_proj = Linear(self.inter, cfg.hidden_size)
        self.act = _ACTS.get(cfg.hidden_act)
        if self.act is None:
            raise ValueError(f"Unsupported activation {cfg.hidden_act!r}; supported: {sorted(_ACTS)}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.act is F.silu and gu.dim() == 2 and kernels.usable_for(gu):
            return self.down_proj(kernels.silu_mul(gu))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. Llama names its MLP's input norm `post_attention_layernorm`;
    Gemma 2/3 ("sandwich" norms) use that name for the norm of the attention output, and add
    `pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP."""

    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = SparseMoE(cfg, lambda size: MLP(cfg, size)) if cfg.is_moe_layer(layer) else MLP(cfg)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output feeds the MLP."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, ropes: Ropes, h: torch.Tensor) -> torch.Tensor:
        if not self.sandwich:
            h = h + self.self_attn(ropes, self.input_layernorm(h))
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(ropes, self.input_layernorm(h)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class CausalLM(nn.Module):
    """Weight names follow Hugging Face (`model.layers.N...`) minus the q/k/v and gate/up split,
    which `load_weights` maps onto the fused layers.

    With `tp` (a ShardPlan and the rank's TPGroup, distributed/tensor_parallel.py) the module is
    one rank's shard: `cfg` is then the rank's share of the model (its heads, MLP channels and
    vocabulary rows), the row-parallel projections all-reduce, and only rank 0 gets logits."""

    def __init__(self, cfg: ArchConfig, tp: tuple | None = None) -> None:
        super().__init__()
        self.plan, self.tp_group = tp if tp is not None else (None, None)
        self.row_bounds = row_parallel_bounds(cfg)  # of the whole model, with or without tp
        if self.plan is not None:
            cfg = self.plan.local_arch(cfg)
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotary = RotaryEmbedding(cfg.rope_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = None if cfg.local_rope_theta is None else \
            RotaryEmbedding(cfg.rope_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.tied_head_q = None  # the tied embedding in a kernel form (int8, or its own K-quant) for the output
        self.quantized_sources: set[str] = set()         # parameters stored quantized in the checkpoint
        self.decode_stack = None  # all layers as one native call for decode steps (models/decode_stack.py)
        if self.tp_group is not None:
            for layer in self.model.layers:
                layer.self_attn.o_proj.tp_group = layer.mlp.down_proj.tp_group = self.tp_group

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden); a vocabulary-parallel rank looks up the ids in its rows, zeros
        for the rest, and the all-reduce assembles every row."""
        if self.plan is None:
            return self.model.embed_tokens(input_ids)
        first, count = self.plan.vocab
        local = input_ids - first
        outside = (local < 0) | (local >= count)
        h = self.model.embed_tokens(local.clamp(0, count - 1)).masked_fill_(outside[:, None], 0.0)
        return self.tp_group.all_reduce(h)

    def ropes(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None) -> Ropes:
        """cos/sin of every rotary the layers use, for the step's positions (see layers/rotary.py
        for `seq_lens`)."""
        ropes = self.rotary.lookup(positions, seq_lens)
        return (ropes,) if self.rotary_local is None else (ropes, self.rotary_local.lookup(positions))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states."""
        h = self.embed(input_ids)
        if self.cfg.embed_scale:
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        meta = get_forward_context()
        seq_lens = None
        if self.rotary.length_dependent and meta is not None:
            seq_lens = meta.sequence_lengths(positions)
        ropes = self.ropes(positions, seq_lens)
        if self.decode_stack is not None and meta is not None and meta.all_decode:
            flat = [t.view(t.shape[0], -1) for rope in ropes for t in rope]
            h = self.decode_stack.forward(h, flat[0], flat[1], meta.slot_mapping, meta.decode_block_tables,
                                          meta.decode_context_lens, *(flat[2:] or (None, None)),
                                          None if meta.lora is None else meta.lora.slots)
        else:
            for layer in self.model.layers:
                h = layer(ropes, h)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32 logits; callers pass only the rows they sample.
        Tensor-parallel: every rank computes its vocabulary rows' logits, rank 0 gets them all
        and the other ranks None."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.tied_head_q is not None and hidden.shape[0] <= HEAD_INT8_MAX_ROWS:
            logits = self.tied_head_q.matmul(hidden).float()
        else:
            logits = self.model.embed_tokens.logits(hidden).float()
        if self.plan is not None:
            logits = self.tp_group.gather_vocab(logits, self.plan)
            if logits is None:
                return None
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def quantize(self, policy: str, group_size: int, keep_float: bool = False, activation_bits: int = 16) -> None:
        """Swap float weights for int4/int8 ones (see `Linear.quantize`, `_linears`).
        `keep_float` keeps the float weights too, for steps with many tokens."""
        for _, module, args in self._linears(policy, group_size, keep_float, activation_bits):
            module.quantize(**vars(args))
        embed_q = "model.embed_tokens.weight" in self.quantized_sources
        if self.lm_head is None and (policy in ("int8", "int4") or (policy in FILE_FORMATS and embed_q)):
            self.tied_head_q = self.model.embed_tokens.head_weight(policy)
            for w in self.tied_head_q.leaves():
                w.configure(16, 0)

    def stream_quantized(self, policy: str, group_size: int, keep_float: bool = False, activation_bits: int = 16) -> None:
        """Before loading: each linear layer is packed as soon as its weights are in, and a
        block-quantized embedding stays in its blocks (`quantize` then finishes the rest)."""
        for _, module, args in self._linears(policy, group_size, keep_float, activation_bits):
            module.stream = args
        self.model.embed_tokens.keep_blocks = policy != "none"

    def _linears(self, policy: str, group_size: int, keep_float: bool, activation_bits: int):
        """(name, layer, QuantArgs) of every linear layer that is quantized. The output projection
        gets int8 at most and 16-bit activations: the logits decide sampling, and int4 or 8-bit
        rounding there costs more accuracy than the time it saves."""
        for name, module in self.named_modules():
            if isinstance(module, Linear) and not module.keep_float:
                head = name == "lm_head"
                bounds = next((v for k, v in self.row_bounds.items() if name.endswith(k)), ())
                yield name, module, QuantArgs(policy, group_size, allow_int4=not head, keep_float=keep_float,
                                              activation_bits=16 if head else activation_bits, row_bounds=bounds)

    def quantized_weights(self) -> list:
        """Every int4/int8 weight, in the order a forward pass reads them (the tied head last)."""
        weights = [w for m in self.modules() if isinstance(m, Linear) and m.qweight is not None
                   for w in m.qweight.leaves()]
        return weights + ([self.tied_head_q] if self.tied_head_q is not None else [])

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear layer (a quantized one's kernel
        panels) and the output head; the embedding table contributes one row; a mixture of
        experts, its experts' average share (k of E per token)."""
        total = 0.0
        for name, module in self.named_modules():
            share = self.cfg.experts_per_tok / self.cfg.num_experts if ".experts." in name else 1.0
            q = getattr(module, "qweight", None)
            if q is not None:
                total += share * q.kernel_bytes()
            elif getattr(module, "weight", None) is not None and module is not self.model.embed_tokens:
                total += share * module.weight.numel() * module.weight.element_size()
        if self.lm_head is None:
            head, embed = self.tied_head_q, self.model.embed_tokens
            total += head.kernel_bytes() if head is not None else embed.num_embeddings * embed.embedding_dim * 4
        return int(total)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


# Mixtral's checkpoint names -> the ones the other MoE families (and our modules) use
_RENAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# checkpoint suffix -> (our parameter suffix, shard of a fused layer)
_FUSED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


def _rows_of(extra: dict, start: int, size: int) -> dict:
    """A fused tensor's extras (quantized parts, one row per output) restricted to rows [start, start + size)."""
    out = dict(extra)
    for key in ("int4_parts", "int8_parts"):
        if out.get(key) is not None:
            out[key] = tuple(p[start:start + size] for p in out[key])
    return out


def load_weights(model: CausalLM, weights) -> None:
    """Copy `(hf_name, tensor)` pairs into the model; every parameter must be filled exactly once."""
    filled = fill_weights(model, weights)
    modules = dict(model.named_modules())
    expected = set()
    for pname, _ in model.named_parameters():
        mod = modules[pname.rsplit(".", 1)[0]]
        shards = getattr(mod, "shard_offsets", None)
        expected |= {f"{pname}:{s}" for s in shards} if shards else {f"{pname}:None"}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all); the file may be truncated or of another architecture.")


def fill_weights(model: CausalLM, weights) -> set[str]:
    """Copy `(hf_name, tensor)` pairs into the model and return what was filled ("param:shard"):
    the whole model (`load_weights`) or a part of it (quantization, one layer at a time)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    filled: set[str] = set()
    for item in weights:
        name, tensor = item[0], item[1]
        extra = item[2] if len(item) > 2 else {}
        if extra.get("quantized"):
            model.quantized_sources.add(name)
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding serves as the output projection
        parts = [_RENAMES.get(p, p) for p in name.split(".")] if "block_sparse_moe" in name else name.split(".")
        shard = None
        if len(parts) >= 3 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            parts[-2] = fused
        target = ".".join(parts)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {model.cfg.family} model.")
        param = params[target]
        if name.endswith("bias"):
            extra = {}
        owner = ".".join(parts[:-1])
        module = modules[owner]
        loader = getattr(module, "weight_loader", None)
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(param.dtype)
        shards = getattr(module, "shard_offsets", None)
        if shard is None and shards and loader is not None:
            # fused in the checkpoint too (Phi-3's qkv_proj, gate_up_proj): split by the shards' full rows
            sizes = model.plan.full[parts[-2]] if model.plan is not None else {k: n for k, (_, n) in shards.items()}
            if tensor.shape[0] != sum(sizes.values()):
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model "
                                 f"{tuple(param.shape)}")
            pieces, start = [], 0
            for sh, size in sizes.items():
                pieces.append((sh, tensor[start:start + size], _rows_of(extra, start, size)))
                start += size
        else:
            pieces = [(shard, tensor, extra)]
        for sh, piece, piece_extra in pieces:
            if model.plan is not None:  # this rank's slice (distributed/tensor_parallel.py)
                piece, piece_extra = model.plan.slice_weight(owner, parts[-1], sh, piece, piece_extra)
            if loader is not None:
                loader(param, piece, sh, **piece_extra)
            elif param.shape != piece.shape:
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(piece.shape)} vs model "
                                 f"{tuple(param.shape)}")
            else:
                param.data.copy_(piece)
            filled.add(f"{target}:{sh}")
    return filled
