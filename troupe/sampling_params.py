"""`SamplingParams` and `RequestOutputKind`: what a user asks of one request.

Fields, defaults and validation follow vLLM's `SamplingParams` (docs/sampling.md lists every field and
what troupe does with it). Validation runs at construction, so a bad value raises `InvalidInputError`
(a `ValueError`) naming the field and the allowed range before anything reaches the engine. What needs
the model (token ids inside the vocabulary, `logprobs` within `max_logprobs`, `bad_words` tokenized, a
structured-output spec that compiles) is checked where the request enters troupe
(`troupe.inputs.build_request`), again before the engine sees it.
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Any

import msgspec

from troupe.errors import InvalidInputError
from troupe.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what crosses the engine boundary, and a torch seed's range


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling settings of one request (mutable until submitted; the engine copies what it needs)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (plus the sampled one); -1: the whole vocab
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed: the last token of each is banned after the others
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len (vLLM)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Normalise and validate every field (idempotent); raises `InvalidInputError` naming the
        field. Runs at construction, and again when a request is submitted (the struct is mutable)."""
        if self.seed == -1:
            self.seed = None
        self.stop = _string_list("stop", self.stop)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise InvalidInputError("allowed_token_ids", "must not be empty (None allows every token)")
        if self.bad_words is not None:
            self.bad_words = _string_list("bad_words", self.bad_words) or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidInputError("structured_outputs", "must be a StructuredOutputsParams, got "
                                    f"{type(self.structured_outputs).__name__}")
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty"):
            _real(field, getattr(self, field))
        if 0 < self.temperature < _MIN_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {_MIN_TEMPERATURE}; using {_MIN_TEMPERATURE}",
                UserWarning,
                stacklevel=4,
            )
            self.temperature = _MIN_TEMPERATURE
        self._verify()
        if self.temperature < _GREEDY_EPS:  # greedy: the filters mean nothing
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _verify(self) -> None:
        def bad(field: str, message: str) -> InvalidInputError:
            return InvalidInputError(field, message)

        _integer("n", self.n, 1, INT64_MAX)
        if self.n > 1 and self.temperature < _GREEDY_EPS:
            raise bad("n", f"must be 1 with greedy sampling (temperature 0): the {self.n} samples would be equal")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, -1, INT64_MAX, "(0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _integer("seed", self.seed, INT64_MIN, INT64_MAX, "or None (-1 means None)")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1, INT64_MAX, "or None")
        _integer("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.truncate_prompt_tokens is not None:
            _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, INT64_MAX, "(-1: max_model_len) or None")
            if self.truncate_prompt_tokens == 0:
                raise bad("truncate_prompt_tokens", "must be >= 1 or -1 (max_model_len), got 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for field in ("logprobs", "prompt_logprobs"):
            if getattr(self, field) is not None:
                _integer(field, getattr(self, field), -1, INT64_MAX, "(-1: the whole vocabulary) or None")
        for field in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                      "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, f"must be true or false, got {getattr(self, field)!r}")
        if self.stop and not self.detokenize:
            raise bad("stop", "stop strings need detokenize=True")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = [k.name for k in RequestOutputKind]
            if isinstance(self.output_kind, bool) or not isinstance(self.output_kind, int):
                raise bad("output_kind", f"must be one of {kinds}, got {self.output_kind!r}")
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", f"must be one of {kinds}, got {self.output_kind!r}") from None

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


def _real(field: str, value: Any) -> None:
    """A number (int or float, not bool): the range checks in `_verify` compare it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(field, f"must be a number, got {value!r}")


def _integer(field: str, value: Any, lo: int, hi: int, extra: str = "") -> None:
    """An int (not bool) in [lo, hi]; `extra` adds to the message what else is allowed."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        upper = "" if hi == INT64_MAX else f" and <= {hi}"
        more = f" {extra}" if extra else ""
        if lo == INT64_MIN:
            rng = "a signed 64-bit integer (-2**63 <= seed < 2**63)"
        else:
            rng = f"an integer >= {lo}{upper} (and < 2**63)"
        raise InvalidInputError(field, f"must be {rng}{more}, got {value!r}")


def _string_list(field: str, value: Any) -> list[str]:
    """None, a string or a list/tuple of non-empty strings, as a list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise InvalidInputError(field, f"must be a string or a list of strings, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise InvalidInputError(field, f"must hold non-empty strings, got {s!r}")
        if not s.isascii():
            check_utf8(field, s)
    return list(items)


def check_utf8(field: str, text: str) -> None:
    """A string that can cross the engine boundary: UTF-8, so no lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(field, f"must be valid Unicode text (no lone surrogates): {exc.reason} at "
                                f"position {exc.start} of {text!r}") from None


def _int_list(field: str, value: Any) -> list[int]:
    """None or a list/tuple of token ids (ints >= 0, < 2**63), as a list."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise InvalidInputError(field, f"must be a list of token ids, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX:
            raise InvalidInputError(field, f"must be non-negative integers, got {t!r}")
    return list(value)


LOGIT_BIAS_LIMIT = 100.0


def _logit_bias(value: Any) -> dict[int, float] | None:
    """None or {token id: bias}: ids as ints >= 0 (strings of digits too, as JSON sends them), biases
    finite numbers clamped to [-100, 100] (vLLM's range)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInputError("logit_bias", f"must be a mapping of token id to bias, got {type(value).__name__}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT64_MAX:
            raise InvalidInputError("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise InvalidInputError("logit_bias", f"biases must be finite numbers, got {bias!r} for token {key!r}")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return out
