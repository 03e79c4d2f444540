"""JSON schemas as clients send them, made into what they mean: objects that list their properties
admit only those unless the schema says otherwise.

Clients build schemas from pydantic models and tool signatures without `additionalProperties`;
by the letter of JSON Schema such an object admits any other key, and a sampled model then adds
keys until max_tokens. vLLM's default backend forbids unlisted properties unless the request says
`disable_additional_properties: false`; tokenmill does the same, here, before llguidance reads the schema.
"""
from __future__ import annotations

# Subschema positions of JSON Schema (2020-12 and draft-07): where a walk finds schemas, not names
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MANY = ("anyOf", "oneOf", "prefixItems")  # allOf's members are parts of one object: closed as a whole
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema):
    """A copy of a JSON schema in which every object schema that lists properties and says
    nothing of others (no additionalProperties, no unevaluatedProperties) admits only those: what
    vLLM's default backend does and most clients assume when they send a pydantic model's schema.
    allOf's members are not closed one by one: each lists only part of the object."""
    return _close(schema, closable=True)


def _close(s, closable: bool):
    """`closable`: false for allOf's members (and a schema beside allOf or $ref is left open too:
    its properties are only part of the object)."""
    if not isinstance(s, dict):
        return [_close(x, True) for x in s] if isinstance(s, list) else s
    out = {}
    for key, value in s.items():
        if key in _ONE and isinstance(value, (dict, list)):
            out[key] = _close(value, True)
        elif key in _MANY and isinstance(value, list):
            out[key] = [_close(x, True) for x in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(x, False) for x in value]
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: _close(sub, True) for name, sub in value.items()}
        else:
            out[key] = value
    if (closable and ("properties" in s or "patternProperties" in s) and "allOf" not in s and "$ref" not in s
            and "additionalProperties" not in s and "unevaluatedProperties" not in s):
        out["additionalProperties"] = False
    return out
