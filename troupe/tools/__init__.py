"""Tool calling: what a model's tool calls look like in text, and how troupe finds them.

- `hermes`: the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format (Hermes, Qwen and
  many others): `parse_tool_calls` for a whole output, `HermesStreamParser` for a stream of deltas.
- `llama3_json`, `mistral`, `pythonic`: the other formats `--tool-call-parser` reads (streamed by
  `trigger.TriggerStreamParser`); `parsers.tool_parser(name)` gives any of them behind one interface.
- `schema`: the JSON schema that forces a tool call (`tool_choice="required"` or a named function),
  enforced with structured outputs.
- `reasoning`: `--reasoning-parser` (`deepseek_r1`, `qwen3`): `<think>` reasoning split from the answer.
"""

from __future__ import annotations

from troupe.tools.hermes import HermesStreamParser, ParsedToolCalls, ToolCall, parse_tool_calls
from troupe.tools.schema import required_tools_schema, tool_calls_from_required

__all__ = ["HermesStreamParser", "ParsedToolCalls", "ToolCall", "parse_tool_calls", "required_tools_schema",
           "tool_calls_from_required"]
