"""The output handler actor: engine outputs -> per-request `RequestOutput`s.

Inbox:    `EngineOutput` from the engine(s) (through the balancer when there are several).
Outbox:   `AbortRequest`s to the engine side for requests that finished on a stop string (the
          engine does not know about stop strings), per-request streams (`RequestStream`), and
          `ReleaseChildren` to the input processor (n > 1: child 0 has computed the shared prompt).
Owns:     nothing but its task; request state lives in the shared `RequestTable`, what the engines
          report of themselves in the shared `EngineStats`.
Calls:    the table through `OutputSink` (deliver a slice, answer a utility call, the engine's death)
          and the statistics through `StatsRecorder`: nothing else.
Shutdown: EndOfStream on the inbox, or cancellation.

Each `EngineCoreOutputs` is processed in slices of at most `chunk_size` entries with a checkpoint
between slices, so a step with thousands of requests never holds the event loop for long.

Logs (`actor=output_handler`): the canonical "request finished" line of each request (through the
`RequestTable`), "engine died", and at trace level "outputs received", one line per engine step with
its lag since the engine sent it.
"""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple, Protocol, assert_never

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.actors.input_processor import FrontendInput, ReleaseChildren
from troupe.errors import EngineDeadError
from troupe.log import trace, trace_enabled
from troupe.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    EngineInput,
    EngineOutput,
    UtilityResult,
)

log = structlog.get_logger("troupe.output")


class OutputSink(Protocol):
    """What the output handler may do with the request table (troupe.actors.requests.RequestTable)."""

    def process_slice(self, outputs: list[EngineCoreOutput],
                      engine_index: int | None = None) -> tuple[list[str], list[str]]: ...

    def resolve_utility(self, result: UtilityResult) -> None: ...

    def fail_all(self, reason: str, cause: BaseException | None = None) -> EngineDeadError: ...


class StatsRecorder(Protocol):
    """What the output handler may do with the engine statistics (troupe.actors.engine_stats.EngineStats)."""

    def record(self, msg: EngineCoreOutputs) -> None: ...

    def progressed(self) -> None: ...


class OutputHandlerStats(NamedTuple):
    steps_processed: int
    entries_processed: int
    slices: int


class OutputHandler:
    def __init__(self, table: OutputSink, stats: StatsRecorder, inbox: MemoryObjectReceiveStream[EngineOutput],
                 to_engine: MemoryObjectSendStream[EngineInput], *, chunk_size: int = 128,
                 to_input: MemoryObjectSendStream[FrontendInput] | None = None) -> None:
        self._table = table
        self._stats = stats
        self._inbox = inbox
        self._to_engine = to_engine
        self._to_input = to_input
        self.chunk_size = chunk_size
        self._steps = self._entries = self._slices = 0

    def statistics(self) -> OutputHandlerStats:
        return OutputHandlerStats(self._steps, self._entries, self._slices)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="output_handler")
        task_status.started()
        async with self._inbox, self._to_engine, contextlib.AsyncExitStack() as stack:
            if self._to_input is not None:
                await stack.enter_async_context(self._to_input)
            async for msg in self._inbox:
                match msg:
                    case EngineCoreOutputs():
                        await self._process(msg)
                    case UtilityResult():
                        self._stats.progressed()
                        self._table.resolve_utility(msg)
                    case EngineDead():
                        log.error("engine died", engine=msg.engine_index, reason=msg.reason)
                        self._table.fail_all(msg.reason)
                    case _:
                        assert_never(msg)

    async def _process(self, msg: EngineCoreOutputs) -> None:
        self._steps += 1
        self._stats.record(msg)
        outputs = msg.outputs
        if trace_enabled():
            trace(log, "outputs received", engine=msg.engine_index, outputs=len(outputs),
                  finished=len(msg.finished_requests), lag_s=round(time.monotonic() - msg.timestamp, 5),
                  engine_step=msg.scheduler_stats.step_counter if msg.scheduler_stats else None)
        for start in range(0, len(outputs), self.chunk_size):
            if start:
                await anyio.lowlevel.checkpoint()  # let other tasks run between slices
            to_abort, release = self._table.process_slice(outputs[start:start + self.chunk_size], msg.engine_index)
            self._slices += 1
            if to_abort:
                await self._to_engine.send(AbortRequest(to_abort))
            if self._to_input is not None:
                for parent_id in release:
                    await self._to_input.send(ReleaseChildren(parent_id))
        self._entries += len(outputs)
