"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a softmax router picks k experts
per token, their outputs are summed with the router's weights (renormalised over the k or not, per
config), plus a sigmoid-gated shared expert where the config has one.

Each expert is an ordinary gated MLP of `Linear` layers, so int4/int8 quantization and the CPU
kernels apply to experts exactly as to a dense MLP. Tokens are grouped by expert: one pass over
the step's routing sorts (token, slot) pairs by expert, and every expert that got tokens runs once
on all of them — its weights are read once per step, and experts nobody chose are not read at all,
which is what makes a model with few active parameters fast on a memory-bound CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.models.arch import ArchConfig


class SparseMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, expert_mlp) -> None:
        """`expert_mlp(intermediate_size)` builds one expert (models/llama.py's MLP)."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router: kept in float (see CausalLM.quantize)
        self.gate.keep_float = True
        self.experts = nn.ModuleList(expert_mlp(cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = expert_mlp(cfg.shared_expert_size) if cfg.shared_expert_size else None
        if self.shared_expert is not None:
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)
            self.shared_expert_gate.keep_float = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> the k experts of each token (T, k) and their weights (T, k), as transformers'
        TopKRouter: softmax in float32, top-k, optional renormalisation, back to x's dtype."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)            # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        slot_weight = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                y = self.experts[e](x.index_select(0, rows)) * slot_weight[start:start + n, None]
                out.index_add_(0, rows, y)
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
