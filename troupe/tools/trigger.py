"""`TriggerStreamParser`: streaming for tool-call formats that are only parseable whole.

Contract: text that cannot begin the format's marker is released as content at once; a possible
start of the marker is held back until decided. Once a marker is seen, everything from it to the
end of the output is buffered and parsed whole by `finish` (the format's own parser over the whole
output, so streaming and non-streaming agree); if it does not parse, it is released as content.
`anywhere=False` formats (llama3_json, pythonic) only count a marker at the start of the output
(after white space); `anywhere=True` ones (mistral) anywhere, with the text before it as content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from troupe.tools.hermes import ParsedToolCalls, ToolCall


class TriggerStreamParser:
    """Feed text deltas; get back (content to release, tool calls completed)."""

    def __init__(self, markers: Sequence[str], anywhere: bool, parse: Callable[[str], ParsedToolCalls]) -> None:
        self._markers = tuple(markers)
        self._anywhere = anywhere
        self._parse = parse
        self._seen = ""  # every character fed (the whole output, for `finish`)
        self._pending = ""  # not released: a possible marker start, or everything from a marker on
        self._released = 0  # characters of `_seen` released as content
        self._triggered = False
        self._plain = False  # (anywhere=False) the output did not start with a marker: all content
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._seen += delta
        if self._plain:
            self._released += len(delta)
            return delta, []
        self._pending += delta
        if self._triggered:
            return "", []
        if not self._anywhere:
            head = self._pending.lstrip()
            if any(head.startswith(m) for m in self._markers):
                self._triggered = True
                return "", []
            if any(m.startswith(head) for m in self._markers):
                return "", []  # white space, or a part of a marker: undecided
            self._plain = True
            out, self._pending = self._pending, ""
            self._released += len(out)
            return out, []
        starts = [i for i in (self._pending.find(m) for m in self._markers) if i >= 0]
        if starts:
            cut = min(starts)
            out, self._pending = self._pending[:cut], self._pending[cut:]
            self._triggered = True
        else:
            keep = max(_held(self._pending, m) for m in self._markers)
            out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        self._released += len(out)
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        if not self._triggered:
            return rest, []
        parsed = self._parse(self._seen)
        if not parsed.called:
            return rest, []
        self.calls.extend(parsed.tool_calls)
        return "", list(parsed.tool_calls)


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
