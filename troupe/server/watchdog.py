"""The event-loop lag watchdog: how late the server's event loop runs a task that is due.

Inbox:    none.
Outbox:   `troupe:event_loop_lag_seconds` (a histogram of every measured lag) and
          `troupe:event_loop_lag_max_seconds` (the largest since start) in the server's registry;
          a warning line for each lag over `warn_after` (100 ms).
Owns:     one task, in the server's lifespan task group.
Shutdown: cancelled with the lifespan.

The task sleeps `interval` (20 ms) at a time and measures how much later than asked it woke: the
wait that every other task due at that moment saw too, so a step that holds the loop (a parse, a
render, a log line formatting a traceback) shows up here whatever caused it. The tests read the
maximum to check that no input a client sends stalls the loop.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Gauge, Histogram

log = structlog.get_logger("troupe.server")

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WatchdogStats(NamedTuple):
    samples: int
    max_lag_s: float
    last_lag_s: float


class LoopWatchdog:
    def __init__(self, registry: CollectorRegistry, *, interval: float = 0.02, warn_after: float = 0.1) -> None:
        self.interval = interval
        self.warn_after = warn_after
        self._hist = Histogram("troupe:event_loop_lag_seconds", "How late the server's event loop ran a due task",
                               buckets=_BUCKETS, registry=registry)
        self._max = Gauge("troupe:event_loop_lag_max_seconds", "The largest event-loop lag since the server started",
                          registry=registry)
        self._samples = 0
        self._max_lag = 0.0
        self._last = 0.0

    def statistics(self) -> WatchdogStats:
        return WatchdogStats(self._samples, self._max_lag, self._last)

    def observe(self, lag: float) -> None:
        self._samples += 1
        self._last = lag
        self._hist.observe(lag)
        if lag > self._max_lag:
            self._max_lag = lag
            self._max.set(lag)
        if lag > self.warn_after:
            log.warning("event loop lagged", lag_ms=round(lag * 1000, 1))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            due = time.monotonic() + self.interval
            await anyio.sleep(self.interval)
            self.observe(max(0.0, time.monotonic() - due))
