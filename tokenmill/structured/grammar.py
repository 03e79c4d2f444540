"""Constraints compiled into token matchers, on llguidance.

Why llguidance (measured in benchmarks/RESULTS.md, structured outputs): it builds no automaton
over the vocabulary ahead of time — a grammar is parsed in about a millisecond and each token mask
is computed on demand (an Earley parser over a lazily built lexer, tens of microseconds a token),
so a first request with a new schema costs nothing noticeable, where outlines-core compiles an
index over the whole vocabulary per schema first. It reads JSON schema, regex, Lark and (through its
converter) llama.cpp's GBNF; it rolls matchers back token by token, which speculative decoding
needs; and it is one dependency-free wheel (xgrammar requires transformers and triton).

A `GrammarCompiler` belongs to one tokenizer. `compile` turns a StructuredOutputsParams into a
pristine matcher (cached by the constraint, LRU), raising ValueError with llguidance's message for
a constraint it cannot take; `matcher` hands out a fresh copy for one request.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.schema import close_objects

CACHE_SIZE = 256
# JSON's whitespace between tokens by default: at most one newline and an indent (llama.cpp's
# schema grammars bound it alike). Unbounded, a model sampled at temperature 1 pads with newlines
# and spaces until max_tokens; bounded, every gap still admits pretty-printed JSON.
BOUNDED_WHITESPACE = r"\n?[ \t]{0,20}"
_GBNF_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)


def to_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint."""
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    elif not spec.disable_any_whitespace:
        options["whitespace_pattern"] = BOUNDED_WHITESPACE
    if spec.json is not None:
        schema = close_objects(spec.json) if spec.disable_additional_properties else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else
                                                            json.dumps(schema), defaults=options)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    lark = any_to_lark(spec.grammar) if _GBNF_RULE.search(spec.grammar) else spec.grammar
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's: padded rows are
        never allowed). Building llguidance's token trie takes a while for a large vocabulary,
        so it happens on the first compile, off the engine thread when the server calls."""
        self._args = (tokenizer_json, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                text, vocab, eos = self._args
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint; ValueError naming the problem if it has one."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            grammar = to_grammar(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: the constraint does not compile: {_first_lines(matcher.get_error())}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request."""
        return self.compile(spec).deep_copy()


def _first_lines(text: str, n: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:n])
