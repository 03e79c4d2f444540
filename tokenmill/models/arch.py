"""ArchConfig: the handful of numbers and flags one decoder implementation needs, read from a
Hugging Face `config.json` or from GGUF metadata. Unknown architectures are refused here, early,
with the list of supported ones."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.layers import rotary

# HF `architectures[0]` / GGUF `general.architecture` -> our family name
SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
    "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
    "olmoe": "olmoe",
}
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
GEMMAS = ("gemma", "gemma2", "gemma3")
# The rotary angles are computed per step, but the declared context still sizes what the engine
# admits; no model tokenmill loads declares more than this (a larger value is a corrupt file).
MAX_POSITIONS = 1 << 20


@dataclass(frozen=True)
class ArchConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    hidden_act: str = "silu"
    norm_offset: float = 0.0          # Gemma: x * (1 + w)
    embed_scale: bool = False         # Gemma: embeddings * sqrt(hidden_size)
    rotary_dim: int = 0               # dimensions of a head that rotate (0: all; Phi-4-mini: 3/4)
    qk_norm: bool = False             # Qwen3, Gemma 3: RMSNorm of each q and k head before the rotary
    sandwich_norms: bool = False      # Gemma 2/3: norms after attention and MLP too (four per layer)
    attn_scale: float | None = None   # None: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None   # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = global; () = all global
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rotary base (no scaling there)
    qk_norm_full: bool = False        # OLMoE: RMSNorm over the whole q and k projections
    clip_qkv: float | None = None     # OLMoE: q, k, v clamped to [-clip, clip]
    num_experts: int = 0              # mixture of experts (models/moe.py); 0: dense
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalise the k routing weights to sum to 1
    shared_expert_size: int = 0       # Qwen2-MoE: a sigmoid-gated shared expert of this width
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model

    def __post_init__(self) -> None:
        """Sizes a model file declares are checked before anything is allocated for them."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the model declares {name} = {value!r:.50}; it must be a positive integer.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"the model declares {self.num_heads} attention heads, not a multiple of its "
                             f"{self.num_kv_heads} KV heads.")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"the model declares a context of {self.max_position_embeddings} positions; tokenmill "
                             f"loads models of up to {MAX_POSITIONS} (a larger value is usually a corrupt file).")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"the model's rotary dimension {self.rotary_dim} does not fit its head size {self.head_dim}.")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"the model declares sliding windows {self.layer_windows!r:.80} for {self.num_layers} layers.")
        rotary.scaling_kind(self.rope_scaling)  # an unknown scaling is refused at load, not at the first step
        if self.num_experts and not (0 < self.experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(f"the model declares {self.experts_per_tok} of {self.num_experts} experts per token "
                             f"of width {self.moe_intermediate_size}.")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 when it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares, when every layer slides (Mistral); None otherwise. Only
        then can a sequence's blocks before the window be given back."""
        w = set(self.layer_windows)
        return w.pop() if len(w) == 1 and 0 not in w and self.layer_windows else None

    @property
    def context_length(self) -> int:
        """Positions the model serves: its declared context, extended by a RoPE scaling that
        stretches it (as vLLM derives it: linear and dynamic multiply the declared length, YaRN the
        original one; LongRoPE and Llama 3 models declare the extended length already)."""
        s = self.rope_scaling or {}
        kind, factor = rotary.scaling_kind(s), float(s.get("factor") or 1.0)
        if kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if kind == "yarn":
            return max(self.max_position_embeddings,
                       int(s.get("original_max_position_embeddings", self.max_position_embeddings) * factor))
        return self.max_position_embeddings

    @staticmethod
    def family_of(name: str) -> str:
        if name not in SUPPORTED:
            known = sorted(k for k in SUPPORTED if k[0].isupper())
            raise ValueError(f"Unsupported model architecture {name!r}. tokenmill supports {known} "
                             f"(GGUF: {sorted(k for k in SUPPORTED if k[0].islower())}).")
        return SUPPORTED[name]

    @classmethod
    def from_hf(cls, cfg: dict) -> "ArchConfig":
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        family = cls.family_of(archs[0])
        try:
            heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            rope, local_rope = _hf_rope(cfg, family)
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
            elif "original_max_position_embeddings" not in scaling and cfg.get("original_max_position_embeddings"):
                scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
            gemma = family in GEMMAS
            query_scalar = cfg.get("query_pre_attn_scalar") if family in ("gemma2", "gemma3") else None
            return cls(
                family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_layers=layers,
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rope_scaling=scaling,
                tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
                qkv_bias=family == "qwen2" or (family == "qwen2_moe" and cfg.get("qkv_bias", True))
                or bool(cfg.get("attention_bias", False)),
                hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
                norm_offset=1.0 if gemma else 0.0, embed_scale=gemma,
                rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
                qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"), sandwich_norms=family in ("gemma2", "gemma3"),
                attn_scale=float(query_scalar) ** -0.5 if query_scalar else None,
                attn_softcap=cfg.get("attn_logit_softcapping") if family == "gemma2" else None,
                final_softcap=cfg.get("final_logit_softcapping") if family == "gemma2" else None,
                layer_windows=_hf_windows(cfg, family, layers),
                local_rope_theta=float(local_rope["rope_theta"]) if local_rope else None,
                **_hf_moe(cfg, family, layers),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}.") from None

    @classmethod
    def from_gguf(cls, meta: dict, vocab_size: int, has_output: bool,
                  rope_factors: tuple[list[float], list[float]] | None = None,
                  dense_layers: tuple[int, ...] = ()) -> "ArchConfig":
        """llama.cpp's metadata. What GGUF does not record is llama.cpp's own per-architecture rule,
        taken the same way here: Gemma 2 slides on every other layer and Gemma 3 on five of six,
        Gemma 3's local layers rotate with base 10000 (unless `rope.freq_base_swa` is there,
        and the pattern can be given as `attention.sliding_window_pattern`), the attention scale is head_dim ** -0.5
        unless `attention.scale` says otherwise, and Gemma's norm weights already hold the +1."""
        arch = meta.get("general.architecture", "?")
        family = cls.family_of(arch)
        experts = int(meta.get(f"{arch}.expert_count") or 0)
        if family == "llama" and experts:
            family = "mixtral"  # llama.cpp writes Mixtral as a llama with experts

        def get(key: str, default=None):
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete.")
            return v

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        layers = int(get("block_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
        scaling = None
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind in ("linear", "yarn"):
            scaling = {"rope_type": kind, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
            if meta.get(f"{arch}.rope.scaling.original_context_length"):
                scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
        elif kind not in (None, "none"):
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported for {arch}.")
        if rope_factors is not None:  # Phi-3: LongRoPE, its factors stored as tensors
            scaling = {"rope_type": "longrope", "short_factor": rope_factors[0], "long_factor": rope_factors[1],
                       "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
            if meta.get(f"{arch}.rope.scaling.attn_factor"):
                scaling["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
        window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if not window:
            windows: tuple[int, ...] = ()
        elif isinstance(pattern, (list, tuple)):  # per layer: True = sliding
            windows = tuple(window if p else 0 for p in pattern)
        else:  # every n-th layer global (llama.cpp's defaults: Gemma 2 every 2nd, Gemma 3 every 6th)
            n = int(pattern) if pattern else {"gemma2": 2, "gemma3": 6}.get(family, 0)
            windows = tuple(window if not n or (i + 1) % n else 0 for i in range(layers))
        scale = meta.get(f"{arch}.attention.scale")
        gemma = family in GEMMAS
        return cls(
            family=family, vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")), num_layers=layers,
            num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")), rope_scaling=scaling,
            tie_word_embeddings=not has_output, qkv_bias=family in ("qwen2", "qwen2_moe"),
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            # llama.cpp's converter already folds Gemma's +1 into the stored norm weights
            norm_offset=0.0, embed_scale=gemma,
            rotary_dim=rope_dim if rope_dim != head_dim else 0,
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"), sandwich_norms=family in ("gemma2", "gemma3"),
            attn_scale=float(scale) if scale else None,
            attn_softcap=float(meta[f"{arch}.attn_logit_softcapping"]) if meta.get(f"{arch}.attn_logit_softcapping") else None,
            final_softcap=float(meta[f"{arch}.final_logit_softcapping"]) if meta.get(f"{arch}.final_logit_softcapping") else None,
            layer_windows=windows,
            local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if family == "gemma3" else None,
            qk_norm_full=family == "olmoe",
            clip_qkv=float(meta[f"{arch}.attention.clamp_kqv"]) if meta.get(f"{arch}.attention.clamp_kqv") else None,
            num_experts=experts, experts_per_tok=int(meta.get(f"{arch}.expert_used_count") or 0),
            moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length") or 0) or
            (int(get("feed_forward_length")) if experts else 0),
            # llama.cpp renormalises the top-k weights of Qwen3-MoE and Mixtral, not of Qwen2-MoE or OLMoE
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", family in ("qwen3_moe", "mixtral"))),
            shared_expert_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            dense_layers=dense_layers if experts else (),
        )

def _hf_rope(cfg: dict, family: str) -> tuple[dict, dict | None]:
    """(the global layers' rotary parameters, the local layers' when they differ): from
    `rope_parameters` (transformers 5; per layer type for Gemma 3) or the older `rope_theta` /
    `rope_scaling` / `rope_local_base_freq` fields."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention")
        return full, (local if local and local != full else None)
    rope = {**(cfg.get("rope_scaling") or {}), **params}
    if "rope_theta" in cfg and "rope_theta" not in rope:
        rope["rope_theta"] = cfg["rope_theta"]
    local = None
    if family == "gemma3":
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return rope, local


def _hf_windows(cfg: dict, family: str, layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows from `layer_types` (transformers 5) or each family's older rule."""
    window = cfg.get("sliding_window") or 0
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = 0
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"config.json lists {len(types)} layer_types for {layers} layers.")
        sliding = [t == "sliding_attention" for t in types]
    elif family == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    elif family == "gemma3":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif family in ("qwen2", "qwen3"):
        sliding = [i >= cfg.get("max_window_layers", 0) for i in range(layers)]
    else:  # Mistral, Phi-3: every layer
        sliding = [True] * layers
    windows = tuple(int(window) if s else 0 for s in sliding)
    return windows if any(windows) else ()


def _hf_moe(cfg: dict, family: str, layers: int) -> dict:
    """The mixture-of-experts fields of each MoE family's config.json."""
    if family not in MOE:
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step") or 1
    dense = tuple(i for i in range(layers) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
    return dict(
        num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 0),
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        norm_topk_prob=True if family == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        shared_expert_size=(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
        dense_layers=dense, qk_norm_full=family == "olmoe",
        clip_qkv=cfg.get("clip_qkv") if family == "olmoe" else None,
    )
