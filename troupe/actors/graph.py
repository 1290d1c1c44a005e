"""The actor graph, wired in one place.

```
 facades --Submission/AbortRequest--> input processor --AddRequest/Abort--> engine side
                                                                               |
 facades <--RequestStream (per request)-- output handler <--EngineOutput-------+
                                             |--AbortRequest (stop strings)--> engine side
```

The engine side (troupe.engine_side) is the EngineCore in its own process behind a ZMQ
bridge (`multiprocess=True`, the default) or in this one; it takes the same two stream ends either
way, and nothing else here knows which.

`Graph` is an async context manager. Entering it starts the engine side first (it returns once the
engine is ready, or raises `EngineStartupError`), loads the tokenizer from the model folder the
engine reports, then starts the frontend actors. Leaving it aborts what is still running (each
stream ends with finish_reason "abort"), closes the submission stream and cancels the actors' task
group: an in-process step in flight finishes first; an engine process is stopped (see
troupe.engine_side.engine_process).

Facades use the graph through its port (troupe.actors.port.FrontendPort: submit, abort, utility calls,
health, statistics); the request table (`RequestTable`) is the graph's own, and each actor gets a
Protocol of only what it may call on it (`Registrar`, `OutputSink`).

Every task is started the same way, `await tg.start(self._supervised, name, actor.run)`: an
actor's `run(task_status=...)` signals `started()` once it is ready. An essential actor that crashes
does not take the caller's code down with it: `_supervised` turns the crash into `EngineDeadError`
for every live and every later request (`RequestTable.fail_all`). An optional observer (the stats
logger, the progress watch) that crashes is logged and the graph goes on. The progress watch logs an
engine that finishes no step for `engine_hang_timeout_s` while requests wait (`AsyncLLM.check_health`
raises `EngineHungError` then); it kills nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from troupe.actors.dp_balancer import DPBalancer
from troupe.actors.engine_stats import EngineStats
from troupe.actors.input_processor import FrontendInput, InputProcessor, Submission
from troupe.actors.output_handler import OutputHandler
from troupe.actors.reply import Reply
from troupe.actors.requests import RequestStream, RequestTable
from troupe.actors.stats_logger import StatsLogger
from troupe.actors.streams import GraphStreams, TokenizerPrefetch
from troupe.config import EngineConfig
from troupe.engine.build import MakeCore
from troupe.engine_side import EngineSide, make_engine_side
from troupe.errors import EngineDeadError, EngineStartupError, first_startup_error
from troupe.hooks import load as load_hooks
from troupe.inputs import ModelLimits
from troupe.limits import InputLimits
from troupe.messages import AbortRequest, SchedulerStats, UtilityCall
from troupe.process.protocol import EngineReady

log = structlog.get_logger("troupe.graph")
GRAPH = "graph"  # its lines name the actor explicitly: the graph runs in its caller's task, whose
# context is the caller's own (and a module-level `bind` would freeze the logging configuration)


class Graph(anyio.AsyncContextManagerMixin):
    """The running actor graph of one `AsyncLLM`; its facade-facing methods are the `FrontendPort`.

    Start-up, in order (`__asynccontextmanager__`): 1. the streams; 2. the engine sides (each loads
    its model; the tokenizer loads meanwhile); 3. the frontend: the balancer (several engines), the
    output handler, the input processor, then the optional observers (hang watch, stats logger).
    The request table and the engine statistics exist from the start, so a crash at any point
    finds them."""

    def __init__(self, config: EngineConfig, *, make_core: MakeCore | None = None) -> None:
        self.config = config
        self._make_core = make_core
        self._table = RequestTable()
        self.stats = EngineStats(config.data_parallel_size)
        self.tokenizer: Any = None
        self.limits: ModelLimits | None = None
        self._submit: MemoryObjectSendStream[FrontendInput] | None = None
        self.engines: list[EngineSide] = []
        self.balancer: DPBalancer | None = None
        self.output_handler: OutputHandler | None = None
        self.input_processor: InputProcessor | None = None
        self.stats_logger: StatsLogger | None = None
        self._actor_scopes: list[anyio.CancelScope] = []  # one per supervised task: `stop()` cancels them
        self._actors_running = 0
        self._actors_ended: anyio.Event | None = None  # set when no supervised task runs any more
        self._stopping = False
        self._waiting: set[Reply[Any]] = set()  # the replies callers wait on: failed if the graph stops first

    @property
    def pids(self) -> list[int]:
        """Process ids of the engine processes this graph started and that still run."""
        return [pid for side in self.engines for pid in side.pids]

    # ------------------------------------------------------------ the port (troupe.actors.port.FrontendPort)

    async def submit(self, sub: Submission) -> RequestStream:
        """Send one submission to the input processor and wait for its answer: the registered stream,
        or the validation error raised. A caller that goes away first abandons the reply: the request
        is not sent, or, if it was registered already, aborted."""
        assert self._submit is not None
        self._waiting.add(sub.reply)
        try:
            await self._submit.send(sub)
            return await sub.reply.wait()
        except BaseException:
            stream = sub.reply.abandon()
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await self.abort([stream.request_id], internal=True)
            raise
        finally:
            self._waiting.discard(sub.reply)

    async def abort(self, request_ids: str | Iterable[str], *, internal: bool = False) -> None:
        """End requests with finish_reason "abort" (the users' ids: every request under each; with
        `internal`, the graph's own) and tell the engine, unless the graph stops or the engine died
        (then there is no engine to tell)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        internal_ids = ids if internal else self._table.internal_ids(ids)
        if not internal_ids:
            return
        live = self._table.abort(internal_ids)
        if live and self._submit is not None and not self._stopping and self._table.dead_error is None:
            try:
                await self._submit.send(AbortRequest(live))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # shutting down: the engine goes away with everything in it

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call `method(*args)` on the engine(s): its result; a failure there is a RuntimeError with
        the engine's message; the engine's death, its EngineDeadError."""
        assert self._submit is not None
        call_id, reply = self._table.new_call()
        self._waiting.add(reply)
        try:
            await self._submit.send(UtilityCall(call_id, method, list(args)))
            result = await reply.wait()
        finally:
            self._table.end_call(call_id)
            self._waiting.discard(reply)
        if result.failure is not None:
            raise RuntimeError(result.failure)
        return result.result

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._table.dead_error

    @property
    def num_unanswered(self) -> int:
        return len(self._waiting)

    @property
    def num_unfinished(self) -> int:
        return self._table.num_unfinished

    @property
    def engine_stats(self) -> dict[int, SchedulerStats]:
        return dict(self.stats.latest)

    # ------------------------------------------------------------ lifecycle

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Graph]:
        self._actors_ended = anyio.Event()
        with contextlib.ExitStack() as ends:
            streams = GraphStreams(self.config.data_parallel_size, ends)
            async with anyio.create_task_group() as tg:
                await self._start_engines(tg, streams)
                await self._start_frontend(tg, streams)
                self._submit = streams.submit_send
                first = self.engines[0].ready
                assert self.limits is not None
                log.info("graph ready", actor=GRAPH, model=self.config.model, max_model_len=self.limits.max_model_len,
                         kv_blocks=[side.ready.num_blocks for side in self.engines], engine_pids=self.pids,
                         data_parallel_size=self.config.data_parallel_size, block_size=first.block_size)
                try:
                    yield self
                finally:
                    # shutdown: end every stream, stop taking work, then stop the actors
                    self._end_requests()
                    tg.cancel_scope.cancel()

    def _end_requests(self) -> None:
        """Every live request ends with finish_reason "abort", every submission or utility call not
        answered yet fails (`RuntimeError`), and the submission stream closes."""
        self._stopping = True
        self._table.abort(self._table.live_ids())
        for reply in list(self._waiting):
            reply.fail(RuntimeError("the engine was shut down before it answered"))
        if self._submit is not None:
            self._submit.close()

    async def stop(self) -> None:
        """Stop the graph before its context ends (`AsyncLLM.shutdown`): end every request as leaving
        does, cancel every actor and wait until all have stopped (the engine processes included, each
        within its bounded stop). Idempotent; leaving the context afterwards has nothing left to do."""
        self._end_requests()
        for scope in self._actor_scopes:
            scope.cancel()
        if self._actors_ended is not None and self._actors_running:
            await self._actors_ended.wait()

    async def _start_engines(self, tg: TaskGroup, streams: GraphStreams) -> None:
        """Step 2: every engine side at once (each loads its model: they decide the limits the
        frontend checks against), the tokenizer meanwhile; the first start-up failure is raised."""
        self.engines = [make_engine_side(self.config, inbox, outbox, make_core=self._make_core, engine_index=rank)
                        for rank, (inbox, outbox) in enumerate(streams.engine_ends())]
        tokenizer = TokenizerPrefetch()  # transformers takes seconds to load: overlap the engines' start
        tg.start_soon(tokenizer.load, self.config.model, self.config.revision, self.config.tokenizer)
        several = len(self.engines) > 1

        async def start(rank: int, side: EngineSide) -> None:
            await tg.start(self._supervised, f"engine {rank}" if several else "engine", side.run)

        try:
            async with anyio.create_task_group() as starting:
                for rank, side in enumerate(self.engines):
                    starting.start_soon(start, rank, side)
        except* EngineStartupError as group:
            raise first_startup_error(group) from None
        first = self.engines[0].ready
        # the tokenizer from rank 0's folder if it runs here (headless engines' paths are theirs), unless
        # the configuration names one
        own = self.config.tokenizer is None and self.config.num_local_engines
        self.tokenizer = await tokenizer.get(first.model_path if own else None)
        self._table.set_tokenizer(self.tokenizer)
        load_hooks(self.config.hooks).frontend_built(self._table.processor)  # no-op unless a plugin is named
        self.limits = _group_limits([side.ready for side in self.engines], self.config.input_limits)

    async def _start_frontend(self, tg: TaskGroup, streams: GraphStreams) -> None:
        """Step 3: the balancer (several engines), the output handler, the input processor, then the
        optional observers."""
        assert self.limits is not None
        if streams.per_engine:
            self.balancer = DPBalancer(streams.to_engine_recv, [send for send, _ in streams.per_engine],
                                       streams.merged_recv, streams.clone(streams.from_engine_send))
            await tg.start(self._supervised, "balancer", self.balancer.run)
        self.output_handler = OutputHandler(self._table, self.stats, streams.from_engine_recv,
                                            streams.to_engine_send.clone(), chunk_size=self.config.output_chunk_size,
                                            to_input=streams.clone(streams.submit_send))
        await tg.start(self._supervised, "output_handler", self.output_handler.run)
        block_size = self.engines[0].ready.block_size
        self.input_processor = InputProcessor(
            self.tokenizer, self.limits, self._table, streams.submit_recv, streams.to_engine_send,
            share_prefill_tokens=block_size if self.config.enable_prefix_caching else None)
        await tg.start(self._supervised, "input_processor", self.input_processor.run)
        if self.config.engine_hang_timeout_s is not None:
            await tg.start(self._supervised, "progress_watch", self._watch_progress, False)
        if self.config.log_stats_interval_s is not None:
            self.stats_logger = StatsLogger(self.stats, lambda: self._table.num_unfinished,
                                            self.config.log_stats_interval_s)
            await tg.start(self._supervised, "stats_logger", self.stats_logger.run, False)

    async def _supervised(self, name: str, run: Callable[..., Awaitable[None]], essential: bool = True, *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run one actor: a failure before it started is raised to the caller of `start()`; a crash
        after it of an essential actor (engines, balancer, output handler, input processor) ends the
        graph's requests (`RequestTable.fail_all`: every live and later request gets
        `EngineDeadError`, the caller's code is not cancelled); a crash of an optional observer (the
        stats logger, the progress watch) is logged ("observer crashed") and the graph goes on
        without it."""
        status = _Started(task_status)
        self._actors_running += 1
        try:
            with anyio.CancelScope() as scope:
                self._actor_scopes.append(scope)
                if self._stopping:
                    scope.cancel()
                await run(task_status=status)
        except Exception as exc:
            if not status.done:
                raise  # a start-up failure: the caller of start() gets it
            if not essential:
                log.error("observer crashed", actor=GRAPH, crashed_actor=name, exc_info=exc)
                return
            log.error("actor crashed", actor=GRAPH, crashed_actor=name, exc_info=exc)
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self._table.fail_all(f"{name} crashed: {reason}", exc)
        finally:
            self._actors_running -= 1
            if not self._actors_running and self._actors_ended is not None:
                self._actors_ended.set()

    def stalled_for(self) -> tuple[float, int | None]:
        """(seconds, engine rank or None) of the longest stall of an engine while it holds requests:
        per engine with several (the balancer knows which engine holds what), else the one engine's
        (since its last progress, or since requests came after idleness)."""
        if self.balancer is not None:
            seconds, rank = self.balancer.stalled_for()
            return seconds, rank if rank >= 0 else None
        if not self._table.num_unfinished:
            return 0.0, 0
        return time.monotonic() - max(self.stats.last_progress, self._table.busy_since), 0

    async def _watch_progress(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Log an engine that finishes no step for `engine_hang_timeout_s` while requests wait (and
        its recovery)."""
        limit_s = self.config.engine_hang_timeout_s
        assert limit_s is not None
        task_status.started()
        hung = False
        while True:
            await anyio.sleep(min(1.0, limit_s / 4))
            stalled, rank = self.stalled_for()
            if not hung and stalled > limit_s:
                hung = True
                log.warning("engine hung: no step finished while requests wait", actor=GRAPH,
                            stalled_s=round(stalled, 1),
                            waiting=self._table.num_unfinished, engine_pids=self.pids, hung_engine=rank)
            elif hung and stalled <= limit_s:
                hung = False
                log.info("engine progressing again", actor=GRAPH)


def _group_limits(readies: list[EngineReady], inputs: InputLimits) -> ModelLimits:
    """What the frontend checks requests against: the engines must serve the same model; the input
    limits are the frontend's own (`EngineConfig.input_limits`), whatever the engines were started with."""
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
                               kv_capacity_tokens=min(capacities) if capacities else None, inputs=inputs)


T = TypeVar("T")


class _Started(Generic[T]):
    """A `TaskStatus` that remembers whether `started()` was called."""

    def __init__(self, inner: TaskStatus[T]) -> None:
        self._inner = inner
        self.done = False

    def started(self, value: T | None = None) -> None:
        self.done = True
        self._inner.started(value)  # type: ignore[arg-type]
