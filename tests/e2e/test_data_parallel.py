"""Data parallelism: the DP balancer on its own (fake engines: memory streams), then N = 2 real
engines behind one AsyncLLM (in-process, spawned, headless over loopback TCP), checked through the
engines' own counters (`get_stats()["engines"]`), not the balancer's view of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from engines import POOL_PIDS, free_port_pair, headless_engines
from factories import add_request as add

from troupe import AsyncLLM, EngineDeadError, InvalidInputError, SamplingParams
from troupe.actors.dp_balancer import DPBalancer, aggregate_stats, combine_results
from troupe.config import EngineConfig
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
from troupe.process.engine_main import default_threads
from troupe.process.launch import rank_address

ENGINE = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512, block_size=16)


# ---------------------------------------------------------------- the balancer alone


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


# ---------------------------------------------------------------- two real engines


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def engine_counters(llm: AsyncLLM) -> list[dict[str, Any]]:
    stats = await llm.get_stats()
    assert stats["data_parallel_size"] == 2
    return sorted(stats["engines"], key=lambda e: e["engine_index"])


async def until_idle(llm: AsyncLLM) -> None:
    """Polls the engines' own counters (a utility call each time) until neither holds a request."""
    with anyio.fail_after(30):
        while True:
            if not any(e["num_running"] or e["num_waiting"] for e in await engine_counters(llm)):
                return
            await anyio.sleep(0.02)


@pytest.mark.parametrize("mode", ["in-process", "multiprocess"])
async def test_two_engines_share_200_requests(tiny_llama: Path, ipc_root: str, check_leftovers: Any,
                                              mode: str) -> None:
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, multiprocess=mode == "multiprocess",
                        ipc_dir=ipc_root, **ENGINE) as llm:
        graph = llm._graph
        assert graph is not None and graph.balancer is not None
        results: dict[int, int] = {}

        async def one(i: int) -> None:  # mixed prompt and output lengths
            outs = [o async for o in llm.generate("word " * (3 + i % 40), greedy(2 + i % 13), request_id=f"r{i}")]
            out = outs[-1]
            assert out.finished
            results[i] = len(out.outputs[0].token_ids)

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
        assert results == {i: 2 + i % 13 for i in range(200)}
        await until_idle(llm)
        added = [e["num_requests_added"] for e in await engine_counters(llm)]
        assert sum(added) == 200 and min(added) > 200 / 3, added  # each engine served more than a third
        assert graph.balancer.routing == {}  # every entry freed when its request finished
        assert graph.num_unfinished == 0

        # pinned requests run on their engine
        before = [e["num_requests_added"] for e in await engine_counters(llm)]
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(lambda i=i: _drain(llm.generate("pinned", greedy(3), f"p{i}", data_parallel_rank=1)))
        after = [e["num_requests_added"] for e in await engine_counters(llm)]
        assert after[0] == before[0] and after[1] == before[1] + 10

        # aborts reach the engine that holds the request (its own abort counter moves)
        streams = [await llm.add_request("long " * 5, greedy(10_000), f"a{i}", data_parallel_rank=0)
                   for i in range(4)]
        with anyio.fail_after(30):
            for stream in streams:
                await stream.get()  # each has produced a token: it is running in engine 0
        await llm.abort([f"a{i}" for i in range(4)])
        with anyio.fail_after(30):
            while True:  # the abort crosses to the engine asynchronously: poll its own counter
                if (await engine_counters(llm))[0]["num_requests_aborted"] >= 4:
                    break
                await anyio.sleep(0.02)
        counters = await engine_counters(llm)
        assert [e["num_requests_aborted"] for e in counters] == [4, 0]
        await until_idle(llm)
        assert graph.balancer.routing == {}

        with pytest.raises(InvalidInputError, match=r"data_parallel_rank: must be in \[0, 1\]"):
            await llm.add_request("x", greedy(2), "bad", data_parallel_rank=2)
        await llm.check_health()
    check_leftovers()


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


async def test_one_engine_dying_fails_every_request(tiny_llama: Path, ipc_root: str, check_leftovers: Any) -> None:
    """vLLM's rule: an engine of the group dies -> every request (on either engine) gets EngineDeadError."""
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ipc_dir=ipc_root, **ENGINE) as llm:
        pids = llm.engine_pids
        assert len(pids) == 2
        streams = [await llm.add_request("go " * 8, greedy(100_000), f"s{i}", data_parallel_rank=i % 2)
                   for i in range(6)]
        with anyio.fail_after(30):
            for stream in streams:
                await stream.get()
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with anyio.fail_after(10):
            for stream in streams:
                with pytest.raises(EngineDeadError):
                    while True:
                        await stream.get()
        assert time.monotonic() - started < 2
        assert llm.errored
    check_leftovers()


@pytest.mark.timeout(400)  # two engine starts; under a loaded CI machine the remote one took over 60 s
async def test_headless_engine_disconnect_is_engine_death(tiny_llama: Path, ipc_root: str) -> None:
    """A headless engine whose connection drops (killed) is a dead engine for the frontend."""
    with headless_engines(1, first_rank=1) as address:
        async with AsyncLLM(str(tiny_llama), data_parallel_size=2, data_parallel_size_local=1,
                            data_parallel_address=address, ipc_dir=ipc_root, engine_ready_timeout_s=240,
                            **ENGINE) as llm:
            stream = await llm.add_request("go " * 8, greedy(100_000), "remote", data_parallel_rank=1)
            with anyio.fail_after(30):
                await stream.get()
            [remote_pid] = POOL_PIDS[address]
            os.kill(remote_pid, signal.SIGKILL)
            with anyio.fail_after(10), pytest.raises(EngineDeadError, match="headless engine 1"):
                while True:
                    await stream.get()


def test_headless_engine_exits_when_its_frontend_is_killed(tiny_llama: Path, tmp_path: Path) -> None:
    """`troupe engine` (without --serve-forever) exits by itself, code 3, once the frontend is SIGKILLed."""
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent(f"""
        from troupe import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, dtype="float32", num_kv_blocks=256, data_parallel_size=1,
                  data_parallel_size_local=0, data_parallel_address={address!r})
        print("ready", flush=True)
        llm.generate(["go " * 8] * 4, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
    """))
    with subprocess.Popen([sys.executable, "-m", "troupe.cli", "engine", "--connect", address, "--rank", "0",
                           "--num-threads", "1"], stderr=subprocess.PIPE, text=True) as engine, \
            subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True) as frontend:
        try:
            assert frontend.stdout is not None and engine.stderr is not None
            assert frontend.stdout.readline().strip() == "ready"
            frontend.kill()
            frontend.wait(timeout=10)
            assert engine.wait(timeout=15) == 3
            assert "the frontend went away" in engine.stderr.read()
        finally:
            for proc in (frontend, engine):
                proc.kill()
                proc.wait(timeout=10)


def test_engine_command_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from troupe.cli import main

    assert main(["engine", "--connect", "tcp://127.0.0.1:5000", "--rank", "-1"]) == 2
    assert "--rank: must be >= 0" in capsys.readouterr().err
    assert main(["engine", "--connect", "tcp://127.0.0.1:*", "--rank", "0"]) == 2
    assert "the port must be a number" in capsys.readouterr().err


async def test_one_hung_engine_is_found_while_the_other_progresses(tiny_llama: Path, tmp_path: Path) -> None:
    """Engine 1 blocks in a step while engine 0 keeps finishing requests: check_health still reports
    the hang (per engine, not "some output arrived lately"); once released, all is well."""
    release = tmp_path / "release"
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, multiprocess=False, engine_hang_timeout_s=0.5,
                        fault_injection=f"block_after_steps=1,engine=1,release={release}", **ENGINE) as llm:
        stuck = await llm.add_request("stuck", greedy(5), "stuck", data_parallel_rank=1)
        with anyio.fail_after(60):
            hung: Exception | None = None
            while hung is None:  # engine 0 stays busy the whole time
                await _drain(llm.generate("busy", greedy(3), data_parallel_rank=0))
                try:
                    await llm.check_health()
                except Exception as exc:  # EngineHungError, polled under the deadline
                    hung = exc
            assert type(hung).__name__ == "EngineHungError" and not llm.errored
            release.touch()
            while not (await stuck.get()).finished:
                pass
        await llm.check_health()
