"""`Reply[T]`: a typed one-shot answer from an actor to the one task that waits for it.

Contract:
- The actor answers once: `send(value)` or `fail(exc)`; a second answer is refused (returns False), so
  racing answerers (an actor and the graph's `fail_all`) need no coordination.
- The waiter awaits it once: `await wait()` returns the value or raises the exception.
- A waiter that goes away (cancelled, or failed while sending the request) calls `abandon()`: an answer
  after that is refused, so the actor drops its work; `abandon()` returns the value if one was already
  sent, which the waiter must then undo (e.g. abort the request it names).
- Event-loop only (no locks): `pending` checked and `send` called with no await between them cannot
  interleave with another answer or `abandon()`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Reply(Generic[T]):
    __slots__ = ("_abandoned", "_answered", "_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._answered = False
        self._abandoned = False

    @property
    def pending(self) -> bool:
        """Neither answered nor abandoned: an answer now would be taken."""
        return not (self._answered or self._abandoned)

    @property
    def abandoned(self) -> bool:
        """The waiter went away: an answer now would be refused."""
        return self._abandoned

    def send(self, value: T) -> bool:
        """Answer with `value`; False (and nothing kept) if already answered or abandoned."""
        if self._answered or self._abandoned:
            return False
        self._value, self._answered = value, True
        self._event.set()
        return True

    def fail(self, exc: BaseException) -> bool:
        """Answer with an exception that `wait()` raises; False if already answered or abandoned."""
        if self._answered or self._abandoned:
            return False
        self._error, self._answered = exc, True
        self._event.set()
        return True

    def abandon(self) -> T | None:
        """The waiter goes away; returns the value already sent, if any (its to undo)."""
        self._abandoned = True
        return self._value if self._answered and self._error is None else None

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # answered with a value: T (which may be None)
