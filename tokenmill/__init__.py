"""tokenmill: a small, fast LLM inference engine (paged KV cache, continuous batching) with
vLLM's API: `LLM(...).generate(...)` offline, `tokenmill serve` for an OpenAI-compatible server."""
from tokenmill.engine.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
