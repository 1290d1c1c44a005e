"""Mistral tool calls (vLLM's `mistral`): `[TOOL_CALLS]` then the calls, in either of Mistral's forms:

- older tokenizers (v2/v3): `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`, a JSON list;
- newer (v11+): `[TOOL_CALLS]f[ARGS]{...}`, repeated per call (`[CALL_ID]id` before `[ARGS]` allowed).

Contract: the text before the first `[TOOL_CALLS]` is the content (None when only white space);
every call must parse (a string name, object arguments), else no tool was called and the whole
output is content. `[TOOL_CALLS]` is a special token: the chat path decodes with
`skip_special_tokens=false` when this parser reads tool calls (as vLLM). Streaming:
`TriggerStreamParser` (content before the marker as it comes, calls at the end).
"""

from __future__ import annotations

import json
import re

from troupe.tools.hermes import ParsedToolCalls, ToolCall, call_from_object

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*[\w\-]*\s*)?\[ARGS\](.*)\Z", re.DOTALL)


def parse_mistral(text: str) -> ParsedToolCalls:
    start = text.find(MARKER)
    if start < 0:
        return ParsedToolCalls(text, [])
    calls: list[ToolCall] = []
    for piece in text[start + len(MARKER):].split(MARKER):
        found = _piece_calls(piece)
        if found is None:
            return ParsedToolCalls(text, [])
        calls.extend(found)
    content = text[:start]
    return ParsedToolCalls(content if content.strip() else None, calls)


def _piece_calls(piece: str) -> list[ToolCall] | None:
    body = piece.strip()
    m = _NAMED.match(piece)
    if m is not None:
        try:
            args = json.loads(m.group(2))
        except ValueError:
            return None
        call = call_from_object({"name": m.group(1), "arguments": args})
        return None if call is None else [call]
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_object(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]
