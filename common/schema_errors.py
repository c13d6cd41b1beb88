"""A pydantic validation error in plain words: the dotted key (`train.mlp.max_epochs`,
`draft.sweep[0].family`) and what it takes, read from the model's JSON schema (kind, range,
choices, null), or the keys it knows where a key is unknown."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel


CROSS_KEY = "cross_key"  # the error type of a rule over several keys of one section: its
# message names the key and says what is wrong


def dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out or "(top level)"


def problem(model: type[BaseModel], error: dict) -> str:
    """'expected <what the key takes>, got <value>' for one pydantic error."""
    if error["type"] == "extra_forbidden":
        known = _known_keys(model, error["loc"][:-1])
        return f"unknown key (known: {', '.join(known)})"
    if error["type"] == "missing":
        return "required key missing"
    if error["type"] == CROSS_KEY:
        return error["msg"]
    return f"expected {_expected(model, error['loc'])}, got {_shown(error.get('input'))}"


def _shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value) if not isinstance(value, (dict, list)) else type(value).__name__


def _schema_at(model: type[BaseModel], loc: tuple) -> dict:
    """The JSON schema of the key at `loc` (references and optional values resolved)."""
    root = model.model_json_schema()
    node = root
    for part in loc:
        node = _resolve(root, node)
        if isinstance(part, int):
            node = node.get("items", {})
        elif "properties" in node:
            node = node["properties"].get(part, {})
        else:
            node = node.get("additionalProperties", {}) or {}
    return _resolve(root, node)


def _resolve(root: dict, node: dict) -> dict:
    while True:
        if "$ref" in node:
            node = root["$defs"][node["$ref"].split("/")[-1]]
        elif "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            nullable = len(options) < len(node["anyOf"])
            node = {**_resolve(root, options[0]), "nullable": nullable,
                    **({"description": node["description"]} if "description" in node else {})}
            return node
        else:
            return node


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    return sorted(_schema_at(model, tuple(loc)).get("properties", {}))


_KINDS = {"integer": "an integer", "number": "a number", "string": "a string",
          "boolean": "true or false", "object": "a mapping", "array": "a list"}


def _expected(model: type[BaseModel], loc: tuple) -> str:
    """Plain words for what the key at `loc` takes: kind, range, choices, null."""
    schema = _schema_at(model, tuple(loc))
    if "description" in schema:
        text = schema["description"]
    elif "enum" in schema or "const" in schema:
        choices = schema.get("enum", [schema.get("const")])
        text = "one of " + ", ".join(repr(c) for c in choices)
    else:
        text = _KINDS.get(schema.get("type"), "a value")
        if schema.get("type") == "array":
            item = _resolve(model.model_json_schema(), schema.get("items", {}))
            text += f" of {_plural(item)}" + (
                f" (at least {schema['minItems']})" if schema.get("minItems") else "")
        text += _bounds(schema)
    return text + (" or null" if schema.get("nullable") else "")


def _plural(item: dict) -> str:
    words = {"integer": "integers", "number": "numbers", "string": "strings",
             "object": "mappings", "boolean": "booleans"}
    if "enum" in item:
        return "values in " + ", ".join(repr(c) for c in item["enum"])
    return words.get(item.get("type"), "values") + _bounds(item)


def _bounds(schema: dict) -> str:
    marks = [(">=", "minimum"), (">", "exclusiveMinimum"), ("<=", "maximum"),
             ("<", "exclusiveMaximum")]
    parts = [f"{sign} {schema[key]:g}" if isinstance(schema[key], float)
             else f"{sign} {schema[key]}" for sign, key in marks if key in schema]
    if "pattern" in schema:
        parts.append(f"matching {schema['pattern']}")
    return (" " + " and ".join(parts)) if parts else ""
