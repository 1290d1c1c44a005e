"""The tool-call parsers by name (`troupe serve --tool-call-parser`), behind one interface.

`tool_parser(name)` gives a `ToolParser`: `parse(text)` reads one whole output into content and
calls; `stream()` gives a parser fed text deltas (`feed(delta) -> (content, calls)`, then
`finish()`), which agrees with `parse` on the same text. Formats: `hermes` (`hermes.py`) and
`qwen3_coder` (`qwen3_coder.py`), calls released as each block closes; `llama3_json`, `mistral`,
`pythonic`, released at the end (`trigger.py`). `for_tools(tools)` gives the parser for one request:
qwen3_coder types its raw-text values by the request's tool schemas, the others read typed JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from troupe.tools.hermes import HermesStreamParser, ParsedToolCalls, ToolCall, parse_tool_calls
from troupe.tools.llama3_json import MARKERS as LLAMA_MARKERS
from troupe.tools.llama3_json import parse_llama3_json
from troupe.tools.mistral import MARKER as MISTRAL_MARKER
from troupe.tools.mistral import parse_mistral
from troupe.tools.pythonic import MARKERS as PYTHONIC_MARKERS
from troupe.tools.pythonic import parse_pythonic
from troupe.tools.qwen3_coder import Qwen3CoderStreamParser, parse_qwen3_coder, tool_schemas
from troupe.tools.trigger import TriggerStreamParser

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")


class ToolStream(Protocol):
    calls: list[ToolCall]

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]: ...

    def finish(self) -> tuple[str, list[ToolCall]]: ...


@dataclass(frozen=True, slots=True)
class ToolParser:
    name: str
    parse: Callable[[str], ParsedToolCalls]
    stream: Callable[[], ToolStream]
    keeps_special_tokens: bool = False  # the format's marker is a special token: decode it
    typed_by_schema: bool = False  # `for_tools` binds the request's tool schemas

    def for_tools(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """This parser for a request offering `tools` (OpenAI shape)."""
        if not self.typed_by_schema:
            return self
        schemas = tool_schemas(tools)
        return ToolParser(self.name, lambda text: parse_qwen3_coder(text, schemas),
                          lambda: Qwen3CoderStreamParser(schemas), self.keeps_special_tokens, True)


def tool_parser(name: str) -> ToolParser:
    """The parser called `name` (one of `TOOL_PARSERS`)."""
    if name == "hermes":
        return ToolParser(name, parse_tool_calls, HermesStreamParser)
    if name == "llama3_json":
        return ToolParser(name, parse_llama3_json,
                          lambda: TriggerStreamParser(LLAMA_MARKERS, False, parse_llama3_json), True)
    if name == "mistral":
        return ToolParser(name, parse_mistral, lambda: TriggerStreamParser((MISTRAL_MARKER,), True, parse_mistral),
                          True)
    if name == "pythonic":
        return ToolParser(name, parse_pythonic, lambda: TriggerStreamParser(PYTHONIC_MARKERS, False, parse_pythonic),
                          True)
    if name == "qwen3_coder":
        return ToolParser(name, parse_qwen3_coder, Qwen3CoderStreamParser, typed_by_schema=True)
    raise ValueError(f"unknown tool call parser {name!r}; troupe has {list(TOOL_PARSERS)}")
