"""Waiting-queue policies: `FCFSRequestQueue` and `PriorityRequestQueue` behind `RequestQueue`.

vLLM's `vllm/v1/core/sched/request_queue.py`, plus the one other thing a policy decides: which running
request to preempt. `create_request_queue(policy)` is the only place that reads the policy's name.

Contract (every queue; pure, no I/O):
- `add(req)` queues a new request; `prepend(req)` queues a preempted one (FCFS: at the front, so it
  resumes before newer requests; priority: by its rank, like `add`).
- `peek()` is the request `pop()` would return (None / `IndexError` when empty); `remove(req)` takes
  out a queued request wherever it is (`ValueError` if absent).
- Iteration yields the queued requests in pop order; `len()` counts them.
- `victim(running)` is the running request to preempt (`running` is non-empty, in admission order):
  FCFS the last admitted; priority the worst ranked (highest `priority`, then latest `arrival_time`).
- Priority rank: lower `priority` first, then earlier `arrival_time`, then insertion order.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Literal

from troupe.core.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]


class RequestQueue(ABC):
    @abstractmethod
    def add(self, req: Request) -> None: ...

    @abstractmethod
    def prepend(self, req: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request | None: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def victim(self, running: Sequence[Request]) -> Request: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def __len__(self) -> int: ...


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def prepend(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def victim(self, running: Sequence[Request]) -> Request:
        return running[-1]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival_time, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    def prepend(self, req: Request) -> None:
        self.add(req)

    def peek(self) -> Request | None:
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        kept = [e for e in self._heap if e[3] is not req]
        if len(kept) == len(self._heap):
            raise ValueError(f"{req!r} is not queued")
        self._heap = kept
        heapq.heapify(self._heap)

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """The waiting queue of `policy`; `ValueError` for any other name."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
