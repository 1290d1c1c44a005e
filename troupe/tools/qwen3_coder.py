"""Qwen3-Coder tool calls: XML-like blocks whose parameter values are raw text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Contract (as vLLM's `qwen3_coder` parser, for the blocks the model's chat template asks for): the text
before the first `<tool_call>` is the content (None when only white space); each block's one
`<function=NAME>` holds
`<parameter=KEY>VALUE</parameter>` pairs, a block or value left open at the end of the output being read
to the end. One newline on each side of a value is the format's, not the value's. Values are typed by
the request's tool schema (`bind`): "null" is None; string types keep the text; integer types `int`,
number types `float` (an integral one as int), boolean ones "true"/"false"; objects, arrays and other
types are read as JSON, else as a Python literal (`ast.literal_eval`, never evaluated), else kept as text.
A parameter or function the schema does not name keeps its text. A block that is not one named
function means no tool was called: the whole output is content. (vLLM also reads a bare `<function=`
without its `<tool_call>`; troupe does not, so that a stream can release text before the block closes.)

Streaming: `Qwen3CoderStreamParser` is the hermes block streamer with this block reader: content
released as it comes, each call whole when its `</tool_call>` arrives (or at the end).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from troupe.tools.hermes import HermesStreamParser, ParsedToolCalls, ToolCall

START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)
_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER = ("int", "uint", "long", "short", "unsigned")
_NUMBER = ("num", "float", "double")
_BOOLEAN = ("boolean", "bool", "binary")

Schemas = Mapping[str, Mapping[str, Any]]  # function name -> its JSON schema's "properties"


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The request's `tools` (OpenAI shape) as function name -> parameter properties."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(function.get("name"), str) and isinstance(properties, dict):
            out[function["name"]] = properties
    return out


def convert_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """One parameter's text as the type its schema names (see the module docstring)."""
    if text.lower() == "null":
        return None
    kind = str((schema or {}).get("type", "string")).strip().lower()
    if schema is None or kind.startswith(_STRING):
        return text
    try:
        if kind.startswith(_INTEGER):
            return int(text)
        if kind.startswith(_NUMBER):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    except ValueError:
        return text
    if kind.startswith(_BOOLEAN):
        return text.lower() == "true" if text.lower() in ("true", "false") else text
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _value(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def call_from_function(body: str, schemas: Schemas) -> ToolCall | None:
    """`NAME>` + parameters (the text after `<function=`) as a call; None without a name."""
    name, sep, rest = body.partition(">")
    name = name.strip()
    if not sep or not name or "\n" in name:
        return None
    properties = schemas.get(name, {})
    args: dict[str, Any] = {}
    for m in _PARAMETER.finditer(rest):
        key, sep, raw = m.group(1).partition(">")
        if not sep or not key.strip():
            return None
        args[key.strip()] = convert_value(_value(raw), properties.get(key.strip()))
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def call_from_block(body: str, schemas: Schemas) -> ToolCall | None:
    """One `<tool_call>` block's body (exactly one function) as a call."""
    functions = [m.group(1) if m.group(1) is not None else m.group(2) for m in _FUNCTION.finditer(body)]
    return call_from_function(functions[0], schemas) if len(functions) == 1 else None


def parse_qwen3_coder(text: str, schemas: Schemas | None = None) -> ParsedToolCalls:
    """The content and tool calls of one whole output (see the module docstring)."""
    schemas = schemas or {}
    start = text.find(START)
    if start < 0:
        return ParsedToolCalls(text, [])
    bodies = [m.group(1) if m.group(1) is not None else m.group(2) for m in _BLOCK.finditer(text, start)]
    calls = [call_from_block(b.strip(), schemas) for b in bodies]
    if not calls or any(c is None for c in calls):
        return ParsedToolCalls(text, [])
    content = text[:start]
    return ParsedToolCalls(content if content.strip() else None, [c for c in calls if c is not None])


class Qwen3CoderStreamParser(HermesStreamParser):
    """Feed text deltas; get back (content to release, tool calls completed). Blocks as in hermes."""

    def __init__(self, schemas: Schemas | None = None) -> None:
        super().__init__()
        self._schemas = schemas or {}

    def read_block(self, body: str) -> ToolCall | None:
        return call_from_block(body, self._schemas)
