"""Draft proposers for speculative decoding (prompt lookup, draft model)."""
