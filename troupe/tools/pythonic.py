"""Pythonic tool calls (vLLM's `pythonic`, Llama 3.2 / Llama 4 style): the output is a Python list
of calls with keyword arguments, `[get_weather(city="Paris", days=3), now()]`, optionally inside
`<|python_start|>` ... `<|python_end|>`.

Contract: only an output that starts (after white space) with `[` or `<|python_start|>` is a call;
it is read with `ast` (never evaluated): each element must be `name(key=literal, ...)` with a plain
or dotted name and literal values (strings, numbers, booleans, None, lists, dicts); arguments come
back as JSON text. Anything else: no tool was called, the whole output is content. A call's content
is None. Streaming: `TriggerStreamParser` (calls at the end).
"""

from __future__ import annotations

import ast
import json

from troupe.tools.hermes import ParsedToolCalls, ToolCall

START, END = "<|python_start|>", "<|python_end|>"
MARKERS = ("[", START)


def parse_pythonic(text: str) -> ParsedToolCalls:
    body = text.strip()
    if body.startswith(START):
        body = body[len(START):]
        body = body[:body.rfind(END)] if END in body else body
        body = body.strip()
    if not body.startswith("["):
        return ParsedToolCalls(text, [])
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ParsedToolCalls(text, [])
    if not isinstance(tree, ast.List) or not tree.elts:
        return ParsedToolCalls(text, [])
    calls = []
    for node in tree.elts:
        call = _call(node)
        if call is None:
            return ParsedToolCalls(text, [])
        calls.append(call)
    return ParsedToolCalls(None, calls)


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _name(node.func)
    if name is None:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex number)
        return None
