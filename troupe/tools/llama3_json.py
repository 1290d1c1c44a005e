"""Llama 3.x JSON tool calls (vLLM's `llama3_json`): the output is one or more JSON objects
`{"name": "f", "parameters": {...}}` (or `"arguments"`), separated by `;`, optionally after
`<|python_tag|>`.

Contract: only an output that starts (after white space) with `{` or `<|python_tag|>` is a call;
every object must have a string `name` and object arguments, else no tool was called and the whole
output is content. A call's content is None. Streaming: `TriggerStreamParser` (calls at the end).
"""

from __future__ import annotations

import json

from troupe.tools.hermes import ParsedToolCalls, ToolCall, call_from_object

PYTHON_TAG = "<|python_tag|>"
MARKERS = ("{", PYTHON_TAG)


def parse_llama3_json(text: str) -> ParsedToolCalls:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ParsedToolCalls(text, [])
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedToolCalls(text, [])
        call = call_from_object(obj)
        if call is None:
            return ParsedToolCalls(text, [])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedToolCalls(None, calls)
