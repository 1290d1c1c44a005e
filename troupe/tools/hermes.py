"""Hermes-style tool calls: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` in the output.

Contract (as vLLM's `hermes` tool parser): the text before the first `<tool_call>` is the message's
content (None when it is only whitespace); each block holds one JSON object with `name` (a string)
and `arguments` (an object, or its JSON text); arguments come back as JSON text (`ensure_ascii=False`).
A block left open at the end of the output (the model stopped inside it) is parsed up to the end.
If any block is not such JSON, no tool was called: the whole output is content.

`HermesStreamParser` does the same on a stream of text deltas: text that cannot start a
`<tool_call>` is released as content at once; a possible start of the tag is held back until it
is decided; each block is released as one complete `ToolCall` when its `</tool_call>` arrives (or at
the end). Arguments are not streamed piece by piece: a tool call is only useful whole, and a partial
JSON text would have to be retracted if the block turned out not to be valid.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return call_from_object(obj)


def call_from_object(obj: Any) -> ToolCall | None:
    """`{"name": str, "arguments" (or "parameters"): object or its JSON text}` as a call; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """The content and tool calls of one whole output (see the module docstring)."""
    start = text.find(START)
    if start < 0:
        return ParsedToolCalls(text, [])
    calls = []
    for m in _BLOCK.finditer(text, start):
        call = _call_from_json((m.group(1) if m.group(1) is not None else m.group(2)).strip())
        if call is None:
            return ParsedToolCalls(text, [])
        calls.append(call)
    content = text[:start]
    return ParsedToolCalls(content if content.strip() else None, calls)


class HermesStreamParser:
    """Feed text deltas; get back (content to release, tool calls completed). See the module docstring."""

    def __init__(self) -> None:
        self._pending = ""  # text not released yet: a possible tag start, or an open block
        self._in_block = False
        self.calls: list[ToolCall] = []
        self.failed = False  # a block was not a tool call: everything after is plain content

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.failed:
            return delta, []
        self._pending += delta
        content: list[str] = []
        done: list[ToolCall] = []
        while True:
            if self._in_block:
                end = self._pending.find(END)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(END):]
                self._in_block = False
                call = self.read_block(body.strip())
                if call is None:  # not a tool call: release the block as text, parse no more
                    self.failed = True
                    content.append(START + body + END + self._pending)
                    self._pending = ""
                    break
                done.append(call)
                continue
            start = self._pending.find(START)
            if start >= 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(START):]
                self._in_block = True
                continue
            keep = _partial_tag_suffix(self._pending)
            content.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        self.calls.extend(done)
        return "".join(content), done

    def read_block(self, body: str) -> ToolCall | None:
        """One block's body as a call (None: not a call). Formats with other blocks override it."""
        return _call_from_json(body)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: an open block is parsed to the end, held-back text released."""
        rest, self._pending = self._pending, ""
        if self._in_block and not self.failed:
            self._in_block = False
            call = self.read_block(rest.strip())
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return START + rest, []
        return rest, []


def _partial_tag_suffix(text: str) -> int:
    """How many trailing characters of `text` could be the start of `<tool_call>`."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
