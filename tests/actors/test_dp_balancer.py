"""The DP balancer on its own: fake engines (memory streams) instead of EngineCores, so routing by
score, pinning, abort routing, utility broadcast and the combined answers are checked without an
engine; and the data-parallel options and addresses. N = 2 real engines: tests/e2e/test_data_parallel.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import anyio
import pytest
from factories import add_request as add

from troupe import InvalidInputError
from troupe.actors.dp_balancer import DPBalancer, aggregate_stats, combine_results
from troupe.config import EngineConfig
from troupe.engine.child import default_threads
from troupe.messages import (
    AbortRequest,
    EngineCoreOutputs,
    EngineDead,
    EngineInput,
    EngineOutput,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from troupe.process.launch import rank_address


class FakeEngines:
    """N engine inboxes the test reads, and the one stream engines answer on."""

    def __init__(self, n: int) -> None:
        pairs = [anyio.create_memory_object_stream[EngineInput](100) for _ in range(n)]
        self.sends = [s for s, _ in pairs]
        self.inboxes = [r for _, r in pairs]
        self.to_balancer, self.from_engines = anyio.create_memory_object_stream[EngineOutput](100)
        self.input, self.inbox = anyio.create_memory_object_stream[EngineInput](100)
        self.to_output, self.output = anyio.create_memory_object_stream[EngineOutput](100)

    def __enter__(self) -> FakeEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        for end in (*self.sends, *self.inboxes, self.to_balancer, self.from_engines, self.input, self.inbox,
                    self.to_output, self.output):
            end.close()

    @contextlib.asynccontextmanager
    async def balancer(self) -> AsyncIterator[DPBalancer]:
        """The balancer running (started as the graph starts every actor: `tg.start(run)`)."""
        bal = DPBalancer(self.inbox, self.sends, self.from_engines, self.to_output)
        async with anyio.create_task_group() as tg:
            await tg.start(bal.run)
            yield bal
            tg.cancel_scope.cancel()

    def received(self, rank: int) -> list[EngineInput]:
        out = []
        while True:
            try:
                out.append(self.inboxes[rank].receive_nowait())
            except anyio.WouldBlock:
                return out


async def settle() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def test_balancer_spreads_by_score_pins_and_routes_aborts() -> None:
    """Idle engines fill evenly; then each request goes to the lowest score (4 x waiting + running),
    a pinned one to its rank; aborts reach the engine holding each id, and a route lives until that
    engine lists the request as finished."""
    with FakeEngines(3) as fake:
        await _spread_pin_abort(fake)


async def _spread_pin_abort(fake: FakeEngines) -> None:
    async with fake.balancer() as bal:
        for i in range(6):  # idle engines: ties rotate, so the group fills evenly
            await fake.input.send(add(f"r{i}"))
        await settle()
        assert [len(fake.received(r)) for r in range(3)] == [2, 2, 2]
        # engine 0 reports 0 waiting / 1 running; 1 reports 2 waiting; 2 reports 0 / 3 -> scores 1, 8, 3
        for rank, (waiting, running) in enumerate([(0, 1), (2, 0), (0, 3)]):
            await fake.to_balancer.send(EngineCoreOutputs(engine_index=rank, scheduler_stats=SchedulerStats(
                num_running=running, num_waiting=waiting)))
        await settle()
        assert bal.scores() == [1, 8, 3]
        await fake.input.send(add("a"))  # -> 0 (score 1, then 5)
        await fake.input.send(add("b"))  # -> 2 (score 3 < 5)
        await fake.input.send(add("p", rank=1))  # pinned, whatever its score
        await settle()
        assert [[m.request_id for m in fake.received(r)] for r in range(3)] == [["a"], ["p"], ["b"]]
        # aborts reach the engine holding each request; unknown ids are dropped
        await fake.input.send(AbortRequest(["a", "p", "b", "r0", "never-seen"]))
        await settle()
        got = [[m.request_ids for m in fake.received(r) if isinstance(m, AbortRequest)] for r in range(3)]
        assert got == [[["a", "r0"]], [["p"]], [["b"]]]
        # a routing entry lives until its engine lists the request as finished
        assert len(bal.routing) == 9
        await fake.to_balancer.send(EngineCoreOutputs(engine_index=0, finished_requests=["a", "r0", "r3"]))
        await settle()
        assert "a" not in bal.routing and "r0" not in bal.routing and len(bal.routing) == 6
        outs = []
        while True:
            try:
                outs.append(fake.output.receive_nowait())
            except anyio.WouldBlock:
                break
        assert len(outs) == 4 and all(isinstance(o, EngineCoreOutputs) for o in outs)  # passed on, in order


async def test_balancer_broadcasts_utility_calls_and_combines_answers() -> None:
    """A utility call goes to every engine and is answered once all have answered; an engine's death
    passes on to the output handler."""
    with FakeEngines(2) as fake:
        await _broadcast(fake)


async def _broadcast(fake: FakeEngines) -> None:
    async with fake.balancer():
        await fake.input.send(UtilityCall(7, "reset_prefix_cache"))
        await settle()
        assert all(isinstance(m, UtilityCall) for r in range(2) for m in fake.received(r))
        await fake.to_balancer.send(UtilityResult(7, result=True, engine_index=1))
        await settle()
        with pytest.raises(anyio.WouldBlock):  # one answer of two: nothing yet
            fake.output.receive_nowait()
        await fake.to_balancer.send(UtilityResult(7, result=False, engine_index=0))
        await settle()
        combined = fake.output.receive_nowait()
        assert isinstance(combined, UtilityResult) and combined.call_id == 7 and combined.result is False
        await fake.to_balancer.send(EngineDead("boom", engine_index=1))  # passes on: the handler fails all
        await settle()
        dead = fake.output.receive_nowait()
        assert isinstance(dead, EngineDead) and dead.engine_index == 1


def test_combined_stats_and_failures() -> None:
    """Stats add up over the engines (usage weighted by blocks); one engine's failure fails the call."""
    e0 = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "num_kv_blocks": 100, "block_size": 16,
          "engine_index": 0}
    e1 = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.0, "num_kv_blocks": 300, "block_size": 16,
          "engine_index": 1}
    total = aggregate_stats([e0, e1])
    assert total["num_running"] == 3 and total["num_waiting"] == 1 and total["num_kv_blocks"] == 400
    assert total["kv_cache_usage"] == pytest.approx(50 / 400) and total["block_size"] == 16
    assert total["engines"] == [e0, e1] and total["data_parallel_size"] == 2
    failed = combine_results("get_stats", 3, [UtilityResult(3, result={}, engine_index=0),
                                              UtilityResult(3, failure="bad", engine_index=1)])
    assert failed.failure == "engine 1: bad"


def test_options_and_addresses() -> None:
    """Bad data-parallel options name their field; rank r's port is PORT + r; local engines share the cores."""
    with pytest.raises(InvalidInputError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(InvalidInputError, match=r"data_parallel_size_local: must be in \[0, 2\]"):
        EngineConfig(data_parallel_size=2, data_parallel_size_local=3)
    with pytest.raises(InvalidInputError, match="data_parallel_address: must be tcp://"):
        EngineConfig(data_parallel_size=2, data_parallel_size_local=1)
    assert rank_address("tcp://10.0.0.5:7000", 3) == "tcp://10.0.0.5:7003"
    with pytest.raises(ValueError, match="port"):
        rank_address("tcp://host:*", 1)
    cores = len(os.sched_getaffinity(0))
    assert default_threads(EngineConfig(data_parallel_size=2)) == max(1, cores // 2)
    assert default_threads(EngineConfig(data_parallel_size=2, data_parallel_size_local=1,
                                        data_parallel_address="tcp://127.0.0.1:5000")) == cores
