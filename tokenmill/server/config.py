"""What `tokenmill serve` serves with: one frozen dataclass whose fields generate the serve command's
flags (flags.add_config_args), as the engine's configs generate theirs. The front door's own
flags (connections, body size and time, shutdown: server/transport.py) are shared with the router
and fill the two fields marked `flag=None`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from tokenmill.flags import seconds


def _opt(text: str, **kw) -> dict:
    return {"help": text, **kw}


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = field(default=(), metadata=_opt(
        "name(s) clients use for the model (repeatable; default: the model file name)",
        flag="served-model-name", action="append"))
    api_keys: tuple[str, ...] = field(default=(), metadata=_opt(
        "require 'Authorization: Bearer <key>' or 'x-api-key: <key>' (repeatable; also TOKENMILL_API_KEY, "
        "comma-separated)",
        flag="api-key", action="append"))
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on"))
    port: int = field(default=8000, metadata=_opt("port to listen on"))
    metrics_public: bool = field(default=False, metadata=_opt(
        "serve /metrics without the API key (for a scraper inside a trusted network)"))
    tool_call_parser: str | None = field(default=None, metadata=_opt(
        "how the model writes tool calls (default: the format its chat template renders)",
        choices=["hermes", "llama3_json", "mistral", "qwen3_coder"]))
    reasoning_parser: str | None = field(default=None, metadata=_opt(
        "return a thinking model's <think>...</think> as reasoning_content (default: off)",
        choices=["deepseek_r1", "qwen3"]))
    cache_salt_from_api_key: bool = field(default=False, metadata=_opt(
        "give each API key its own prefix cache (no tenant can probe another's prompts through cache hits); "
        "needs --api-key"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=_opt(
        "browser origins allowed by CORS, e.g. https://app.example.com (repeatable; default: none)", action="append"))
    max_queue_len: int = field(default=1024, metadata=_opt("waiting requests beyond which new ones get 503"))
    request_timeout: float | None = field(default=None, metadata=_opt(
        "seconds a request may take from arrival to its last token; past it the request stops and gets 504 (an "
        "error event if streaming). Default: no limit", type=seconds))
    max_queue_time: float | None = field(default=None, metadata=_opt(
        "seconds a request may wait before it is first scheduled; past it 503. Default: no limit", type=seconds))
    timeout_keep_alive: float = field(default=5.0, metadata=_opt(
        "seconds an idle keep-alive connection stays open", type=seconds))
    lora_modules: tuple[str, ...] = field(default=(), metadata=_opt(
        "LoRA adapters served beside the model, as name=path (a PEFT directory or a llama.cpp LoRA GGUF file) or "
        'JSON {"name": ..., "path": ..., "base_model_name": ...}; requests select one by its name in their model '
        "field. Turns on --enable-lora", action="extend"))
    enable_lora_runtime_updates: bool = field(default=False, metadata=_opt(
        "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; behind the API key when "
        "one is set)"))
    max_request_bytes: int = field(default=8 << 20, metadata=_opt("largest request body", flag=None))
    client_timeout: float = field(default=30.0, metadata=_opt(
        "seconds a client has to send a request's body (its head: transport.py)", flag=None))

    def __post_init__(self) -> None:  # lists from the command line kept as tuples: the config cannot change
        for name in ("served_model_names", "api_keys", "allowed_origins", "lora_modules"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))

    @classmethod
    def from_args(cls, args, **override) -> "ServerConfig":
        """From parsed serve flags (the front door's included); `override`: fields resolved since
        (the API keys with TOKENMILL_API_KEY, the model's name)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**{**given, **override})
