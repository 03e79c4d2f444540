"""The engine loop (LLMEngine), its asynchronous front (AsyncEngine) and the offline `LLM` API."""
