"""tokenmill: a small, fast LLM inference engine (paged KV cache, continuous batching) with
vLLM's API: `LLM(...).generate(...)` (or `.embed` / `.score` for pooling models) offline,
`tokenmill serve` for an OpenAI-compatible server.

The public names load on first use (PEP 562), so processes that never run a model — the router,
the CLI's argument parsing — do not pay for importing torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"LLM": "tokenmill.engine.llm", "SamplingParams": "tokenmill.sampling_params",
            "StructuredOutputsParams": "tokenmill.sampling_params", "RequestOutput": "tokenmill.outputs",
            "CompletionOutput": "tokenmill.outputs", "PoolingParams": "tokenmill.pooling_params",
            "PoolingRequestOutput": "tokenmill.outputs", "LoRARequest": "tokenmill.lora_request"}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.lora_request import LoRARequest
    from tokenmill.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
