"""The JSON schemas that force tool calls, as vLLM builds them.

- a named function (`tool_choice={"type": "function", "function": {"name": "f"}}`): the output is
  that function's arguments, so the schema is its `parameters` (any object when it has none);
- `tool_choice="required"`: the output is a non-empty JSON array of `{"name", "parameters"}` objects,
  each name one of the tools' with its own parameters schema (`tool_calls_from_required` reads it).

Both are enforced with structured outputs, so the output always parses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from troupe.tools.hermes import ToolCall

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def function_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(parameters) if parameters else dict(ANY_OBJECT)


def required_tools_schema(functions: Sequence[tuple[str, Mapping[str, Any] | None]]) -> dict[str, Any]:
    """`[(name, parameters schema), ...]` -> the schema of a list of one or more calls of them.
    `$defs` of the tools' schemas are lifted to the top, where their `$ref`s point."""
    defs: dict[str, Any] = {}
    variants = []
    for name, params in functions:
        schema = function_schema(params)
        defs.update(schema.pop("$defs", {}) or {})
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                         "required": ["name", "parameters"]})
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if defs:
        out["$defs"] = defs
    return out


def tool_calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a `required` output (a JSON array of {name, parameters}); None if it is not one
    (the output was cut short by `max_tokens`)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ToolCall(name=item["name"], arguments=json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls
