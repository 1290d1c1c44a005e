"""`FrontendPort`: all that a facade (`AsyncLLM`) may do with the running actor graph.

The graph (troupe.actors.graph.Graph) implements it; its request table, streams and actors stay its
own. Five things: submit a request, abort requests, call a utility method of the engines, read the
graph's health (the engine's death, a stall) and its statistics; plus what the engines reported at
start-up (tokenizer, limits, process ids) and `stop()`.

Contract: every method is called from the graph's event loop; none raises `ExceptionGroup`.
`submit` answers with the request's registered stream or raises its validation error; a caller
cancelled while waiting leaves nothing behind (the request is not sent, or is aborted).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from troupe.actors.input_processor import Submission
    from troupe.actors.requests import RequestStream
    from troupe.errors import EngineDeadError
    from troupe.inputs import ModelLimits
    from troupe.messages import SchedulerStats


class FrontendPort(Protocol):
    tokenizer: Any  # the frontend's tokenizer (loaded from the model folder the engine reports)
    limits: ModelLimits | None  # what requests are checked against (None until the engines are ready)

    @property
    def pids(self) -> list[int]:
        """Process ids of the engine processes the graph started and that still run."""
        ...

    # ------------------------------------------------------------ requests

    async def submit(self, sub: Submission) -> RequestStream:
        """Send one request to the input processor; its registered stream, or its error raised."""
        ...

    async def abort(self, request_ids: str | Iterable[str], *, internal: bool = False) -> None:
        """End requests with finish_reason "abort" and stop them in the engine: by the users' ids (each
        request under one), or with `internal` by the graph's own (`RequestStream.request_id`)."""
        ...

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method(*args)` on the engine(s) and return the result; a failure in the engine is a
        `RuntimeError` naming it, the engine's death its `EngineDeadError`."""
        ...

    # ------------------------------------------------------------ health and statistics

    @property
    def dead_error(self) -> EngineDeadError | None:
        """The engine's death, once it happened: every live and later request fails with it."""
        ...

    def stalled_for(self) -> tuple[float, int | None]:
        """(seconds, engine rank or None): the longest time an engine holding requests made no step."""
        ...

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished."""
        ...

    @property
    def num_unanswered(self) -> int:
        """Submissions and utility calls whose callers still wait for an answer."""
        ...

    @property
    def engine_stats(self) -> dict[int, SchedulerStats]:
        """The latest scheduler stats each engine published, by engine index."""
        ...

    async def stop(self) -> None:
        """Stop the graph now (every request aborted, every actor and engine stopped); idempotent."""
        ...
