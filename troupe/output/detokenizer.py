"""Incremental detokenization of one request's output, with stop strings and text hold-back.

Contract (one instance per request, fed in order by the `OutputProcessor`):

- `update(new_token_ids, stop_terminated, finished)` appends the ids to `token_ids`, appends
  their text to `output_text`, checks stop strings in the new text and returns the matched stop
  string (or None). On a match `output_text` is cut before the stop string (or after it with
  `include_stop_str_in_output`). With `stop_terminated` (the engine stopped on a stop token or
  EOS) the last id is kept in `token_ids` but its text is left out unless
  `include_stop_str_in_output` (vLLM behaviour). `finished` (the engine finished the request)
  also flushes bytes still waiting for the rest of a character.
- `get_next_output_text(finished, delta)` returns the text to show: all of it (`delta=False`)
  or only what was not returned before (`delta=True`), less the stop-string hold-back while not
  finished.
- Text never ends in a partial UTF-8 character mid-stream: tokens whose bytes do not yet form
  a whole character produce no text until the token completing it arrives (or the flush at the
  end, which is what `tokenizer.decode` would give).

Two decoders: `FastIncrementalDetokenizer` drives `tokenizers.decoders.DecodeStream` (Rust),
primed with a short clean suffix of the prompt; `SlowIncrementalDetokenizer` runs the same
prefix/read-offset algorithm over any `tokenizer.decode`. Requests that want one final output and
have no stop strings skip the per-step work: their ids are decoded in one call when they finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
import tokenizers
from tokenizers.decoders import DecodeStream

from troupe.output.stop import check_stop_strings, hold_back_length
from troupe.sampling_params import RequestOutputKind, SamplingParams

log = structlog.get_logger("troupe.detokenizer")

_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers raises this as a plain Exception
_PRIME_MIN, _PRIME_MAX = 4, 24  # prompt-suffix lengths tried when priming a stream
_HAS_PRIMED_STREAM = tuple(int(p) for p in tokenizers.__version__.split(".")[:2]) >= (0, 22)


class IncrementalDetokenizer:
    """Keeps the output token ids only; its text is always empty (`detokenize=False`)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.output_text = ""

    def update(
        self, new_token_ids: list[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    def catch_up(self) -> None:
        """Decode whatever was deferred (FINAL_ONLY); called before an abort reads the text."""


class _TextDetokenizer(IncrementalDetokenizer):
    """Text, stop strings and hold-back; subclasses only turn ids into text."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__()
        self.stop = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold_back = hold_back_length(self.stop, self.include_stop)
        self._sent = 0  # characters of output_text already returned in delta mode
        # FINAL_ONLY without stop strings: nobody looks at the text before the end.
        lazy = params.output_kind is RequestOutputKind.FINAL_ONLY and not self.stop
        self._deferred: list[int] | None = [] if lazy else None

    def _decode(self, ids: list[int]) -> str:
        """Text of `ids` following everything decoded so far ("" while a character is partial)."""
        raise NotImplementedError

    def _decode_batch(self, ids: list[int]) -> str:
        """Like `_decode`, when only the text at the end matters (one call where possible)."""
        return self._decode(ids)

    def _flush(self) -> str:
        """Text of ids still held for an incomplete character (replacement chars), then reset."""
        raise NotImplementedError

    def update(
        self, new_token_ids: list[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """1. record ids; 2. decode (min_tokens split); 3. flush at the end; 4. check stop strings."""
        token_ids = self.token_ids
        n_before = len(token_ids)
        token_ids += new_token_ids
        ids = new_token_ids  # not mutated: it may be the engine message's list
        if stop_terminated and ids and not self.include_stop:
            ids = ids[:-1]  # the stop token / EOS: its text is not part of the output
        if self._deferred is not None:
            self._deferred += ids
            if finished:
                self.catch_up()
                self.output_text += self._flush()
            return None
        check_from = len(self.output_text)
        pre = self.min_tokens - n_before  # ids still under min_tokens: no stop-string check
        if pre > 0 and ids:
            self.output_text += self._decode(ids[:pre])
            check_from = len(self.output_text)
            ids = ids[pre:]
        if ids:
            self.output_text += self._decode(ids)
        if finished:
            self.output_text += self._flush()
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        end = len(self.output_text) if finished else len(self.output_text) - self.hold_back
        if not delta:
            return self.output_text if end == len(self.output_text) else self.output_text[: max(end, 0)]
        start = self._sent
        if start >= end:
            return ""
        self._sent = end
        return self.output_text[start:end]

    def catch_up(self) -> None:
        if self._deferred:
            ids, self._deferred = self._deferred, []
            self.output_text += self._decode_batch(ids)


def _prime_ids(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> list[int]:
    """A short prompt suffix whose text holds no partial character, to give the decoder context."""
    n = len(prompt_token_ids)
    if n <= _PRIME_MIN:
        return list(prompt_token_ids)
    for i in range(_PRIME_MIN, min(n, _PRIME_MAX) + 1):
        suffix = list(prompt_token_ids[-i:])
        if _REPLACEMENT not in decode(suffix):
            return suffix
    return list(prompt_token_ids[-_PRIME_MAX:])


class FastIncrementalDetokenizer(_TextDetokenizer):
    """`tokenizers.decoders.DecodeStream` over the fast tokenizer's Rust backend."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
    ) -> None:
        super().__init__(params)
        self._tok = backend
        self._skip = params.skip_special_tokens
        self._request_id = request_id
        self._stream = DecodeStream(
            ids=_prime_ids(self._decode_all, prompt_token_ids), skip_special_tokens=self._skip
        )
        self._pending: list[int] = []  # ids stepped since the stream last produced text
        self.num_resets = 0
        # spaces_between_special_tokens=False: adjacent added tokens are joined without spaces.
        self._added: dict[int, str] | None = None
        if not (self._skip or params.spaces_between_special_tokens):
            added = {tid: t.content for tid, t in backend.get_added_tokens_decoder().items()}
            self._added = added or None
        self._last_added = False

    def _decode_all(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _decode(self, ids: list[int]) -> str:
        # One step per token, so each character shows as soon as its last token arrives (a list
        # step would hold back every character in it while its tail is a partial one).
        if len(ids) == 1 and self._added is None:
            return self._step(ids[0])
        parts = []
        for tid in ids:
            text = self._step(tid)
            if self._added is not None:  # join adjacent added tokens without spaces
                content = self._added.get(tid)
                if content is not None and self._last_added:
                    text = content
                self._last_added = content is not None
            parts.append(text)
        return "".join(parts)

    def _decode_batch(self, ids: list[int]) -> str:
        return self._step(ids) if self._added is None else self._decode(ids)

    def _step(self, ids: int | list[int]) -> str:
        try:
            text = self._stream.step(self._tok, ids)
        except (OverflowError, TypeError):  # an id the backend cannot take (e.g. negative)
            if isinstance(ids, list):
                return self._decode(ids)
            log.warning("detokenizer_invalid_token_id", request_id=self._request_id, token_id=ids)
            return ""
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # Non-monotonic UTF-8 broke the stream's state (vLLM #17448): start over, no context.
            log.warning("detokenizer_reset", request_id=self._request_id, reason="invalid_prefix")
            self.num_resets += 1
            self._pending = []
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            text = self._stream.step(self._tok, ids)
        if text is None:
            if isinstance(ids, list):
                self._pending += ids
            else:
                self._pending.append(ids)
            return ""
        self._pending = []
        return text

    def _flush(self) -> str:
        if not self._pending:
            return ""
        ids, self._pending = self._pending, []
        return self._decode_all(ids)


class SlowIncrementalDetokenizer(_TextDetokenizer):
    """The prefix/read-offset algorithm over any tokenizer with an HF-style `decode`."""

    _TRIM = 64  # drop history once this many ids are behind the prefix offset

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        super().__init__(params)
        skip = params.skip_special_tokens
        spaces = params.spaces_between_special_tokens
        kwargs: dict[str, Any] = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
        if not spaces:
            kwargs["spaces_between_special_tokens"] = False  # honoured by slow HF tokenizers

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, **kwargs)

        self._decode_ids = decode
        self._ids = _prime_ids(decode, prompt_token_ids)
        self._prefix = 0  # ids[prefix:read] is context whose text was already emitted
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        parts = []
        for tid in ids:
            self._ids.append(tid)
            full = self._decode_ids(self._ids[self._prefix :])
            if len(full) > len(self._prefix_text) and not full.endswith(_REPLACEMENT):
                parts.append(full[len(self._prefix_text) :])
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_text = self._decode_ids(self._ids[self._prefix :])
        if self._prefix > self._TRIM:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return "".join(parts)

    def _flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        full = self._decode_ids(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        text = full[len(self._prefix_text) :]
        self._prefix_text = self._decode_ids(self._ids[self._prefix :])
        return text


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str = ""
) -> IncrementalDetokenizer:
    """The detokenizer for one request: fast when the tokenizer has a Rust backend, else slow.

    `tokenizer` is an HF tokenizer, a `tokenizers.Tokenizer`, or None (no text at all).
    """
    if tokenizer is None or not params.detokenize:
        return IncrementalDetokenizer()
    backend = (
        tokenizer
        if isinstance(tokenizer, tokenizers.Tokenizer)
        else getattr(tokenizer, "backend_tokenizer", None)
    )
    if isinstance(backend, tokenizers.Tokenizer) and _HAS_PRIMED_STREAM:
        return FastIncrementalDetokenizer(backend, prompt_token_ids, params, request_id)
    return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)
