"""The DP balancer actor: spreads requests over several EngineCores and merges what they send back.

Inbox:    `EngineInput` from the input processor (adds, the facades' aborts, utility calls) and the
          output handler (stop-string aborts); and, on a second stream, `EngineOutput` from every
          engine side (each holds a clone of the send end).
Outbox:   one `EngineInput` stream per engine (rank r = index r); the merged `EngineOutput`s to the
          output handler.
Owns:     the routing table (internal request id -> rank) and the load estimate of each engine.
Shutdown: EndOfStream on the inbox closes every engine stream; or cancellation.

Routing (vLLM's rule): a new request goes to the engine with the lowest score `4 * waiting +
running`; the counts are those the engine published with its last step's outputs
(`SchedulerStats`), plus one waiting request for each add sent to it since then. Ties go to the
engine after the last one chosen, so an idle group fills evenly. `data_parallel_rank` pins a request
(checked at the edge: `ModelLimits.data_parallel_size`). An abort goes to the engine that holds the
request; ids the balancer no longer knows (already finished) are dropped. An entry is forgotten when
the engine lists the request in `finished_requests` (finished, aborted or rejected).

Utility calls go to every engine; the answers are combined into one `UtilityResult` for the caller
(`combine_results`). An `EngineDead` from any engine passes on: the output handler fails every
request (vLLM's rule: with the engines' shared request space split, a lost engine loses its requests,
and the frontend reports the whole group dead rather than half-serve).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple, assert_never

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe import log as troupe_log
from troupe.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutputs,
    EngineDead,
    EngineInput,
    EngineOutput,
    UtilityCall,
    UtilityResult,
)

log = structlog.get_logger("troupe.balancer")

WAITING_WEIGHT = 4


class BalancerStats(NamedTuple):
    routed: tuple[int, ...]  # adds sent to each engine
    aborts: tuple[int, ...]  # abort ids sent to each engine
    in_flight: int  # routing entries (requests some engine holds)
    scores: tuple[int, ...]


class _Call:
    __slots__ = ("method", "results")

    def __init__(self, method: str) -> None:
        self.method = method
        self.results: dict[int, UtilityResult] = {}


class DPBalancer:
    def __init__(self, inbox: MemoryObjectReceiveStream[EngineInput],
                 engines: Sequence[MemoryObjectSendStream[EngineInput]],
                 from_engines: MemoryObjectReceiveStream[EngineOutput],
                 to_output: MemoryObjectSendStream[EngineOutput]) -> None:
        if not engines:
            raise ValueError("engines: the balancer needs at least one engine")
        self._inbox = inbox
        self._engines = list(engines)
        self._from_engines = from_engines
        self._to_output = to_output
        n = len(self._engines)
        self.routing: dict[str, int] = {}
        self._waiting = [0] * n
        self._running = [0] * n
        self._routed = [0] * n
        self._aborted = [0] * n
        self._next = 0  # where the search for the least loaded engine starts (ties rotate)
        self._holding = [0] * n  # routing entries per engine
        self._last_progress = [time.monotonic()] * n  # per engine: last output, or work after idleness
        self._calls: dict[int, _Call] = {}

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    def scores(self) -> list[int]:
        return [WAITING_WEIGHT * w + r for w, r in zip(self._waiting, self._running, strict=True)]

    def stalled_for(self, now: float | None = None) -> tuple[float, int]:
        """(seconds, rank) of the engine that has shown no progress the longest while it holds
        requests (0.0, -1 when every engine holding requests progresses): one hung engine of the group
        is found even while the others keep the frontend busy."""
        now = time.monotonic() if now is None else now
        worst = (0.0, -1)
        for rank, held in enumerate(self._holding):
            if held and now - self._last_progress[rank] > worst[0]:
                worst = (now - self._last_progress[rank], rank)
        return worst

    def statistics(self) -> BalancerStats:
        return BalancerStats(tuple(self._routed), tuple(self._aborted), len(self.routing), tuple(self.scores()))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="dp_balancer")
        try:
            task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._merge_outputs)
                await self._route_inputs()
                tg.cancel_scope.cancel()
        finally:  # every end, here (a task may be cancelled before it runs); the engines see EndOfStream
            self._inbox.close()
            self._from_engines.close()
            self._to_output.close()
            for engine in self._engines:
                engine.close()

    # ------------------------------------------------------------------ frontend -> engines

    def choose(self, pinned: int | None = None) -> int:
        """The rank for a new request: `pinned`, or the least loaded (ties: round robin)."""
        if pinned is not None:
            return pinned
        scores = self.scores()
        n = len(scores)
        best = min(range(n), key=lambda i: (scores[(self._next + i) % n], i))
        rank = (self._next + best) % n
        self._next = (rank + 1) % n
        return rank

    async def _route_inputs(self) -> None:
        async for msg in self._inbox:
            match msg:
                case AddRequest():
                    await self._add(msg)
                case AbortRequest():
                    await self._abort(msg.request_ids)
                case UtilityCall():
                    self._calls[msg.call_id] = _Call(msg.method)
                    for engine in self._engines:
                        await engine.send(msg)
                case _:
                    assert_never(msg)

    async def _add(self, msg: AddRequest) -> None:
        rank = self.choose(msg.data_parallel_rank)
        self.routing[msg.request_id] = rank
        if not self._holding[rank]:  # work after idleness: its clock starts now
            self._last_progress[rank] = time.monotonic()
        self._holding[rank] += 1
        self._waiting[rank] += 1
        self._routed[rank] += 1
        if troupe_log.trace_enabled():
            troupe_log.trace(log, "request routed", request_id=msg.external_id, rank=rank,
                             pinned=msg.data_parallel_rank is not None, scores=self.scores(),
                             queued_s=round(time.time() - msg.arrival_time, 6) if msg.arrival_time else None)
        await self._engines[rank].send(msg)

    async def _abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.routing.get(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self._aborted[rank] += len(ids)
            await self._engines[rank].send(AbortRequest(ids))

    # ------------------------------------------------------------------ engines -> frontend

    async def _merge_outputs(self) -> None:
        async for msg in self._from_engines:
            match msg:
                case EngineCoreOutputs():
                    self._record(msg)
                    await self._to_output.send(msg)
                case UtilityResult():
                    combined = self._collect(msg)
                    if combined is not None:
                        await self._to_output.send(combined)
                case EngineDead():
                    await self._to_output.send(msg)
                case _:
                    assert_never(msg)

    def _record(self, msg: EngineCoreOutputs) -> None:
        rank = msg.engine_index
        stats = msg.scheduler_stats
        if 0 <= rank < len(self._engines):
            self._last_progress[rank] = time.monotonic()
            if stats is not None:
                self._waiting[rank] = stats.num_waiting
                self._running[rank] = stats.num_running
        for rid in msg.finished_requests:
            held_by = self.routing.pop(rid, None)
            if held_by is not None:
                self._holding[held_by] -= 1

    def _collect(self, result: UtilityResult) -> UtilityResult | None:
        call = self._calls.get(result.call_id)
        if call is None:
            return None
        call.results[result.engine_index] = result
        if len(call.results) < len(self._engines):
            return None
        del self._calls[result.call_id]
        ordered = [call.results[i] for i in sorted(call.results)]
        return combine_results(call.method, result.call_id, ordered)


def combine_results(method: str, call_id: int, results: list[UtilityResult]) -> UtilityResult:
    """One answer from every engine's: the first failure (named by engine), else per method:
    `reset_prefix_cache` all true; `get_stats` the totals plus `engines` (each engine's dict);
    `echo` the first; anything else the list of results by rank."""
    for r in results:
        if r.failure is not None:
            return UtilityResult(call_id, failure=f"engine {r.engine_index}: {r.failure}")
    values = [r.result for r in results]
    combined: Any
    if method == "reset_prefix_cache":
        combined = all(bool(v) for v in values)
    elif method == "get_stats" and all(isinstance(v, dict) for v in values):
        combined = aggregate_stats(values)  # type: ignore[arg-type]
    elif method == "echo":
        combined = values[0]
    else:
        combined = values
    return UtilityResult(call_id, result=combined)


def aggregate_stats(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over engines: counts summed, `kv_cache_usage` weighted by each pool's blocks;
    `engines` keeps every engine's own dict."""
    total: dict[str, Any] = {}
    for key in per_engine[0]:
        values = [d.get(key) for d in per_engine]
        if key == "engine_index" or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            continue
        total[key] = sum(values)  # type: ignore[arg-type]
    blocks = [int(d.get("num_kv_blocks") or 0) for d in per_engine]
    all_blocks = 0
    for b in blocks:
        all_blocks += b
    if "kv_cache_usage" in total and all_blocks:
        used = 0.0
        for d, b in zip(per_engine, blocks, strict=True):
            used += float(d["kv_cache_usage"]) * b
        total["kv_cache_usage"] = used / all_blocks
    if "block_size" in total:
        total["block_size"] = per_engine[0]["block_size"]
    total["engines"] = per_engine
    total["data_parallel_size"] = len(per_engine)
    return total
