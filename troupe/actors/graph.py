"""The actor graph, wired in one place.

```
 facades --Submission/AbortRequest--> input processor --AddRequest/Abort--> engine side
                                                                               |
 facades <--RequestStream (per request)-- output handler <--EngineOutput-------+
                                             |--AbortRequest (stop strings)--> engine side
```

The engine side (troupe.actors.engine_side) is the EngineCore in its own process behind a ZMQ
bridge (`multiprocess=True`, the default) or in this one; it takes the same two stream ends either
way, and nothing else here knows which.

`Graph` is an async context manager. Entering it starts the engine side first (it returns once the
engine is ready, or raises `EngineStartupError`), loads the tokenizer from the model folder the
engine reports, then starts the frontend actors. Leaving it aborts what is still running (each
stream ends with finish_reason "abort"), closes the submission stream and cancels the actors' task
group: an in-process step in flight finishes first; an engine process is stopped (see
troupe.process.client).

An actor that crashes does not take the caller's code down with it: `_supervised` turns the
crash into `EngineDeadError` for every live and every later request (`RequestTable.fail_all`).
A progress watch logs an engine that finishes no step for `engine_hang_timeout_s` while requests
wait (`AsyncLLM.check_health` raises `EngineHungError` then); it kills nothing.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from troupe.actors.engine_side import EngineSide, MakeCore, make_engine_side
from troupe.actors.input_processor import FrontendInput, InputProcessor
from troupe.actors.output_handler import OutputHandler
from troupe.actors.requests import RequestTable
from troupe.config import EngineConfig
from troupe.inputs import ModelLimits
from troupe.messages import EngineInput, EngineOutput
from troupe.models.loader import load_tokenizer, resolve_model_path

log = structlog.get_logger("troupe.graph")

STREAM_BUFFER = 64


class Graph(anyio.AsyncContextManagerMixin):
    """The running actor graph of one `AsyncLLM`."""

    def __init__(self, config: EngineConfig, *, make_core: MakeCore | None = None) -> None:
        self.config = config
        self._make_core = make_core
        self.table: RequestTable = None  # type: ignore[assignment]  # made once the tokenizer is loaded
        self.tokenizer: Any = None
        self.limits: ModelLimits | None = None
        self.submit: MemoryObjectSendStream[FrontendInput] | None = None
        self.engine: EngineSide | None = None
        self.output_handler: OutputHandler | None = None
        self.input_processor: InputProcessor | None = None
        self._early_failure: tuple[str, BaseException] | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Graph]:
        # 1. every stream, bounded; each task gets its own clone of a shared end
        to_engine_send, to_engine_recv = anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
        from_engine_send, from_engine_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        submit_send, submit_recv = anyio.create_memory_object_stream[FrontendInput](STREAM_BUFFER)
        # every end is closed on the way out, also those an actor never got to (a failed start)
        with to_engine_send, to_engine_recv, from_engine_send, from_engine_recv, submit_send, submit_recv:
            async with anyio.create_task_group() as tg:
                # 2. the engine side first: its model decides the limits the frontend checks against
                self.engine = make_engine_side(self.config, to_engine_recv, from_engine_send, make_core=self._make_core)
                tokenizer = _TokenizerPrefetch()  # transformers takes seconds to load: overlap the engine's start
                tg.start_soon(tokenizer.load, self.config.model)
                await tg.start(self._supervised, "engine", self.engine.run)
                ready = self.engine.ready
                self.tokenizer = await tokenizer.get(ready.model_path)
                self.table = RequestTable(self.tokenizer)
                if self._early_failure is not None:
                    self.table.fail_all(*self._early_failure)
                self.limits = ready.limits
                # 3. the frontend actors
                self.output_handler = OutputHandler(self.table, from_engine_recv, to_engine_send.clone(),
                                                    chunk_size=self.config.output_chunk_size)
                await tg.start(self._supervised, "output_handler", self.output_handler.run)
                self.input_processor = InputProcessor(self.tokenizer, self.limits, self.table, submit_recv,
                                                      to_engine_send)
                await tg.start(self._supervised, "input_processor", self.input_processor.run)
                if self.config.engine_hang_timeout_s is not None:
                    tg.start_soon(self._watch_progress, self.config.engine_hang_timeout_s)
                self.submit = submit_send
                log.info("graph ready", model=self.config.model, max_model_len=self.limits.max_model_len,
                         kv_blocks=ready.num_blocks, engine_pids=self.engine.pids)
                try:
                    yield self
                finally:
                    # 4. shutdown: end every stream, stop taking work, then stop the actors
                    self.table.abort(list(self.table.streams))
                    submit_send.close()
                    tg.cancel_scope.cancel()

    async def _supervised(self, name: str, run: Callable[..., Awaitable[None]], *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        status = _Started(task_status)
        try:
            await run(task_status=status)
        except Exception as exc:
            if not status.done:
                raise  # a start-up failure: the caller of start() gets it
            log.error("actor crashed", crashed_actor=name, exc_info=exc)
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if self.table is None:
                self._early_failure = (f"{name} crashed: {reason}", exc)
            else:
                self.table.fail_all(f"{name} crashed: {reason}", exc)

    async def _watch_progress(self, limit_s: float) -> None:
        """Log an engine that finishes no step for `limit_s` while requests wait (and its recovery)."""
        hung = False
        while True:
            await anyio.sleep(min(1.0, limit_s / 4))
            stalled = self.table.stalled_for()
            if not hung and stalled > limit_s:
                hung = True
                log.warning("engine hung: no step finished while requests wait", stalled_s=round(stalled, 1),
                            waiting=self.table.num_unfinished, engine_pids=self.engine.pids if self.engine else [])
            elif hung and stalled <= limit_s:
                hung = False
                log.info("engine progressing again")


class _TokenizerPrefetch:
    """Loads the tokenizer while the engine starts; `get(path)` falls back to loading from the
    folder the engine reports if the prefetch failed or resolved another folder."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._path: str | None = None
        self._tokenizer: Any = None

    async def load(self, model: str) -> None:
        try:
            self._path, self._tokenizer = await anyio.to_thread.run_sync(_resolve_and_load, model,
                                                                         abandon_on_cancel=True)
        except Exception:  # the engine reports the real problem (or get() raises it again)
            pass
        finally:
            self._done.set()

    async def get(self, model_path: str) -> Any:
        await self._done.wait()
        if self._tokenizer is not None and self._path == model_path:
            return self._tokenizer
        return await anyio.to_thread.run_sync(load_tokenizer, model_path)


def _resolve_and_load(model: str) -> tuple[str, Any]:
    path = str(resolve_model_path(model))
    return path, load_tokenizer(path)


T = TypeVar("T")


class _Started(Generic[T]):
    """A `TaskStatus` that remembers whether `started()` was called."""

    def __init__(self, inner: TaskStatus[T]) -> None:
        self._inner = inner
        self.done = False

    def started(self, value: T | None = None) -> None:
        self.done = True
        self._inner.started(value)  # type: ignore[arg-type]
