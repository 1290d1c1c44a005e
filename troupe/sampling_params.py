"""`SamplingParams` and `RequestOutputKind`: what a user asks of one request.

Fields, defaults and validation follow vLLM's `SamplingParams` (see
`shared/reference/vllm-semantics.md` §1.4). Validation runs at construction, so a bad value raises
`InvalidInputError` (a `ValueError`) naming the field and the allowed range before anything reaches
the engine. Features the engine does not implement yet (n > 1, logprobs, penalties) are rejected,
never silently ignored.
"""

from __future__ import annotations

import enum
import warnings

import msgspec

from troupe.errors import InvalidInputError

_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2


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
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if 0 < self.temperature < _MIN_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {_MIN_TEMPERATURE}; using {_MIN_TEMPERATURE}",
                UserWarning,
                stacklevel=3,
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

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n != 1:
            raise bad("n", f"n > 1 is not supported yet by troupe (got {self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for field, value, neutral in (
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ):
            if value != neutral:
                raise bad(field, f"penalties are not supported yet by troupe (got {value})")
        if not self.temperature >= 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            raise bad("logprobs", "logprobs are not supported yet by troupe")
        if self.prompt_logprobs is not None:
            raise bad("prompt_logprobs", "prompt_logprobs are not supported yet by troupe")
        assert isinstance(self.stop, list)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"stop strings must be non-empty strings, got {s!r}")
        if self.stop and not self.detokenize:
            raise bad("stop", "stop strings need detokenize=True")
        assert isinstance(self.stop_token_ids, list)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", f"must be one of {[k.name for k in RequestOutputKind]}") from None

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)
