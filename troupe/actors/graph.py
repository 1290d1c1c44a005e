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

import contextlib
import dataclasses
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from troupe.actors.dp_balancer import DPBalancer
from troupe.actors.engine_side import EngineSide, make_engine_side
from troupe.actors.input_processor import FrontendInput, InputProcessor
from troupe.actors.output_handler import OutputHandler
from troupe.actors.requests import RequestTable
from troupe.config import EngineConfig
from troupe.engine.build import EngineReady, MakeCore
from troupe.errors import EngineStartupError, first_startup_error
from troupe.inputs import ModelLimits
from troupe.messages import EngineInput, EngineOutput, SchedulerStats
from troupe.models.loader import load_tokenizer, resolve_model_path
from troupe.testing import faults

log = structlog.get_logger("troupe.graph")
GRAPH = "graph"  # its lines name the actor explicitly: the graph runs in its caller's task, whose
# context is the caller's own (and a module-level `bind` would freeze the logging configuration)

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
        self.engines: list[EngineSide] = []
        self.balancer: DPBalancer | None = None
        self.output_handler: OutputHandler | None = None
        self.input_processor: InputProcessor | None = None
        self._early_failure: tuple[str, BaseException] | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the engine processes this graph started and that still run."""
        return [pid for side in self.engines for pid in side.pids]

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Graph]:
        n = self.config.data_parallel_size
        # 1. every stream, bounded; each task gets its own clone of a shared end. With several
        #    engines the balancer sits between: frontend -> balancer -> engine r, engines -> balancer
        #    -> output handler; with one, the frontend talks to the engine directly.
        to_engine_send, to_engine_recv = anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
        from_engine_send, from_engine_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        submit_send, submit_recv = anyio.create_memory_object_stream[FrontendInput](STREAM_BUFFER)
        per_engine = [anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER) for _ in range(n)] if n > 1 else []
        merged_send, merged_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        # every end is closed on the way out, also those an actor never got to (a failed start)
        with contextlib.ExitStack() as ends:
            for end in (to_engine_send, to_engine_recv, from_engine_send, from_engine_recv, submit_send, submit_recv,
                        merged_send, merged_recv, *(e for pair in per_engine for e in pair)):
                ends.enter_context(end)
            async with anyio.create_task_group() as tg:
                # 2. the engine sides first: their model decides the limits the frontend checks against
                if n == 1:
                    inboxes, outbox = [to_engine_recv], from_engine_send
                else:
                    inboxes, outbox = [recv for _, recv in per_engine], merged_send
                clones = [ends.enter_context(outbox.clone()) for _ in inboxes]  # closed here too if never used
                self.engines = [make_engine_side(self.config, inbox, clone, make_core=self._make_core,
                                                 engine_index=rank)
                                for rank, (inbox, clone) in enumerate(zip(inboxes, clones, strict=True))]
                outbox.close()  # the engines hold clones: the stream ends when the last engine stops
                tokenizer = _TokenizerPrefetch()  # transformers takes seconds to load: overlap the engines' start
                tg.start_soon(tokenizer.load, self.config.model)
                await self._start_engines(tg)
                first = self.engines[0].ready
                # the tokenizer from rank 0's folder if it runs here; headless engines' paths are theirs
                self.tokenizer = await tokenizer.get(first.model_path if self.config.num_local_engines else None)
                self.table = RequestTable(self.tokenizer)
                faults.install_frontend(self.table.processor, self.config.fault_injection)  # test-only
                if self._early_failure is not None:
                    self.table.fail_all(*self._early_failure)
                self.limits = _group_limits([side.ready for side in self.engines])
                for rank in range(n):  # every engine has stats (idle) from the start, for /metrics and logs
                    self.table.engine_stats.setdefault(rank, SchedulerStats())
                # 3. the balancer (several engines), then the frontend actors
                if n > 1:
                    self.balancer = DPBalancer(to_engine_recv, [send for send, _ in per_engine], merged_recv,
                                               ends.enter_context(from_engine_send.clone()))
                    await tg.start(self._supervised, "balancer", self.balancer.run)
                self.output_handler = OutputHandler(self.table, from_engine_recv, to_engine_send.clone(),
                                                    chunk_size=self.config.output_chunk_size)
                await tg.start(self._supervised, "output_handler", self.output_handler.run)
                self.input_processor = InputProcessor(self.tokenizer, self.limits, self.table, submit_recv,
                                                      to_engine_send)
                await tg.start(self._supervised, "input_processor", self.input_processor.run)
                if self.config.engine_hang_timeout_s is not None:
                    tg.start_soon(self._watch_progress, self.config.engine_hang_timeout_s)
                if self.config.log_stats_interval_s is not None:
                    from troupe.actors.stats_logger import StatsLogger

                    tg.start_soon(StatsLogger(self.table, self.config.log_stats_interval_s).run)
                self.submit = submit_send
                log.info("graph ready", actor=GRAPH, model=self.config.model, max_model_len=self.limits.max_model_len,
                         kv_blocks=[side.ready.num_blocks for side in self.engines], engine_pids=self.pids,
                         data_parallel_size=n, block_size=first.block_size)
                try:
                    yield self
                finally:
                    # 4. shutdown: end every stream, stop taking work, then stop the actors
                    self.table.abort(list(self.table.streams))
                    submit_send.close()
                    tg.cancel_scope.cancel()

    async def _start_engines(self, tg: TaskGroup) -> None:
        """Start every engine side at once (each loads its model); the first start-up failure is raised."""
        async def start(rank: int, side: EngineSide) -> None:
            await tg.start(self._supervised, f"engine {rank}" if len(self.engines) > 1 else "engine", side.run)

        try:
            async with anyio.create_task_group() as starting:
                for rank, side in enumerate(self.engines):
                    starting.start_soon(start, rank, side)
        except* EngineStartupError as group:
            raise first_startup_error(group) from None

    async def _supervised(self, name: str, run: Callable[..., Awaitable[None]], *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        status = _Started(task_status)
        try:
            await run(task_status=status)
        except Exception as exc:
            if not status.done:
                raise  # a start-up failure: the caller of start() gets it
            log.error("actor crashed", actor=GRAPH, crashed_actor=name, exc_info=exc)
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if self.table is None:
                self._early_failure = (f"{name} crashed: {reason}", exc)
            else:
                self.table.fail_all(f"{name} crashed: {reason}", exc)

    def stalled_for(self) -> tuple[float, int | None]:
        """(seconds, engine rank or None) of the longest stall of an engine while it holds requests:
        per engine with several (the balancer knows which engine holds what), else the one engine's."""
        if self.table is None:
            return 0.0, None
        if self.balancer is not None:
            seconds, rank = self.balancer.stalled_for()
            return seconds, rank if rank >= 0 else None
        return self.table.stalled_for(), 0

    async def _watch_progress(self, limit_s: float) -> None:
        """Log an engine that finishes no step for `limit_s` while requests wait (and its recovery)."""
        hung = False
        while True:
            await anyio.sleep(min(1.0, limit_s / 4))
            stalled, rank = self.stalled_for()
            if not hung and stalled > limit_s:
                hung = True
                log.warning("engine hung: no step finished while requests wait", actor=GRAPH,
                            stalled_s=round(stalled, 1),
                            waiting=self.table.num_unfinished, engine_pids=self.pids, hung_engine=rank)
            elif hung and stalled <= limit_s:
                hung = False
                log.info("engine progressing again", actor=GRAPH)


class _TokenizerPrefetch:
    """Loads the tokenizer while the engine starts; `get(path)` falls back to loading from the
    folder the engine reports if the prefetch failed or resolved another folder."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._path: str | None = None
        self._model = ""
        self._tokenizer: Any = None

    async def load(self, model: str) -> None:
        self._model = model
        try:
            self._path, self._tokenizer = await anyio.to_thread.run_sync(_resolve_and_load, model,
                                                                         abandon_on_cancel=True)
        except Exception:  # the engine reports the real problem (or get() raises it again)
            pass
        finally:
            self._done.set()

    async def get(self, model_path: str | None) -> Any:
        """The tokenizer of `model_path` (None: the engines are all remote, whose paths are theirs:
        the folder this host resolves for the model)."""
        await self._done.wait()
        if self._tokenizer is not None and model_path in (self._path, None):
            return self._tokenizer
        if model_path is None:
            raise EngineStartupError(f"the tokenizer of {self._model!r} could not be loaded on this host")
        return await anyio.to_thread.run_sync(load_tokenizer, model_path)


def _group_limits(readies: list[EngineReady]) -> ModelLimits:
    """What the frontend checks requests against: the engines must serve the same model."""
    first = readies[0].limits
    for ready in readies[1:]:
        lim = ready.limits
        if (lim.vocab_size, lim.max_model_len, lim.eos_token_ids) != (first.vocab_size, first.max_model_len,
                                                                      first.eos_token_ids):
            raise EngineStartupError(f"engine {ready.engine_index} serves another model than engine 0 "
                                     f"(vocab {lim.vocab_size} vs {first.vocab_size}, max_model_len "
                                     f"{lim.max_model_len} vs {first.max_model_len})")
    capacities = [r.limits.kv_capacity_tokens for r in readies if r.limits.kv_capacity_tokens is not None]
    return dataclasses.replace(first, data_parallel_size=len(readies),
                               kv_capacity_tokens=min(capacities) if capacities else None)


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
