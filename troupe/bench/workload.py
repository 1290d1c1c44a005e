"""The prompts of `troupe bench` (issue 13), as token ids so that every engine sees the same input.

- offline: `n` prompts whose lengths are spread evenly over lo..hi (the defaults 64 x 22..379 give
  12,832 prompt tokens), in a fixed shuffled order so that every batch mixes short and long ones; each is
  cut from natural text at its own offset and starts with its own number, so no two share a prefix;
- single stream: one prompt of exactly `length` tokens, unlike any offline prompt;
- the warm-up prompt: a few tokens, the first thing every worker generates (its start-up's first token).
"""

from __future__ import annotations

import random
from typing import Any

from troupe.bench.offline import _TEXT


def spread_lengths(n: int, lo: int, hi: int) -> list[int]:
    """`n` lengths spread evenly from `lo` to `hi` (both included), shuffled with a fixed seed."""
    if n < 1 or not 1 <= lo <= hi:
        raise ValueError(f"need n >= 1 and 1 <= lo <= hi, got n={n}, lo={lo}, hi={hi}")
    lengths = [lo + round(i * (hi - lo) / max(1, n - 1)) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def _text_ids(tokenizer: Any, need: int) -> list[int]:
    base: list[int] = tokenizer(_TEXT, add_special_tokens=False)["input_ids"]
    return base * (need // len(base) + 2)


def offline_prompts(tokenizer: Any, n: int, lo: int, hi: int) -> list[list[int]]:
    lengths = spread_lengths(n, lo, hi)
    base = _text_ids(tokenizer, 2 * hi)
    rng = random.Random(1)
    prompts = []
    for i, length in enumerate(lengths):
        start = rng.randrange(len(base) - length - 1)
        head: list[int] = tokenizer(f"Document {i}:", add_special_tokens=False)["input_ids"]
        prompts.append((head + base[start:start + length])[:length])
    return prompts


def single_prompt(tokenizer: Any, length: int) -> list[int]:
    head: list[int] = tokenizer("Single stream:", add_special_tokens=False)["input_ids"]
    return (head + _text_ids(tokenizer, length))[:length]


def warm_prompt(tokenizer: Any) -> list[int]:
    ids: list[int] = tokenizer("Warm up: hello there", add_special_tokens=False)["input_ids"]
    return ids
