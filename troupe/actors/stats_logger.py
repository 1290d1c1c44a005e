"""The stats logger actor: one periodic line of engine throughput and load, silent while idle.

Inbox:    none; every `interval_s` it reads the `EngineStats` (the latest `SchedulerStats` of each
          engine and the cumulative token counts) and the number of live requests.
Outbox:   log lines, `actor=stats_logger`:
          - "stats" (always, the total over all engines): `engines`, `prompt_tokens_per_s`,
            `generation_tokens_per_s`, `running`, `waiting`, `kv_cache_usage` (mean over engines,
            0..1), `prefix_cache_hit_rate` (prompt tokens served by the prefix cache / prompt tokens
            looked up during the interval; None when none were looked up), `requests` (live in the
            frontend);
          - "engine stats" (one per engine, only with more than one engine): the same per engine,
            with `engine=`.
Owns:     its task; the snapshot of the previous interval.
Shutdown: cancellation (it holds nothing to clean up).

Idle means no live request and no token computed since the previous line: then nothing is logged,
so an idle server does not fill its logs. The line after the last request finished still comes (it
reports that interval's tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
import structlog
from anyio.abc import TaskStatus

from troupe.actors.engine_stats import EngineStats

log = structlog.get_logger("troupe.stats")


class EngineSnapshot(NamedTuple):
    prompt_tokens: int  # cumulative
    generation_tokens: int  # cumulative
    prefix_queries: int  # cumulative
    prefix_hits: int  # cumulative
    running: int
    waiting: int
    kv_cache_usage: float


class StatsLoggerStats(NamedTuple):
    lines: int  # "stats" lines logged
    skipped: int  # intervals skipped as idle


def snapshot(stats: EngineStats) -> dict[int, EngineSnapshot]:
    """What the frontend knows of each engine now."""
    snaps = {}
    for index, st in stats.latest.items():
        totals = stats.totals.get(index)
        snaps[index] = EngineSnapshot(totals.prompt_tokens if totals else 0, totals.generation_tokens if totals else 0,
                                      st.prefix_cache_queries, st.prefix_cache_hits, st.num_running, st.num_waiting,
                                      st.kv_cache_usage)
    return snaps


def _fields(cur: list[EngineSnapshot], prev: list[EngineSnapshot | None], elapsed: float) -> dict[str, Any]:
    def delta(attr: str) -> int:
        return sum(getattr(c, attr) - (getattr(p, attr) if p is not None else 0) for c, p in zip(cur, prev, strict=True))

    queries, hits = delta("prefix_queries"), delta("prefix_hits")
    return dict(prompt_tokens_per_s=round(delta("prompt_tokens") / elapsed, 1),
                generation_tokens_per_s=round(delta("generation_tokens") / elapsed, 1),
                running=sum(c.running for c in cur), waiting=sum(c.waiting for c in cur),
                kv_cache_usage=round(sum(c.kv_cache_usage for c in cur) / max(1, len(cur)), 3),
                prefix_cache_hit_rate=round(hits / queries, 3) if queries > 0 else None)


def stats_lines(prev: dict[int, EngineSnapshot], cur: dict[int, EngineSnapshot], elapsed: float,
                live_requests: int) -> list[tuple[str, dict[str, Any]]]:
    """The (event, fields) lines for one interval, or [] when idle (pure: the actor logs them)."""
    moved = any(c.prompt_tokens != (prev[i].prompt_tokens if i in prev else 0)
                or c.generation_tokens != (prev[i].generation_tokens if i in prev else 0) for i, c in cur.items())
    if not live_requests and not moved:
        return []
    elapsed = max(elapsed, 1e-9)
    lines: list[tuple[str, dict[str, Any]]] = []
    if len(cur) > 1:
        for index in sorted(cur):
            lines.append(("engine stats", {"engine": index, **_fields([cur[index]], [prev.get(index)], elapsed)}))
    indices = sorted(cur)
    total = _fields([cur[i] for i in indices], [prev.get(i) for i in indices], elapsed)
    lines.append(("stats", {"engines": len(cur), **total, "requests": live_requests}))
    return lines


class StatsLogger:
    def __init__(self, stats: EngineStats, live_requests: Callable[[], int], interval_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._stats = stats
        self._live_requests = live_requests
        self.interval_s = interval_s
        self._clock = clock
        self._prev: dict[int, EngineSnapshot] = {}
        self._prev_time = clock()
        self._lines = self._skipped = 0

    def statistics(self) -> StatsLoggerStats:
        return StatsLoggerStats(self._lines, self._skipped)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="stats_logger")
        self._prev, self._prev_time = snapshot(self._stats), self._clock()
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            self.log_interval()

    def log_interval(self) -> bool:
        """Log the lines of the interval since the previous call; returns False if it was idle."""
        cur, now = snapshot(self._stats), self._clock()
        lines = stats_lines(self._prev, cur, now - self._prev_time, self._live_requests())
        self._prev, self._prev_time = cur, now
        if not lines:
            self._skipped += 1
            return False
        for event, fields in lines:
            log.info(event, **fields)
        self._lines += 1
        return True
