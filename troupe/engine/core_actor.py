"""The engine-core actor: runs an `EngineCore` in its own step thread, fed by the event loop.

Inbox:    `EngineInput` (AddRequest, AbortRequest, UtilityCall) from the frontend; in an engine process
          the bridge's stream itself (`ToEngine`), so also `EngineShutdown` (stop: below) and a
          late `EngineStart` (logged and dropped). The actor reads it and never closes it: the
          stream's owner does (after a failure, the engine process reads on until it is told to stop).
Outbox:   `EngineOutput`: one `EngineCoreOutputs` per step, `UtilityResult`s, and `EngineDead`
          if the engine fails (then the actor stops stepping). A failure that belongs to one
          request (its add raising, or anything `EngineCore.step` pins on it) is that request's
          error output instead, and the engine goes on.
Owns:     the EngineCore (not thread-safe: only the step thread touches it once the actor runs), and
          the step thread unless its owner passed one in (`step_thread`: the thread that built the core).
Shutdown: the inbox closing (EndOfStream) ends the actor once its requests are done;
          `EngineShutdown` ends it after the step in flight, whatever is still running (the
          frontend aborted or gave up on it); cancelling its task group waits for the step in flight
          (a thread cannot be interrupted). After `EngineDead` the actor returns.

Two halves (issue 43, "engine loop without a thread-pool hop per step"). The step thread, one per
actor for its whole life, loops: take what the inbox brought (`_pending`), apply it (adds, aborts,
utility calls), run a step, queue the outputs (`_emit`), and go on at once; it sleeps on a condition only
when there is nothing to run. The event loop reads the inbox into `_pending` (never waiting for the
model: adds and aborts keep flowing during a forward pass and are applied between steps) and sends what
the thread queued to the outbox, in order (`_forward`); the messages read in one pass of the loop reach
the thread together (`_flush`), so a burst of adds starts in one step, as it did when the loop ran it. The thread wakes the loop only when the
forwarder sleeps (one `call_soon_threadsafe`, troupe runs on asyncio), and runs at most `MAX_AHEAD`
outputs ahead of it, so the outbox's back-pressure still reaches the model. Against a thread-pool call per
step (`anyio.to_thread.run_sync`: a hop to the pool and one back to the loop before the next step can
start) this saves the round trip: measured on the null model, one request, 2-core Xeon (AMX), 0.15-0.18 ms
of a 0.28-0.31 ms step.

One thread for all of an engine's torch work. OpenMP keeps a thread team per calling thread, and libgomp
throttles its idle threads' spinning once the teams hold more threads than the machine has cores: they
sleep between parallel regions and are woken at almost every op. A core built on one thread (its
warm-up runs kernels) and stepped on another keeps two teams, and on 2 cores each decode step took 10 ms
instead of 5 (the default model, one request, Zen 4). So an engine's owner creates its step thread first
(`step_thread()`), builds the core on it (`run_on`) and hands it to the actor, which runs its loop there.

Logs: every line carries `actor=engine_core`, `engine=` (the DP rank) and `step=` (the number of the
step being prepared or run, 1-based); lines about a request carry the user's id as `request_id=`,
taken from the message and passed on the line (log context does not cross the process boundary,
and binding it per message costs more). Trace level adds the hop "request received" (inbox) and,
from the EngineCore, "request scheduled", "request finished in engine" and one "step" per step.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, assert_never

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
MAX_AHEAD = 2  # outputs the step thread may have queued that the event loop has not sent on yet


T = TypeVar("T")


class StepThread:
    """One thread that runs what is submitted to it in order, `submit(fn, *args, **kwargs)` -> `Future`, until
    `shutdown()` (or leaving `with`) ends it after the work already submitted and joins it.

    Not a one-thread `ThreadPoolExecutor`: at interpreter exit, concurrent.futures joins its pools' threads
    before any atexit hook runs, so an in-process engine left running (an `LLM` its user never closed,
    whose `weakref.finalize` is one of those hooks) hung the exit on its own step loop. This thread is a
    daemon: the exit goes on to the hooks, and the finalizer stops the engine and joins it."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # the caller's to see, as a pool would hand it over
                    future.set_exception(exc)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self) -> None:
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> StepThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def step_thread(engine_index: int) -> StepThread:
    """The thread that builds an engine's core and runs its steps (module docstring: one OpenMP team),
    named `troupe-step-N`; its creator shuts it down (`with step_thread(i) as pool:`)."""
    return StepThread(f"troupe-step-{engine_index}")


async def run_on(pool: StepThread, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on `pool`'s thread, awaited from the event loop (a cancelled wait still waits for it:
    a thread cannot be interrupted)."""
    future = pool.submit(fn, *args)
    return await anyio.to_thread.run_sync(future.result)


class EngineActorStats(NamedTuple):
    steps: int
    pending: int
    unfinished: bool


class EngineCoreActor:
    def __init__(self, core: EngineCore, inbox: MemoryObjectReceiveStream[ToEngine],
                 outbox: MemoryObjectSendStream[EngineOutput], *, engine_index: int = 0,
                 step_thread: StepThread | None = None) -> None:
        self.core = core
        self._pool = step_thread  # None: the actor makes its own and shuts it down
        self._inbox = inbox
        self._outbox = outbox
        self.engine_index = engine_index
        # shared with the step thread, under `_cond`: what the inbox brought, what the thread produced
        self._cond = threading.Condition()
        self._inbound: list[EngineInput] = []  # the event loop's: read, not yet handed to the thread
        self._flush_scheduled = False
        self._pending: list[EngineInput] = []
        self._inbox_closed = False
        self._stop = False  # EngineShutdown read, or the actor cancelled: stop after the step in flight
        self._out: deque[EngineOutput] = deque()
        self._thread_done = False
        self._out_waiter: tuple[asyncio.AbstractEventLoop, anyio.Event] | None = None  # the forwarder, asleep
        self._crash: BaseException | None = None  # what the step thread raised outside a step
        self._steps = 0
        self.failed = False  # set once EngineDead was sent

    def statistics(self) -> EngineActorStats:
        return EngineActorStats(self._steps, len(self._pending) + len(self._inbound),
                                self.core.has_unfinished_requests())

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="engine_core", engine=self.engine_index)
        context = contextvars.copy_context()  # the step thread logs with the actor's bindings
        pool = self._pool or step_thread(self.engine_index)
        async with self._outbox:
            loop_done = pool.submit(context.run, self._step_thread)
            try:
                task_status.started()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read_inbox)
                    await self._forward()
                    tg.cancel_scope.cancel()
            finally:  # cancelled, or done: the thread stops after its step in flight (it cannot be interrupted)
                with self._cond:
                    self._stop = True
                    self._cond.notify_all()
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(loop_done.result)
                    if self._pool is None:
                        pool.shutdown()
        if self._crash is not None:
            raise self._crash

    async def _read_inbox(self) -> None:
        async for msg in self._inbox:
            match msg:
                case AddRequest() | AbortRequest() | UtilityCall():
                    if trace_enabled() and isinstance(msg, AddRequest):
                        trace(log, "request received", request_id=msg.external_id, internal_id=msg.request_id,
                              step=self._steps + 1)
                    self._inbound.append(msg)
                    if not self._flush_scheduled:
                        self._flush_scheduled = True
                        asyncio.get_running_loop().call_soon(self._flush)
                case EngineShutdown():
                    with self._cond:
                        self._stop = True
                        self._cond.notify()
                    return
                case EngineStart():
                    log.warning("EngineStart after start-up ignored")
                case _:
                    assert_never(msg)
        self._flush()
        with self._cond:
            self._inbox_closed = True
            self._cond.notify()

    def _flush(self) -> None:
        """Hand what the inbox brought to the step thread, from a loop callback (`call_soon`): the messages read
        in one pass of the loop (a burst of adds) reach the thread together, so a step takes all of them."""
        self._flush_scheduled = False
        if self._inbound:
            with self._cond:
                self._pending += self._inbound
                self._cond.notify()
            self._inbound = []

    async def _forward(self) -> None:
        """The event loop's half: what the step thread produced, to the outbox in order, until the thread is
        done. The thread only wakes this task when it sleeps (`_out_waiter`), one `call_soon_threadsafe`."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                items = list(self._out)
                self._out.clear()
                if items:
                    self._cond.notify_all()  # room for a thread waiting in `_emit`
                elif self._thread_done:
                    return
                else:
                    event = anyio.Event()
                    self._out_waiter = (loop, event)
            if not items:
                await event.wait()
                continue
            for item in items:
                await hand_over(self._outbox, item)

    # ------------------------------------------------------------------ the step thread

    def _emit(self, item: EngineOutput) -> None:
        """Queue `item` for the forwarder (waiting while `MAX_AHEAD` are queued: the outbox's back-pressure
        reaches the thread) and wake the forwarder if it sleeps."""
        with self._cond:
            while len(self._out) >= MAX_AHEAD and not self._stop:
                self._cond.wait()
            self._out.append(item)
        self._wake_forwarder()

    def _wake_forwarder(self) -> None:
        """Wake the forwarder if it sleeps (from the step thread: one `call_soon_threadsafe`)."""
        with self._cond:
            waiter, self._out_waiter = self._out_waiter, None
        if waiter is not None:
            waiter[0].call_soon_threadsafe(waiter[1].set)

    def _step_thread(self) -> None:
        """Apply what the inbox brought and step, in turn, until the inbox closes with nothing left to run
        or the actor stops; the only thread that touches the core once the actor runs."""
        try:
            self._step_loop(self.core)
        except BaseException as exc:  # a bug of the actor's own, not a step's: `run` raises it
            self._crash = exc
        finally:
            with self._cond:
                self._thread_done = True
            self._wake_forwarder()

    def _step_loop(self, core: EngineCore) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._stop or self._inbox_closed or core.has_unfinished_requests()
                           or core.has_unreported_finishes()):
                    self._cond.wait()
                if self._stop:
                    return
                pending, self._pending = self._pending, []
                closed = self._inbox_closed
            structlog.contextvars.bind_contextvars(step=self._steps + 1)
            self._apply_pending(core, pending)
            if core.has_unfinished_requests():
                try:
                    outputs = core.step()
                except Exception as exc:  # the engine is broken: say so, and stop
                    log.error("engine step failed", exc_info=exc)
                    reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    self.failed = True
                    self._emit(EngineDead(reason=reason, engine_index=self.engine_index))
                    return
                self._steps += 1
                self._emit(outputs)
            elif core.has_unreported_finishes():
                # aborts emptied the engine: publish that (stats, finished ids) without a model step
                self._emit(core.step())
            elif closed and not self._pending:
                return

    def _apply_pending(self, core: EngineCore, pending: list[EngineInput]) -> None:
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
                    self._emit(self._call_utility(core, msg))
                case _:
                    assert_never(msg)
        if errors:
            self._emit(EngineCoreOutputs(engine_index=self.engine_index, outputs=errors,
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
