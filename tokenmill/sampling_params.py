"""SamplingParams: what a user may ask of one generation, validated at the door.

Mirrors vLLM's class so that users can switch without rewriting call sites. Every field is
checked in `__post_init__`, so a bad value fails with a `ValueError` naming the field before the
request ever reaches the engine.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

# Temperatures below this sample greedily: logits / T overflows float32 for tiny T (1e-40 gave NaN and
# token 0), and below vLLM's own floor of 0.01 sampling is greedy in all but name anyway.
MIN_TEMPERATURE = 1e-2
MAX_N = 128             # OpenAI's limit on parallel samples per request
SEED_RANGE = (-2**63, 2**63 - 1)  # what a torch.Generator takes, for the parent's seed and each child's
# Every generated token is checked against every stop string (and held back while it may be the
# start of one), so their number and length are what one request can make each token cost.
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024   # entries; OpenAI's range of a bias is [-100, 100]
MAX_CHOICES = 4096
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass
class StructuredOutputsParams:
    """A constraint on the text a request may generate (vLLM's `StructuredOutputsParams`): exactly
    one of a JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a
    regular expression (`regex`), one string out of a list (`choice`) or a grammar (`grammar`: Lark
    syntax, or llama.cpp's GBNF — a grammar defining `root ::=` is read as GBNF).
    `disable_any_whitespace`: JSON without whitespace between tokens (the compact form); otherwise
    `whitespace_pattern`, by default at most one newline and an indent per gap (structured/grammar.py).
    `disable_additional_properties` (vLLM's name, default true): an object schema that lists its
    properties and says nothing of others admits only those (structured/schema.py)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None  # JSON: the regex whitespace between tokens must match
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {kinds or 'none'}.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(self.json).__name__}.")
            if len(json.dumps(self.json)) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.json may be at most {MAX_GRAMMAR_CHARS} characters of JSON.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of at most "
                                 f"{MAX_GRAMMAR_CHARS} characters.")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings.")
        if (self.json_object not in (None, True, False) or not isinstance(self.disable_any_whitespace, bool)
                or not isinstance(self.disable_additional_properties, bool)):
            raise ValueError("structured_outputs.json_object, disable_any_whitespace and disable_additional_properties "
                             "must be booleans.")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or len(self.whitespace_pattern) > 1024):
            raise ValueError("structured_outputs.whitespace_pattern must be a regex of at most 1024 characters.")

    @functools.cached_property
    def key(self) -> str:
        """What identifies the compiled grammar (the cache key; computed once: a schema may be
        large, and the server, the engine and the runner each look it up)."""
        return json.dumps([self.json, self.regex, self.choice, self.grammar, bool(self.json_object),
                           self.disable_any_whitespace, self.whitespace_pattern, self.disable_additional_properties],
                          sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, [-100, 100] (OpenAI)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)
        self._validate()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r:.200}.")  # not a 600k-item echo

        def integer(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool)

        # NaN and infinities pass Python's JSON parser and every `<` test: each float must be finite
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if not integer("n") or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0 (0, and anything below 0.01, means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not integer("top_k") or self.top_k < 0:
            raise bad("top_k", "must be -1/0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not integer("max_tokens") or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not integer("min_tokens") or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and (not integer("logprobs") or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.seed is not None:
            lo, hi = SEED_RANGE
            if not integer("seed") or not lo <= self.seed <= hi - (self.n - 1):  # child i takes seed + i
                raise bad("seed", f"must be an integer in [{lo}, {hi}]" + (f" minus n - 1 = {self.n - 1}"
                                                                            if self.n > 1 else ""))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r:.200}.")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}")
        if any(len(s) > MAX_STOP_LEN for s in self.stop_strings):
            raise bad("stop", f"strings may be at most {MAX_STOP_LEN} characters long")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r:.200}.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def constrained(self) -> bool:
        return self.structured_outputs is not None

    def child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n parallel samples: n=1, and a distinct seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(**{**self._init_kwargs(), "n": 1, "seed": seed})

    def _init_kwargs(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}


def _logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's map of token id (a JSON key, so a string) to a bias in [-100, 100]."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}.")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r:.50}.") from None
        if token < 0 or isinstance(key, bool) or (isinstance(key, float) and not key.is_integer()):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r:.50}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r:.50} for token {token}.")
        out[token] = float(value)
    return out
