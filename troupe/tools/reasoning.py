"""Reasoning parsers: a thinking model's `<think>...</think>` split from its answer (vLLM's `--reasoning-parser`).

Contract, whole outputs (`ReasoningParser.split`) and streams (`ReasoningStream.feed` / `finish`)
give the same split (a stream holds back only text that could still be the start of a tag):

- `deepseek_r1` (DeepSeek-R1 and its distills, whose chat template opens `<think>` in the prompt):
  the output is reasoning from its start (a leading `<think>` is dropped) up to `</think>`; the text
  after it is the content. An output without `</think>` is all reasoning (the model stopped while
  thinking).
- `qwen3` (Qwen3, QwQ): the output is reasoning only when it starts (after white space) with
  `<think>`; up to `</think>` (or the end, if the model stopped while thinking), the rest is
  content. An output that does not open `<think>` (thinking switched off) is all content.

Reasoning or content that is empty comes back as None. The tags must be decoded as text: they are
ordinary added tokens in these models' tokenizers, so `skip_special_tokens` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One named parser's rules; `split` a whole output, `stream()` a parser for deltas."""

    name: str
    starts_thinking: bool  # deepseek_r1: the output starts inside the reasoning

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_thinking)


class ReasoningStream:
    """Feed text deltas; get back (reasoning, content) released by each (strings, maybe empty)."""

    def __init__(self, starts_thinking: bool) -> None:
        # "open": before the output has shown whether it opens <think>; "think"; "content"
        self._phase = "open"
        self._starts_thinking = starts_thinking
        self._pending = ""

    @property
    def thinking(self) -> bool:
        """Whether the text fed so far ends inside the reasoning (or may still open it)."""
        return self._phase != "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._pending += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._phase == "open":
                head = self._pending.lstrip()
                if head.startswith(START):
                    self._pending, self._phase = head[len(START):], "think"
                elif START.startswith(head):  # white space, or a part of `<think>`: undecided
                    break
                else:
                    self._phase = "think" if self._starts_thinking else "content"
            elif self._phase == "think":
                end = self._pending.find(END)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending, self._phase = self._pending[end + len(END):], "content"
                    continue
                keep = _held(self._pending, END)
                reasoning.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: held-back text released where it stands."""
        rest, self._pending = self._pending, ""
        if self._phase == "think" or self._phase == "open" and self._starts_thinking and rest.strip():
            return rest, ""
        return "", rest


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name` (one of `REASONING_PARSERS`)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; troupe has {list(REASONING_PARSERS)}")
    return ReasoningParser(name, starts_thinking=name == "deepseek_r1")
