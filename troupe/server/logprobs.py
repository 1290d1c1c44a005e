"""Engine logprobs (`list[dict[token id, Logprob]]`, one dict per token: the token itself and the top
k) in OpenAI's response shapes.

- completions: `tokens`, `token_logprobs`, `top_logprobs` (every entry of the position's dict, text
  -> logprob: the top k and the token itself, so k or k + 1 entries, as vLLM) and `text_offset` (the
  offset of each token's text in the choice's text, counted from `start`, as vLLM sums the tokens'
  lengths);
- chat: `content: [{token, logprob, bytes, top_logprobs: [the k best, by rank]}]`;
- vLLM's `prompt_logprobs`: `{token id: {logprob, rank, decoded_token}}` per prompt position (None
  for the first).

A token's text is the engine's `decoded_token`, else the tokenizer's decoding of the id alone;
with `return_tokens_as_token_ids` it is `token_id:<id>`. Logprobs below -9999 (-inf) are sent as
-9999.0 (JSON has no infinity), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from troupe.server.responses import (
    ChatLogprob,
    ChatLogprobContent,
    CompletionLogprobs,
    LogprobOut,
    PromptLogprobs,
)

FLOOR = -9999.0
Position = dict[int, Any] | None  # token id -> Logprob(logprob, rank, decoded_token)


class TokenText:
    """The text shown for a token in logprob output (see the module docstring)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids

    def __call__(self, token_id: int, lp: Any = None) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        decoded = getattr(lp, "decoded_token", None)
        if decoded is not None:
            return str(decoded)
        return str(self._tokenizer.decode([token_id]))


def _value(lp: Any) -> float:
    return max(float(lp.logprob), FLOOR)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[Position], text: TokenText,
                        start: int = 0) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs of `token_ids` (with their `positions`), and the offset after the last."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = start
    for tid, pos in zip(token_ids, positions, strict=True):
        lp = pos.get(tid) if pos is not None else None
        token = text(tid, lp)
        out.tokens.append(token)
        out.token_logprobs.append(_value(lp) if lp is not None else None)
        out.top_logprobs.append({text(t, p): _value(p) for t, p in pos.items()} if pos is not None else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def _ranked(pos: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    items = sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 62, -kv[1].logprob))
    return items[:k]


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[Position], k: int,
                  text: TokenText) -> list[ChatLogprobContent]:
    out = []
    for tid, pos in zip(token_ids, positions, strict=True):
        lp = pos.get(tid) if pos is not None else None
        token = text(tid, lp)
        top = [ChatLogprob(token=(t_text := text(t, p)), logprob=_value(p), bytes=list(t_text.encode()))
               for t, p in _ranked(pos, k)] if pos is not None else []
        out.append(ChatLogprobContent(token=token, logprob=_value(lp) if lp is not None else FLOOR,
                                      bytes=list(token.encode()), top_logprobs=top))
    return out


def prompt_logprobs_out(positions: Sequence[Position] | None) -> PromptLogprobs | None:
    if positions is None:
        return None
    return [None if pos is None else
            {t: LogprobOut(logprob=_value(p), rank=p.rank, decoded_token=p.decoded_token) for t, p in pos.items()}
            for pos in positions]
