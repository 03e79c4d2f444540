"""Structured outputs and logit_bias in the engine: constrained outputs always parse and validate,
compose with sampling and speculative decoding, and a constraint that fails fails only its request."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis_jsonschema import from_schema

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

# JSON schemas, described as a JSON schema whose instances hypothesis-jsonschema draws: objects,
# arrays, enums, nesting, required/optional properties, string patterns, bounded numbers. Strings,
# numbers (a multiple of 0.25: JSON Schema has no other bound on a fraction's digits),
# arrays and integers are bounded so that a sampled output ends within max_tokens (an unbounded
# integer lets a model at temperature 1 write digits until it runs out).
_LEAF = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "string"}, "maxLength": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 6}},
     "required": ["type", "maxLength"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "string"}, "pattern": {"enum": [
        "^[a-z]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^[A-Z][a-z]{0,3}$"]}},
     "required": ["type", "pattern"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "integer"}, "minimum": {"type": "integer", "minimum": -50,
                                                                                "maximum": 0},
                                      "maximum": {"type": "integer", "minimum": 1, "maximum": 500}},
     "required": ["type", "maximum"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "number"}, "minimum": {"const": 0},
                                      "maximum": {"type": "integer", "minimum": 1, "maximum": 100},
                                      "multipleOf": {"const": 0.25}},
     "required": ["type", "minimum", "maximum", "multipleOf"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "boolean"}}, "required": ["type"],
     "additionalProperties": False},
    {"type": "object", "properties": {"enum": {"type": "array", "minItems": 1, "maxItems": 4, "uniqueItems": True,
                                               "items": {"enum": ["red", "green", 7, True, None, "a b"]}}},
     "required": ["enum"], "additionalProperties": False},
]}
_NAMES = {"enum": ["id", "name", "tags", "x", "value", "ok"]}


def _object_of(item: dict) -> dict:
    return {"type": "object",
            "properties": {"type": {"const": "object"},
                           "properties": {"type": "object", "propertyNames": _NAMES, "additionalProperties": item,
                                          "minProperties": 1, "maxProperties": 3},
                           "required": {"type": "array", "items": _NAMES, "uniqueItems": True, "maxItems": 2},
                           "additionalProperties": {"const": False}},
            "required": ["type", "properties", "additionalProperties"], "additionalProperties": False}


def _array_of(item: dict) -> dict:
    return {"type": "object",
            "properties": {"type": {"const": "array"}, "items": item,
                           "minItems": {"type": "integer", "minimum": 0, "maximum": 1},
                           "maxItems": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["type", "items", "maxItems"], "additionalProperties": False}


_LEVEL1 = {"anyOf": [_object_of(_LEAF), _array_of(_LEAF)]}
META_SCHEMA = {"anyOf": [_object_of({"anyOf": [_LEAF, _LEVEL1]}), _array_of(_LEVEL1)]}


def _fix_required(schema):
    """Keep only required names that are properties (the meta-schema cannot say that itself)."""
    if isinstance(schema, dict):
        if "required" in schema and "properties" in schema:
            schema["required"] = [n for n in schema["required"] if n in schema["properties"]]
        for value in schema.values():
            _fix_required(value)
    elif isinstance(schema, list):
        for value in schema:
            _fix_required(value)
    return schema


@pytest.fixture(scope="module")
def tiny(tiny_llama_tok):
    return LLM(tiny_llama_tok, kv_cache_memory="64MiB")


def _text(out) -> str:
    """The byte tokenizer's end token is byte 0, an ordinary (not special) token: it ends the
    text the model produced. Real models' end tokens are special and never appear in the text."""
    return out.outputs[0].text.removesuffix("\x00")


# no shrinking: each example runs the model, and a failing one is printed whole
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


@settings(max_examples=30, **_SETTINGS)
@given(schemas=st.lists(from_schema(META_SCHEMA).map(_fix_required), min_size=8, max_size=8),
       compact=st.booleans())
def test_json_schema_outputs_always_validate(tiny, schemas, compact):
    """Temperature 1 on a random model: whatever it would say, the output parses and validates.
    Whitespace is compact or bounded: JSON's own whitespace is unbounded, and a random model
    would spend max_tokens on it (the reason `disable_any_whitespace` exists)."""
    ws = None if compact else r"[ \n\t]{0,3}"
    params = [SamplingParams(temperature=1.0, max_tokens=400, seed=i, structured_outputs=StructuredOutputsParams(
        json=s, disable_any_whitespace=compact, whitespace_pattern=ws)) for i, s in enumerate(schemas)]
    outs = tiny.generate(["x"] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text, out.error)
        jsonschema.validate(json.loads(_text(out)), schema)


@settings(max_examples=20, **_SETTINGS)
@given(pattern=st.sampled_from([r"[a-c]{1,4}-[0-9]{2}", r"(cat|dog)s?", r"\d{1,3}(\.\d{1,2})?", r"[A-Z][a-z]+ [A-Z]",
                                r"(ab|c)*d"]),
       choices=st.lists(st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6),
                        min_size=1, max_size=5, unique=True))
def test_regex_and_choice_outputs_always_match(tiny, pattern, choices):
    outs = tiny.generate(["x"] * 8, [SamplingParams(temperature=1.0, max_tokens=200, seed=i, structured_outputs=(
        StructuredOutputsParams(regex=pattern) if i % 2 else StructuredOutputsParams(choice=choices)))
        for i in range(8)])
    for i, out in enumerate(outs):
        text = _text(out)
        assert re.fullmatch(pattern, text) if i % 2 else text in choices, (pattern, choices, text)


def test_grammars_lark_and_gbnf(tiny):
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/'
    gbnf = 'root ::= ("yes" | "no") "!"'
    outs = tiny.generate(["x"] * 6, [SamplingParams(temperature=1.0, max_tokens=50, seed=i,
                                                    structured_outputs=StructuredOutputsParams(grammar=g))
                                     for i, g in enumerate([lark, gbnf] * 3)])
    for i, out in enumerate(outs):
        assert re.fullmatch(r"(hi|hello) [a-z]{2,5}" if i % 2 == 0 else r"(yes|no)!", _text(out))


def test_bad_constraints_are_refused_before_anything_runs(tiny):
    engine = tiny.engine
    for spec, words in ((dict(regex="(("), "unclosed group"), (dict(grammar="start: nope"), "nope"),
                        (dict(json={"type": "object", "properties": {"a": {"type": "strng"}}}), "strng")):
        with pytest.raises(ValueError, match=words):
            engine.add_request("bad", "x", SamplingParams(structured_outputs=spec))
    for kw, words in ((dict(regex="a", choice=["b"]), "exactly one"), (dict(json="{"), "not valid JSON"),
                      (dict(choice=[]), "choice"), (dict(grammar=""), "grammar")):
        with pytest.raises(ValueError, match=words):
            StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request("bad", "x", SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"}))
    with pytest.raises(ValueError, match="logit_bias keys must be token ids below"):
        engine.add_request("bad", "x", SamplingParams(logit_bias={300: 1.0}))
    for bias, words in (({"a": 1}, "token ids"), ({1: 101}, r"\[-100, 100\]"), ({-1: 1}, "non-negative")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(logit_bias=bias)
    assert not engine.has_unfinished_requests()


def _accepts(tiny, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint's matcher takes `text` whole and may end there (the byte tokenizer:
    one token per byte, its id the byte)."""
    matcher = tiny.engine.grammars.matcher(spec)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def test_objects_admit_only_their_listed_properties_unless_opened(tiny):
    """An object schema that lists properties and says nothing of others admits only those (vLLM's
    default; clients send pydantic schemas so): at every depth, in $defs, not in allOf's parts.
    disable_additional_properties=False or the schema's own additionalProperties opens them."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name"]}
    schema = {"type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
              "$defs": {"P": person}}
    closed = StructuredOutputsParams(json=schema)
    assert _accepts(tiny, closed, '{"people": [{"name": "a", "age": 3}]}')
    assert not _accepts(tiny, closed, '{"people": [{"name": "a", "extra": 1}]}')
    assert not _accepts(tiny, closed, '{"people": [], "more": true}')
    opened = StructuredOutputsParams(json=schema, disable_additional_properties=False)
    assert _accepts(tiny, opened, '{"people": [{"name": "a", "extra": 1}], "more": true}')
    explicit = StructuredOutputsParams(json={**person, "additionalProperties": {"type": "integer"}})
    assert _accepts(tiny, explicit, '{"name": "a", "n": 1}') and not _accepts(tiny, explicit, '{"name": "a", "n": "x"}')
    parts = StructuredOutputsParams(json={"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                                    {"type": "object", "properties": {"b": {"type": "integer"}}}]})
    assert _accepts(tiny, parts, '{"a": 1, "b": 2}')
    named = StructuredOutputsParams(json={"type": "object", "properties": {"properties": {"type": "integer"}}})
    assert _accepts(tiny, named, '{"properties": 1}') and not _accepts(tiny, named, '{"x": 1}')
    assert schema["$defs"]["P"] == person and "additionalProperties" not in schema  # the caller's dict untouched


def test_json_whitespace_is_bounded_by_default(tiny):
    """Between JSON tokens at most one newline and an indent (llama.cpp's grammars' bound): a
    sampled model cannot pad until max_tokens. whitespace_pattern and disable_any_whitespace as before."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "array"}}})
    assert _accepts(tiny, spec, '{"a":[1,2]}') and _accepts(tiny, spec, '{\n  "a": [\n    1,\n    2\n  ]\n}')
    assert not _accepts(tiny, spec, '{\n\n  "a": [1]}') and not _accepts(tiny, spec, '{' + ' ' * 40 + '"a": [1]}')
    wide = StructuredOutputsParams(json=spec.json, whitespace_pattern=r"[ \n]*")
    assert _accepts(tiny, wide, '{\n\n\n  "a": [1]}')
    compact = StructuredOutputsParams(json=spec.json, disable_any_whitespace=True)
    assert _accepts(tiny, compact, '{"a":[1]}') and not _accepts(tiny, compact, '{"a": [1]}')
    assert not _accepts(tiny, StructuredOutputsParams(json_object=True), '{' + '\n' * 3 + '}')


def test_logit_bias_bans_and_forces_tokens(tiny):
    base = tiny.generate(["hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    banned = tiny.generate(["hello"], SamplingParams(temperature=0, max_tokens=8,
                                                     logit_bias={base[0]: -100}))[0].outputs[0].token_ids
    assert banned[0] != base[0] and base[0] not in banned
    forced = tiny.generate(["hello"], SamplingParams(temperature=1.0, max_tokens=8, seed=3,
                                                     logit_bias={ord("q"): 100}))[0].outputs[0].text
    assert forced == "q" * 8


def test_dead_end_fails_only_its_request(tiny):
    """"ab" then the end, but min_tokens bans the end: nothing is allowed, the request fails with
    a clear error, the others in its batch finish."""
    outs = tiny.generate(["x", "y"], [
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["ab"]}),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{3}"})])
    assert outs[0].outputs[0].finish_reason == "error" and "dead end" in (outs[0].error or "")
    assert re.fullmatch("[a-z]{3}", _text(outs[1])) and outs[1].outputs[0].finish_reason == "stop"


def test_constrained_greedy_is_the_same_with_speculation(tiny_llama_tok):
    """Drafts are checked against the grammar position by position: greedy constrained outputs
    with prompt lookup equal those without, token for token."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["ab", "abc", "b"]},
                                                     "maxItems": 12}}, "required": ["a"]}
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": schema}),
              SamplingParams(temperature=0, max_tokens=60, structured_outputs={"regex": "(ab){2,20}c"})]
    prompts = ['{"a": ["ab", "ab", "ab", "abc", "ab"]}', "abababababc"]
    plain = LLM(tiny_llama_tok, kv_cache_memory="64MiB").generate(prompts, params)
    spec = LLM(tiny_llama_tok, kv_cache_memory="64MiB", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False})
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in out) > 0


def test_preempted_constrained_requests_replay_their_grammar(tiny_llama_tok):
    """A cache too small for the batch preempts requests; each comes back with a fresh matcher fed
    its output so far, and greedy outputs equal those of a roomy cache."""
    schema = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 20, "maxItems": 20}
    params = SamplingParams(temperature=0, max_tokens=300, structured_outputs={"json": schema,
                                                                               "disable_any_whitespace": True})
    prompts = [f"list {i}: " + "abc " * 20 for i in range(8)]
    roomy = LLM(tiny_llama_tok, kv_cache_memory="64MiB").generate(prompts, params, use_tqdm=False)
    small = LLM(tiny_llama_tok, kv_cache_memory="160KiB", max_num_batched_tokens=128)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for o in outs:
        assert len(json.loads(_text(o))) == 20
