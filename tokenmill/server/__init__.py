"""OpenAI-compatible HTTP server. Never imports torch, runner/, layers/ or models/: it talks to
the engine only through the EngineClient interface."""
