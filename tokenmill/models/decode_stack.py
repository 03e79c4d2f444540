"""Decode steps through all decoder layers in one native call (tokenmill/kernels/stack.cpp).

At batch 1 the Python layer loop cost as much as the arithmetic: ~40 PyTorch calls per layer,
half of a small model's token (benchmarks/profile_decode.py). `build` hands
the kernels' `DecodeStack` every layer's weights and KV cache views once; `CausalLM.forward` then
runs each step whose tokens are all single-token decodes through it. It chains the kernels the
Python layers call, in the same order, so both paths give identical outputs; steps with prompt
tokens keep the Python layers. `TOKENMILL_DECODE_STACK=0` turns it off, for comparisons.
"""
from __future__ import annotations

import logging
import os

import torch

from tokenmill import kernels
from tokenmill.kernels import StackKind
from tokenmill.layers.linear import FLOAT_MIN_ROWS, Linear
from tokenmill.models.llama import CausalLM
from tokenmill.models.moe import SparseMoE

logger = logging.getLogger(__name__)

_ACTS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}  # stack.cpp's Act


def enabled() -> bool:
    return os.environ.get("TOKENMILL_DECODE_STACK", "1") != "0" and kernels.enabled()


def build(model: CausalLM) -> object | None:
    """The native stack of `model` with its caches attached, or None (reason logged) where the
    model is not one it runs: then every step takes the Python layers."""
    reason = _unsupported(model)
    if reason:
        logger.info("decode steps run layer by layer in Python: %s", reason)
        return None
    cfg = model.cfg
    stack = torch.classes.tokenmill.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                                cfg.rms_norm_eps, _ACTS[cfg.hidden_act], model.attention_layers()[0].scale)
    if model.tp_group is not None:
        stack.set_tensor_parallel(model.tp_group.shm, model.tp_group.name)
    stack.set_amx_rows(kernels.AMX["min_rows"], kernels.AMX_SMALL[1], kernels.AMX_SMALL[0],  # as Linear
                       kernels.AMX["keep_8bit"])
    for i, layer in enumerate(model.model.layers):
        sa = layer.self_attn
        qk = (sa.q_norm.factor(), sa.k_norm.factor()) if sa.qk_norm else (None, None)
        outs = (layer.post_attention_layernorm.factor(), layer.post_feedforward_layernorm.factor()) \
            if layer.sandwich else (None, None)
        stack.add_layer(layer.input_layernorm.factor(), layer.mlp_norm.factor(), sa.attn.k_cache, sa.attn.v_cache,
                        sa.window, sa.rope_index, *qk, *outs)
        if sa.attn.k_smooth is not None:
            stack.set_key_smoothing(sa.attn.q_smooth, sa.attn.k_smooth)
        projections = _projections(layer)
        for proj in projections[:2]:  # qkv, o
            _add(stack, proj)
        if isinstance(layer.mlp, SparseMoE):
            moe = layer.mlp
            shared = moe.shared_expert_gate.weight.data if moe.shared_expert is not None else None
            stack.set_moe(moe.gate.weight.data, moe.top_k, moe.norm_topk, shared)
        for proj in projections[2:]:  # gate_up, down, or every expert's
            _add(stack, proj)
        for j, proj in enumerate(projections[:2] if isinstance(layer.mlp, SparseMoE) else projections):
            if proj.lora is not None:  # adapter slots (layers/lora.py): the stack reads the same tensors
                bank = proj.lora
                stack.set_lora(i, j, bank.a, bank.b, bank.ranks, bank.offsets)
    return stack


def _projections(layer) -> list[Linear]:
    """The layer's projections in stack order; a MoE layer's experts are added after these."""
    attn = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    if isinstance(layer.mlp, SparseMoE):
        experts = [*layer.mlp.experts, *([layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else [])]
        return attn + [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
    return attn + [layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _add(stack, proj: Linear) -> None:
    """stack.cpp's add_projection(kind, q, s, m, bias, perm, float_weight, n, bits, float_min_rows,
    segment, e), then add_part(kind, q, s, m, e, n, bits, segment) for each part of a RowStack: each
    weight format hands over its panels' kind and tensors (`QuantWeight.stack_args`)."""
    bias = None if proj.bias is None else proj.bias.data
    q = proj.qweight
    if q is None:
        return stack.add_projection(StackKind.FLOAT, proj.weight.data, None, None, bias, None, None, proj.out_features,
                                    16, 0, 0, None)
    leaves = q.leaves()
    if leaves[0] is not q:  # parts of different kinds, stacked by output rows
        stack.add_projection(StackKind.STACK, torch.empty(0), None, None, bias, None, proj.float_weight, q.out_features,
                             16, FLOAT_MIN_ROWS, 0, None)
        for part in leaves:
            kind, tensors = part.stack_args()
            p = part.panels
            stack.add_part(kind, *tensors, p.out_features, p.act_bits, p.segment)
        return None
    kind, (t0, s, m, e) = q.stack_args()
    p = q.panels
    return stack.add_projection(kind, t0, s, m, bias, proj.input_perm, proj.float_weight, p.out_features, p.act_bits,
                                FLOAT_MIN_ROWS, p.segment, e)


def _unsupported(model: CausalLM) -> str | None:
    if not enabled():
        return "turned off (TOKENMILL_KERNELS=0 or TOKENMILL_DECODE_STACK=0)"
    if not kernels.available():
        return "the CPU kernels are not built"
    if model.cfg.hidden_act not in _ACTS:
        return f"activation {model.cfg.hidden_act!r}"
    if model.cfg.qk_norm_full or model.cfg.clip_qkv is not None:
        return "whole-projection q/k norms or q/k/v clamping (OLMoE)"
    if model.cfg.attn_softcap is not None:
        return "attention-score soft-capping (Gemma 2) is not in the attention kernels"
    embed = model.model.embed_tokens
    if embed.device.type != "cpu" or embed.dtype != torch.float32:
        return f"the model runs in {embed.dtype} on {embed.device.type} (the stack takes float32 on CPU)"
    if model.tp_group is not None and any(layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None
                                          for layer in model.model.layers):
        return "a row-parallel projection with a bias (added after the all-reduce, which the stack does not)"
    attn = model.attention_layers()[0]
    if attn.k_cache is None or not kernels.supports_attention(torch.float32, attn.k_cache, attn.num_heads):
        return "the KV cache is not one the decode attention kernel reads"
    for layer in model.model.layers:
        for proj in _projections(layer):
            q = proj.qweight
            if q is None and proj.weight.dtype != torch.float32:
                return f"a {proj.weight.dtype} projection"
            if q is not None and any(w.stack_args() is None for w in q.leaves()):
                return "a projection outside the kernels' panel layouts"
    return None
