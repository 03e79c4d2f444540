"""ArchConfig: the handful of numbers and flags one decoder implementation needs, read from a
Hugging Face `config.json` or from GGUF metadata. Unknown architectures are refused here, early,
with the list of supported ones."""
from __future__ import annotations

from dataclasses import dataclass

# HF `architectures[0]` / GGUF `general.architecture` -> our family name
SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "GemmaForCausalLM": "gemma",
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma": "gemma",
}
# The rotary table is precomputed for every position the model declares, so a corrupt file's
# context length would be an allocation of its own; no model tokenmill loads declares more.
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
    sliding_window: int | None = None

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
            heads = cfg["num_attention_heads"]
            rope = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            return cls(
                family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rope_scaling=scaling,
                tie_word_embeddings=cfg.get("tie_word_embeddings", family == "gemma"),
                qkv_bias=family == "qwen2" or cfg.get("attention_bias", False),
                hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
                norm_offset=1.0 if family == "gemma" else 0.0,
                embed_scale=family == "gemma",
                sliding_window=cfg.get("sliding_window") if family == "llama" else None,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}.") from None

    @classmethod
    def from_gguf(cls, meta: dict, vocab_size: int, has_output: bool) -> "ArchConfig":
        arch = meta.get("general.architecture", "?")
        family = cls.family_of(arch)

        def get(key: str, default=None):
            v = meta.get(f"{arch}.{key}", default)
            if v is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete.")
            return v

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                       or hidden // heads)
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        return cls(
            family=family, vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
            num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")), rope_scaling=scaling,
            tie_word_embeddings=not has_output, qkv_bias=family == "qwen2",
            hidden_act="gelu_pytorch_tanh" if family == "gemma" else "silu",
            # llama.cpp's converter already folds Gemma's +1 into the stored norm weights
            norm_offset=0.0, embed_scale=family == "gemma",
        )
