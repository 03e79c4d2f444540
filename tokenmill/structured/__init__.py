"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a
grammar, by masking the tokens that would leave it (llguidance: see grammar.py for why)."""
