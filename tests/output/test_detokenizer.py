"""Incremental detokenization and stop-string search (troupe.output.detokenizer, troupe.output.stop)."""

from __future__ import annotations

from typing import Any

import pytest

from troupe.output.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from troupe.output.stop import check_stop_strings, hold_back_length
from troupe.sampling_params import RequestOutputKind, SamplingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in Paris.",
    "Héllo wörld! Ünïcödé — “quotes” and a naïve café façade.",
    "你好，世界。日本語のテキストも。한국어 문장도 있습니다.",
    "Rocket 🚀 party 🎉 family 👨‍👩‍👧 sparkles ✨!",
    "def f(x):\n    return x ** 2  # squared\n",
]
PROMPT = "<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n"
IM_START, IM_END = 1, 2


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(kind: str, tokenizer: Any, prompt_ids: list[int], **params: Any) -> IncrementalDetokenizer:
    sp = SamplingParams(**params)
    if kind == "fast":
        return FastIncrementalDetokenizer(tokenizer.backend_tokenizer, prompt_ids, sp)
    return SlowIncrementalDetokenizer(tokenizer, prompt_ids, sp)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    """Feed `ids` `chunk` at a time (the last chunk finishes); returns the delta text of each step."""
    deltas = []
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        detok.update(ids[start : start + chunk], finished=last)
        deltas.append(detok.get_next_output_text(finished=last, delta=True))
    return deltas


# ------------------------------------------------------------------ stop strings


@pytest.mark.parametrize(
    ("text", "new_chars", "stop", "include", "expected"),
    [
        ("hello world", 5, ["world"], False, ("world", 6)),
        ("hello world", 5, ["world"], True, ("world", -1)),
        ("hello world!", 1, ["world"], True, None),  # already searched in an earlier step
        ("hello world!", 2, ["world"], True, ("world", 11)),  # include: keep up to its end
        ("hello world", 1, ["world"], False, ("world", 6)),  # spans the boundary: overlap finds it
        ("hello world", 0, ["world"], False, None),  # nothing new, nothing searched
        ("abcabc", 3, ["c", "b"], False, ("b", 4)),  # earliest in the text wins, not first listed
        ("xxab", 2, ["ab", "a"], False, ("ab", 2)),  # same start: the earlier listed wins
        ("no stop here", 12, ["STOP"], False, None),
        ("short", 5, ["a much longer stop string"], False, None),
        ("你好，世界", 2, ["世界"], False, ("世界", 3)),
    ],
)
def test_check_stop_strings(text, new_chars, stop, include, expected):
    """Only the new characters plus len(stop)-1 of overlap are searched; truncation is before the
    stop string, or after it with include (-1 when nothing follows)."""
    assert check_stop_strings(text, new_chars, stop, include) == expected


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [([], False, 0), (["a"], False, 0), (["abc", "de"], False, 2), (["abc", "de"], True, 0)],
)
def test_hold_back_length(stop, include, expected):
    """The hold-back is max(len(stop)) - 1 characters, and nothing in include mode."""
    assert hold_back_length(stop, include) == expected


# ------------------------------------------------------------------ detokenization


@pytest.mark.parametrize("kind", ["fast", "slow"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("sentence", SENTENCES, ids=range(len(SENTENCES)))
def test_incremental_equals_decode(tokenizer, kind, chunk, skip_special_tokens, sentence):
    """Streaming the ids `chunk` at a time gives exactly `tokenizer.decode(ids)`, special tokens
    included or skipped, and no delta before the end contains a replacement character."""
    ids = [IM_START] + encode(tokenizer, sentence) + [IM_END]
    detok = make(kind, tokenizer, encode(tokenizer, PROMPT), skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.token_ids == ids
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_multibyte_character_held_until_complete(tokenizer, kind):
    """A character split over several tokens appears whole, in the step of its last token."""
    ids = encode(tokenizer, "你")
    assert len(ids) > 1  # this tokenizer splits it into bytes
    detok = make(kind, tokenizer, encode(tokenizer, PROMPT))
    texts = [detok._decode([t]) for t in ids]  # noqa: SLF001 - the raw per-token text
    assert texts == [""] * (len(ids) - 1) + ["你"]


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_multi_token_step_emits_complete_characters(tokenizer, kind):
    """In a step of several tokens, the whole characters show even when the last one is partial."""
    ids = encode(tokenizer, "好世")
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]) == "好\ufffd")
    detok = make(kind, tokenizer, [])
    detok.update(ids[:cut])
    assert detok.output_text == "好"
    detok.update(ids[cut:])
    assert detok.output_text == "好世"


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_partial_character_flushed_when_finished(tokenizer, kind):
    """A request that ends inside a character gets what `decode` gives (U+FFFD), only at the end."""
    ids = encode(tokenizer, "ok 你")[:-1]
    detok = make(kind, tokenizer, [])
    detok.update(ids[:-1])
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=False)
    detok.update(ids[-1:], finished=True)
    assert detok.output_text == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


@pytest.mark.parametrize("kind", ["fast", "slow"])
@pytest.mark.parametrize(
    ("prompt", "generated"),
    [("Hel", "lo there"), ("", "Hi"), ("a b c d e f g h", " i j k"), ("你好", "世界")],
)
def test_prompt_context(tokenizer, kind, prompt, generated):
    """The prompt primes the decoder but never appears in the output text."""
    ids = encode(tokenizer, generated)
    detok = make(kind, tokenizer, encode(tokenizer, prompt))
    assert "".join(stream(detok, ids, 1)) == tokenizer.decode(ids)


def test_spaces_between_special_tokens_false(tokenizer):
    """With special tokens kept and spaces_between_special_tokens=False, adjacent added tokens are
    joined without anything between them."""
    ids = [IM_START, IM_END, IM_START] + encode(tokenizer, "hi") + [IM_END]
    detok = make("fast", tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(stream(detok, ids, 2)) == "<|im_start|><|im_end|><|im_start|>hi<|im_end|>"


class _FlakyStream:
    """A DecodeStream stand-in that fails with tokenizers' invalid-prefix error once."""

    def __init__(self, message: str) -> None:
        self.message = message

    def step(self, tokenizer: Any, ids: Any) -> str | None:
        raise Exception(self.message)  # tokenizers raises a plain Exception


def test_invalid_prefix_resets_stream(tokenizer):
    """An "Invalid prefix encountered" error resets the stream and decoding goes on."""
    detok = make("fast", tokenizer, encode(tokenizer, PROMPT))
    assert isinstance(detok, FastIncrementalDetokenizer)
    detok._stream = _FlakyStream("Invalid prefix encountered while decoding stream")  # type: ignore[assignment]
    detok.update(encode(tokenizer, "Hello world"))
    assert detok.output_text == "Hello world"
    assert detok.num_resets == 1


def test_other_stream_errors_propagate(tokenizer):
    """Errors other than the invalid-prefix one are bugs and are not swallowed."""
    detok = make("fast", tokenizer, [])
    detok._stream = _FlakyStream("something else")  # type: ignore[assignment]
    with pytest.raises(Exception, match="something else"):
        detok.update(encode(tokenizer, "Hello"))


def test_invalid_token_id_is_skipped(tokenizer):
    """A negative token id (which the Rust decoder rejects) produces no text and no crash."""
    ids = encode(tokenizer, "Hello world")
    detok = make("fast", tokenizer, [])
    detok.update([ids[0], -1, *ids[1:]], finished=True)
    assert detok.output_text == "Hello world"
    assert detok.token_ids == [ids[0], -1, *ids[1:]]


@pytest.mark.parametrize("detokenize", [True, False])
def test_final_only_decodes_once_at_the_end(tokenizer, detokenize):
    """FINAL_ONLY without stop strings decodes nothing until finished (or until `catch_up`, which
    an abort calls), then gives the same text; detokenize=False gives ids and no text."""
    ids = encode(tokenizer, SENTENCES[1])
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, detokenize=detokenize)
    detok = make_detokenizer(tokenizer, [], params)
    detok.update(ids[:5])
    assert detok.output_text == ""
    detok.catch_up()
    assert detok.output_text == (tokenizer.decode(ids[:5]) if detokenize else "")
    detok.update(ids[5:], finished=True)
    assert detok.get_next_output_text(True, False) == (tokenizer.decode(ids) if detokenize else "")
    assert detok.token_ids == ids


@pytest.mark.parametrize(
    ("tok_kind", "expected"),
    [
        ("hf", FastIncrementalDetokenizer),
        ("backend", FastIncrementalDetokenizer),
        ("none", IncrementalDetokenizer),
    ],
)
def test_make_detokenizer_picks_the_decoder(tokenizer, tok_kind, expected):
    """An HF fast tokenizer or a raw `tokenizers.Tokenizer` get the Rust stream; None gets no text."""
    tok = {"hf": tokenizer, "backend": tokenizer.backend_tokenizer, "none": None}[tok_kind]
    assert type(make_detokenizer(tok, [], SamplingParams())) is expected
