"""Backend-neutral views of a StructuredOutputsParams: its parsed schema, its cache key, choices as grammars.

Shared by the backend plugins through `pagedllm.api.structured_output`, so xgrammar and llguidance read a
request the same way (and a third-party backend can too).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

# The keywords whose values are maps of name -> subschema, and those whose value is a subschema (or a list of
# them): where `disable_additional_properties` must look for nested objects.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "contains", "not", "if", "then", "else",
               "allOf", "anyOf", "oneOf", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def json_schema(params: StructuredOutputsParams) -> dict[str, Any]:
    """The request's JSON schema as a dict (`{"type": "object"}` for json_object), with
    `disable_additional_properties` applied. ValueError names `structured_outputs.json` for bad JSON text."""
    if params.json_object:
        schema: Any = {"type": "object"}
    elif isinstance(params.json, str):
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
    else:
        schema = copy.deepcopy(params.json)
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(schema).__name__}")
    if params.disable_additional_properties:
        _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    """Set additionalProperties: false on every object schema that lists properties and leaves it open."""
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), (dict, list)):
            _close_objects(node[key])
    if "additionalProperties" not in node and isinstance(node.get("properties"), dict):
        node["additionalProperties"] = False


def choice_as_ebnf(choices: list[str]) -> str:
    """An EBNF (GBNF) grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def choice_as_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices`."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def constraint_key(params: StructuredOutputsParams) -> tuple[Any, ...]:
    """What identifies a compiled grammar: the constraint and every option that changes it (not the backend).
    A schema given as a dict is keyed by its JSON text in its own order: xgrammar writes an object's properties
    in the schema's order, so two orders are two grammars. A `keyed_constraint` copy carries its key."""
    key = params.__dict__.get(_KEY)
    return key if key is not None else _key(params)


def keyed_constraint(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """A copy of `params` the engine may share between requests: a dict schema as its JSON text, the key
    computed once and kept on the copy. The frontends make one per distinct constraint: building a dict
    schema's key writes it out as JSON (~20 us for a small schema), and each request's key is read three
    times on its way into the engine. Only such copies keep a key: a caller's own params may be changed in
    place between requests, so theirs is computed afresh. TypeError for a dict that is not JSON."""
    value = params.json
    if params.kind == "json" and not isinstance(value, str):
        value = json.dumps(value)
    keyed = dataclasses.replace(params, json=value)
    keyed.__dict__[_KEY] = _key(keyed)
    return keyed


_KEY = "_constraint_key"


def _key(params: StructuredOutputsParams) -> tuple[Any, ...]:
    value: Any = getattr(params, params.kind)
    if params.kind == "json" and not isinstance(value, str):
        value = json.dumps(value)
    elif params.kind == "choice":
        value = tuple(value)
    return (params.kind, value, params.disable_any_whitespace, params.disable_additional_properties,
            params.whitespace_pattern)
