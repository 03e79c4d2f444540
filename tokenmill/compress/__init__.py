"""Offline model tools: evaluation (perplexity) first; quantize / prune / distill build on it."""
