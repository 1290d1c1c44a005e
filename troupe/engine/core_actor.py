"""The engine-core actor: runs an `EngineCore`, stepping in a worker thread.

Inbox:    `EngineInput` (AddRequest, AbortRequest, UtilityCall) from the frontend; in an engine process
          the bridge's stream itself (`ToEngine`), so also `EngineShutdown` (stop: below) and a
          late `EngineStart` (logged and dropped). The actor reads it and never closes it: the
          stream's owner does (after a failure, the engine process reads on until it is told to stop).
Outbox:   `EngineOutput`: one `EngineCoreOutputs` per step, `UtilityResult`s, and `EngineDead`
          if the engine fails (then the actor stops stepping). A failure that belongs to one
          request (its add raising, or anything `EngineCore.step` pins on it) is that request's
          error output instead, and the engine goes on.
Owns:     the EngineCore (not thread-safe: it is only touched by one task at a time, either the
          step thread or, between steps, the event loop).
Shutdown: the inbox closing (EndOfStream) ends the actor once its requests are done;
          `EngineShutdown` ends it after the step in flight, whatever is still running (the
          frontend aborted or gave up on it); cancelling its task group waits for the step in flight
          (a thread cannot be interrupted). After `EngineDead` the actor returns.

The inbox reader never waits for the model: messages are queued in `_pending` while a step runs
and applied between steps, so adds and aborts keep flowing during a forward pass.

Logs: every line carries `actor=engine_core`, `engine=` (the DP rank) and `step=` (the number of the
step being prepared or run, 1-based); lines about a request carry the user's id as `request_id=`,
taken from the message and passed on the line (log context does not cross the process boundary,
and binding it per message costs more). Trace level adds the hop "request received" (inbox) and,
from the EngineCore, "request scheduled", "request finished in engine" and one "step" per step.
"""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple, assert_never

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.errors import InvalidInputError, error_kind
from troupe.handoff import hand_over
from troupe.log import trace, trace_enabled
from troupe.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    EngineInput,
    EngineOutput,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from troupe.process.protocol import EngineShutdown, EngineStart, ToEngine

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore  # torch: the engine process says hello before importing it

log = structlog.get_logger("troupe.engine")

# Methods the frontend may call on the engine with a UtilityCall.
UTILITY_METHODS = frozenset({"reset_prefix_cache", "get_stats", "echo", "fail"})


class EngineActorStats(NamedTuple):
    steps: int
    pending: int
    unfinished: bool


class EngineCoreActor:
    def __init__(self, core: EngineCore, inbox: MemoryObjectReceiveStream[ToEngine],
                 outbox: MemoryObjectSendStream[EngineOutput], *, engine_index: int = 0) -> None:
        self.core = core
        self._inbox = inbox
        self._outbox = outbox
        self.engine_index = engine_index
        self._pending: list[EngineInput] = []
        self._wakeup = anyio.Event()
        self._inbox_closed = False
        self._shutdown = False  # EngineShutdown read: stop after the step in flight
        self._steps = 0
        self.failed = False  # set once EngineDead was sent

    def statistics(self) -> EngineActorStats:
        return EngineActorStats(self._steps, len(self._pending), self.core.has_unfinished_requests())

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="engine_core", engine=self.engine_index)
        async with self._outbox:
            task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_inbox)
                await self._step_loop(self.core)
                tg.cancel_scope.cancel()

    async def _read_inbox(self) -> None:
        async for msg in self._inbox:
            match msg:
                case AddRequest() | AbortRequest() | UtilityCall():
                    if trace_enabled() and isinstance(msg, AddRequest):
                        trace(log, "request received", request_id=msg.external_id, internal_id=msg.request_id,
                              step=self._steps + 1)
                    self._pending.append(msg)
                case EngineShutdown():
                    self._shutdown = True
                    break
                case EngineStart():
                    log.warning("EngineStart after start-up ignored")
                    continue
                case _:
                    assert_never(msg)
            self._wakeup.set()
        self._inbox_closed = True
        self._wakeup.set()

    async def _step_loop(self, core: EngineCore) -> None:
        while not self._shutdown:
            structlog.contextvars.bind_contextvars(step=self._steps + 1)
            await self._apply_pending(core)
            if not core.has_unfinished_requests():
                if core.has_unreported_finishes():
                    # aborts emptied the engine: publish that (stats, finished ids) without a model step
                    await self._outbox.send(core.step())
                if self._inbox_closed:
                    return
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            try:
                outputs = await anyio.to_thread.run_sync(core.step)
            except Exception as exc:  # the engine is broken: say so, and stop
                log.error("engine step failed", exc_info=exc)
                reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.failed = True
                await self._outbox.send(EngineDead(reason=reason, engine_index=self.engine_index))
                return
            self._steps += 1
            await hand_over(self._outbox, outputs)

    async def _apply_pending(self, core: EngineCore) -> None:
        pending, self._pending = self._pending, []
        errors: list[EngineCoreOutput] = []
        for msg in pending:
            match msg:
                case AddRequest():
                    try:
                        core.add_request(msg)
                    except Exception as exc:  # a per-request failure, not an engine failure
                        error = str(exc) if isinstance(exc, InvalidInputError) else f"{type(exc).__name__}: {exc}"
                        log.warning("request rejected", request_id=msg.external_id, internal_id=msg.request_id,
                                    error=error, exc_info=None if isinstance(exc, InvalidInputError) else exc)
                        errors.append(EngineCoreOutput(msg.request_id, [], FinishReason.ERROR, error=error,
                                                       error_kind=error_kind(exc)))
                    else:
                        log.debug("request added", request_id=msg.external_id, internal_id=msg.request_id,
                                  prompt_tokens=len(msg.prompt_token_ids),
                                  since_arrival_s=round(time.time() - msg.arrival_time, 4) if msg.arrival_time else None)
                case AbortRequest():
                    core.abort_requests(msg.request_ids)
                case UtilityCall():
                    await self._outbox.send(self._call_utility(core, msg))
                case _:
                    assert_never(msg)
        if errors:
            await self._outbox.send(EngineCoreOutputs(engine_index=self.engine_index, outputs=errors,
                                                      finished_requests=[e.request_id for e in errors]))

    def _call_utility(self, core: EngineCore, call: UtilityCall) -> UtilityResult:
        try:
            if call.method not in UTILITY_METHODS:
                raise AttributeError(f"no utility method {call.method!r}; known: {sorted(UTILITY_METHODS)}")
            result: Any = getattr(self, f"_utility_{call.method}")(core, *call.args)
        except Exception as exc:
            return UtilityResult(call.call_id, failure=f"Call to {call.method} method failed: {exc}",
                                 engine_index=self.engine_index)
        return UtilityResult(call.call_id, result=result, engine_index=self.engine_index)

    @staticmethod
    def _utility_reset_prefix_cache(core: EngineCore) -> bool:
        return core.reset_prefix_cache()

    @staticmethod
    def _utility_get_stats(core: EngineCore) -> dict[str, Any]:
        return core.get_stats()

    @staticmethod
    def _utility_echo(core: EngineCore, value: Any) -> Any:
        return value

    @staticmethod
    def _utility_fail(core: EngineCore, message: str) -> None:
        raise RuntimeError(message)
