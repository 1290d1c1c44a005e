"""Waiting-queue policies: the `RequestQueue` contract for FCFS and priority (pure, no engine)."""

from __future__ import annotations

import pytest
from factories import make_request

from troupe.core.request import Request
from troupe.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while len(queue):
        peeked = queue.peek()
        popped = queue.pop()
        assert peeked is popped
        out.append(popped.request_id)
    return out


def reqs(*specs: tuple[str, int, float]) -> list[Request]:
    return [make_request(rid=rid, priority=priority, arrival=arrival) for rid, priority, arrival in specs]


@pytest.mark.parametrize(("policy", "cls"), [("fcfs", FCFSRequestQueue), ("priority", PriorityRequestQueue)])
def test_factory(policy: str, cls: type) -> None:
    """Each policy name gives its queue class; any other name is refused by name."""
    assert isinstance(create_request_queue(policy), cls)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'fcfs' or 'priority'"):
        create_request_queue("lifo")  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["a", "b", "c", "d"]),  # insertion order, whatever the rank
    ("priority", ["c", "b", "d", "a"]),  # priority, then arrival, then insertion
])
def test_iteration_is_pop_order(policy: str, expected: list[str]) -> None:
    """Iterating a queue lists its requests in the order `pop` returns them; `peek` is the next pop."""
    queue = create_request_queue(policy)  # type: ignore[arg-type]
    for r in reqs(("a", 2, 0.0), ("b", 1, 5.0), ("c", 0, 9.0), ("d", 1, 5.0)):
        queue.add(r)
    assert ids(queue) == expected and len(queue) == 4
    assert drain(queue) == expected
    assert queue.peek() is None


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["p", "a", "b"]),  # a preempted request resumes first
    ("priority", ["a", "p", "b"]),  # it keeps its rank
])
def test_prepend(policy: str, expected: list[str]) -> None:
    """`prepend` (a preempted request) goes to the front under FCFS and by rank under priority."""
    queue = create_request_queue(policy)  # type: ignore[arg-type]
    a, b, p = reqs(("a", 0, 1.0), ("b", 2, 2.0), ("p", 1, 0.5))
    queue.add(a)
    queue.add(b)
    queue.prepend(p)
    assert ids(queue) == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_remove(policy: str) -> None:
    """`remove` takes a request out from anywhere; removing one not queued raises."""
    queue = create_request_queue(policy)  # type: ignore[arg-type]
    a, b, c = reqs(("a", 0, 1.0), ("b", 0, 2.0), ("c", 0, 3.0))
    for r in (a, b, c):
        queue.add(r)
    queue.remove(b)
    assert ids(queue) == ["a", "c"]
    with pytest.raises(ValueError):
        queue.remove(b)


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", "c"), ("priority", "a")])
def test_victim(policy: str, expected: str) -> None:
    """FCFS preempts the last admitted request; priority the worst ranked (highest value, latest)."""
    queue = create_request_queue(policy)  # type: ignore[arg-type]
    running = reqs(("a", 3, 1.0), ("b", 3, 0.0), ("c", 1, 2.0))
    assert queue.victim(running).request_id == expected
