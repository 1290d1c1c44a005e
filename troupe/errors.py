"""The few named errors troupe raises.

- `InvalidInputError` (a `ValueError`): bad user input, caught at the edge; names the field and
  what is allowed. The engine stays healthy.
- `EngineDeadError`: fatal. Every in-flight request gets it and every new request raises it.
- `ModelLoadError` (a `ValueError`): a model path, file or config that cannot be loaded.
- `EngineStartupError`: the engine could not start (in its process or in this one); it carries the
  root cause and its traceback text. Nothing is left running.
- `EngineHungError`: raised by `check_health()` when the engine is alive but has finished no step
  for `engine_hang_timeout_s` while requests wait. Nothing is killed.

A request that fails on its own (its sampling, its detokenization, ...) raises nothing: it finishes
with finish_reason "error", `RequestOutput.error` (the text) and `RequestOutput.error_kind` (whose fault:
`ErrorKind`, decided by `error_kind` from the exception where it was raised, so that no caller has to
parse the text: the server answers "invalid_request" with a 400 and "internal" with a 500).
`single_error` picks the one exception the facades raise when several tasks failed at once, so an
`ExceptionGroup` never reaches a user.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

ErrorKind = Literal["invalid_request", "internal"]
"""Whose fault a request's own failure was: "invalid_request" (its parameters, e.g. constraints that leave
no token to sample; the client must change the request) or "internal" (troupe's or the model's)."""


class InvalidInputError(ValueError):
    """Bad input for one request: `field` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NoTokenAllowedError(RuntimeError):
    """Every token of a request's logits row is masked (its allowed_token_ids, bad_words, min_tokens and
    structured-output grammar leave none): nothing can be sampled, so that request fails. Raised in the
    engine's sampler; `error_kind` files it under "invalid_request" (the request's own parameters
    contradict each other: the server's HTTP 400), not "internal" (500)."""


def error_kind(exc: BaseException) -> ErrorKind:
    """Whose fault a request's own failure was, from the exception that failed it."""
    return "invalid_request" if isinstance(exc, (InvalidInputError, NoTokenAllowedError)) else "internal"


class RequestFailure(NamedTuple):
    """Why one request failed on its own inside the engine: the text its caller gets, and whose fault."""

    error: str
    kind: ErrorKind = "internal"


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


class EngineDeadError(RuntimeError):
    """The engine died; no request can be served any more. `__cause__` holds the root cause."""

    def __init__(self, message: str = "EngineCore died; see the cause for the root error.") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """An unexpected error inside one `generate()` call; the request was aborted."""


class EngineStartupError(RuntimeError):
    """The engine failed to start: `cause_type` and `cause_message` name the root cause, and
    `engine_traceback` is its traceback text (from the engine process when it ran in one)."""

    def __init__(self, message: str, *, cause_type: str = "", cause_message: str = "",
                 engine_traceback: str = "") -> None:
        text = f"{message}\n\nEngine traceback:\n{engine_traceback.rstrip()}" if engine_traceback else message
        super().__init__(text)
        self.cause_type = cause_type
        self.cause_message = cause_message
        self.engine_traceback = engine_traceback

    @classmethod
    def from_cause(cls, exc: BaseException, traceback_text: str) -> EngineStartupError:
        return cls(f"EngineCore failed to start: {type(exc).__name__}: {exc}", cause_type=type(exc).__name__,
                   cause_message=str(exc), engine_traceback=traceback_text)


class EngineHungError(RuntimeError):
    """The engine is alive but finished no step for `stalled_s` seconds while requests waited."""

    def __init__(self, stalled_s: float, waiting: int, timeout_s: float) -> None:
        super().__init__(f"EngineCore looks hung: no step finished for {stalled_s:.1f} s while {waiting} "
                         f"request(s) wait (engine_hang_timeout_s={timeout_s:g}); it was not stopped")
        self.stalled_s = stalled_s
        self.waiting = waiting


def leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    """Every exception inside (nested) groups, depth first."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def single_error(group: BaseExceptionGroup[Any], prefer: BaseException | None = None) -> BaseException:
    """The one exception the facades raise for a group that crossed task groups (an
    `ExceptionGroup` never reaches a troupe user): `prefer` (what the caller's own code raised)
    when it is the group or inside it; else the first `KeyboardInterrupt`/`SystemExit`, then
    `EngineStartupError`, `EngineDeadError`, any other `Exception`; a cancellation last."""
    found = leaves(group)
    if prefer is not None and (prefer is group or any(e is prefer for e in found)):
        return prefer
    for kinds in ((KeyboardInterrupt, SystemExit), (EngineStartupError,), (EngineDeadError,), (Exception,)):
        for exc in found:
            if isinstance(exc, kinds):
                return exc
    return found[0]


def first_startup_error(group: BaseExceptionGroup[EngineStartupError]) -> EngineStartupError:
    """The first `EngineStartupError` inside (nested) groups: what a failed start-up raises, whatever
    task groups it crossed on its way out."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, EngineStartupError)
    return exc
