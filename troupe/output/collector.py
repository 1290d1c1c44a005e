"""`RequestOutputCollector`: the hand-off point between the output processor and one consumer.

Pure and synchronous: the producer calls `put` / `put_error`, the consumer polls `get_nowait`.
When the consumer falls behind, pending outputs are merged instead of queued, so memory per
request stays bounded:

- DELTA: the newer output is appended to the pending one (text and token ids concatenated per
  sample index), so nothing is lost;
- CUMULATIVE / FINAL_ONLY: the newer output replaces the pending one per sample index (it
  already contains everything).

An error put with `put_error` wins over any pending output and is sticky: every later
`get_nowait` raises it and later `put`s are ignored.

Async wrapping: `on_ready` is called whenever the collector goes from empty to ready (an output
or an error is waiting). An async shell passes something like `lambda: self._event.set()` and
waits with::

    while (out := collector.get_nowait()) is None:
        await self._event.wait()
        self._event = anyio.Event()

(check `get_nowait` before waiting, so a wake-up that came before the wait is not lost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind


class OutputSink(Protocol):
    """Where a request's outputs go for its consumer: this collector's interface, which the
    frontend's `RequestStream` (troupe.actors.requests) wraps with a wake-up event."""

    def put(self, output: RequestOutput) -> None: ...

    def put_error(self, exc: BaseException) -> None: ...


class RequestOutputCollector:
    """One request's pending output (or error) for its consumer."""

    __slots__ = ("aggregate", "on_ready", "_output", "_error")

    def __init__(self, output_kind: RequestOutputKind, on_ready: Callable[[], None] | None = None) -> None:
        self.aggregate = output_kind is RequestOutputKind.DELTA
        self.on_ready = on_ready
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None

    @property
    def ready(self) -> bool:
        """True when `get_nowait` would return an output or raise."""
        return self._output is not None or self._error is not None

    def put(self, output: RequestOutput) -> None:
        """Hand over an output, merging it into a pending one (see module docstring)."""
        if self._error is not None:
            return
        if self._output is None:
            self._output = output
            if self.on_ready is not None:
                self.on_ready()
        else:
            self._output.add(output, aggregate=self.aggregate)

    def put_error(self, exc: BaseException) -> None:
        """Make the consumer's next `get_nowait` (and every later one) raise `exc`."""
        was_ready = self.ready
        if self._error is None:
            self._error = exc
        self._output = None
        if not was_ready and self.on_ready is not None:
            self.on_ready()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output (taken), None if there is none; raises a stored error."""
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        return output
