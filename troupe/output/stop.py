"""Stop strings: finding them in freshly decoded text, and how much text to hold back.

Stop strings are a frontend feature (the engine only knows stop *token ids*). After each step the
detokenizer appends the new text and calls `check_stop_strings` on it. Only the new characters
plus an overlap of `len(stop) - 1` characters before them are searched, so a stop string spanning a
token (or step) boundary is found exactly once and the cost per step does not grow with the
output length.

While a request runs, the last `hold_back_length(...)` characters are withheld from what the user
sees, so a stop string that is only partly generated is never emitted (vLLM's
`output_text_buffer_length`). With `include_stop_str_in_output` nothing needs withholding: the
stop string ends up in the output anyway.
"""

from __future__ import annotations

from collections.abc import Sequence


def hold_back_length(stop: Sequence[str], include_stop_str_in_output: bool) -> int:
    """Characters to withhold from a running request's text: `max(len(stop)) - 1`, or 0."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string that ends within the last `new_char_count` characters.

    Returns `(stop_string, truncate_to)`, where `output_text[:truncate_to]` is the text to keep:
    up to the start of the stop string, or up to its end with `include_in_output`
    (`truncate_to == -1` means keep everything). Returns None when no stop string matched.

    Unlike vLLM, which takes the first *listed* stop string that matches, this takes the one that
    starts first in the text (ties go to the earlier listed), so a step that adds several tokens
    stops at the first stop string the user would have seen. With one token per step the two
    agree almost always.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    best_start = -1
    best = ""
    for s in stop:
        # Search the new characters plus len(s) - 1 characters before them (the overlap).
        start = text_len - new_char_count - len(s) + 1
        found = output_text.find(s, start if start > 0 else 0)
        if found != -1 and (best_start == -1 or found < best_start):
            best_start, best = found, s
    if best_start == -1:
        return None
    if not include_in_output:
        return best, best_start
    end = best_start + len(best)
    return best, (-1 if end >= text_len else end)
