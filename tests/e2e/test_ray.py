"""`data_parallel_backend="ray"` on a real (small, local) Ray cluster: ranks placed by custom
resources serve requests end to end, deaths (a killed actor, a failed constructor, a removed node)
fail the group with Ray's cause, an unplaceable rank fails the start naming what is missing, and
nothing is left on the cluster after any of it (checked after every test) nor any Ray process
after the module (checked by the cluster fixture).

One cluster serves the module (`ray_cluster`); each frontend connects to it (`ray_address`) and
disconnects when it stops. The pure helpers and the option checks without Ray are in
tests/process/test_ray_options.py.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray")

from ray_helpers import (  # noqa: E402
    QUIET_ENV,
    connected,
    engine_actors,
    local_cluster,
    node_args,
    wait_clean,
    wait_no_processes,
)
from support.faults import fault_hooks  # noqa: E402

from troupe import AsyncLLM, EngineDeadError, SamplingParams  # noqa: E402
from troupe.errors import EngineStartupError  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a local Ray cluster starts with the module

ENGINE = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=256, block_size=16,
              data_parallel_backend="ray", num_threads=1, engine_ready_timeout_s=120, log_stats_interval_s=None)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster for the module; after it is shut down, no process of its session runs."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in QUIET_ENV.items():
            env.setenv(name, value)
        env.delenv("RAY_ADDRESS", raising=False)
        with local_cluster() as cluster:
            session = cluster.head_node.get_session_dir_path()
            yield cluster
        wait_no_processes(session)


@pytest.fixture(autouse=True)
def nothing_left(ray_cluster: Any) -> Iterator[None]:
    """After each test: no actor, placement group or held resource is left on the cluster."""
    yield
    wait_clean(ray_cluster.address)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def final_tokens(llm: AsyncLLM, prompt: str, max_tokens: int, **kwargs: Any) -> list[int]:
    outs = [o async for o in llm.generate(prompt, greedy(max_tokens), **kwargs)]
    assert outs[-1].finished
    return list(outs[-1].outputs[0].token_ids)


async def placements(llm: AsyncLLM) -> list[dict[str, Any]]:
    """Each rank's actor's own account: node, pid, torch threads, OMP_NUM_THREADS, assigned resources."""
    graph = llm._graph
    assert graph is not None
    return [await asyncio.wrap_future(side.actor.placement.remote().future())  # type: ignore[attr-defined]
            for side in graph.engines]


PROMPTS = ["word " * (3 + i % 11) for i in range(30)]


async def test_two_ranks_serve_requests_and_the_balancer_spreads_them(tiny_llama: Path, ray_cluster: Any) -> None:
    """Two ranks, each placed by a custom resource, serve 30 concurrent requests; the tokens equal an
    in-process engine's on the same model (greedy); each engine's own counter shows more than a
    third; each actor holds exactly its bundle, with one torch thread and OMP_NUM_THREADS=1."""
    async with AsyncLLM(str(tiny_llama), multiprocess=False, **{**ENGINE, "data_parallel_backend": "mp"}) as ref:
        expected = [await final_tokens(ref, prompt, 6) for prompt in PROMPTS]
    got: dict[int, list[int]] = {}
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ray_address=ray_cluster.address,
                        ray_resources={"troupe_engine": 1}, **ENGINE) as llm:
        async def one(i: int) -> None:
            got[i] = await final_tokens(llm, PROMPTS[i], 6, request_id=f"r{i}")

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
        assert [got[i] for i in range(len(PROMPTS))] == expected
        stats = await llm.get_stats()
        added = [e["num_requests_added"] for e in sorted(stats["engines"], key=lambda e: e["engine_index"])]
        assert sum(added) == len(PROMPTS) and min(added) > len(PROMPTS) / 3, added
        ranks = await placements(llm)
        assert [r["assigned"] for r in ranks] == [{"CPU": 1.0, "troupe_engine": 1.0}] * 2
        assert [(r["torch_threads"], r["omp_num_threads"]) for r in ranks] == [(1, "1")] * 2
        assert len({r["pid"] for r in ranks}) == 2
        assert all(side.bind_address.startswith("tcp://127.0.0.1:") for side in llm._graph.engines)  # type: ignore[union-attr,attr-defined]


async def test_a_rank_runs_the_threads_ray_assigned_it(tiny_llama: Path, ray_cluster: Any) -> None:
    """num_threads=2: the bundle asks for 2 CPUs, Ray assigns them (its OMP_NUM_THREADS=2) and the
    engine runs 2 torch threads; `data_parallel_address` on a wildcard host is where the frontend
    binds, and the actor connects to it through loopback (a one-node cluster)."""
    port = _free_port()
    async with AsyncLLM(str(tiny_llama), ray_address=ray_cluster.address, **{**ENGINE, "num_threads": 2},
                        data_parallel_address=f"tcp://0.0.0.0:{port}") as llm:
        assert len(await final_tokens(llm, "threads", 4)) == 4
        [rank] = await placements(llm)
        assert rank["assigned"] == {"CPU": 2.0}
        assert (rank["torch_threads"], rank["omp_num_threads"]) == (2, "2")
        assert llm._graph.engines[0].bind_address == f"tcp://0.0.0.0:{port}"  # type: ignore[union-attr,attr-defined]


async def test_killing_one_actor_fails_every_request_within_5s(tiny_llama: Path, ray_cluster: Any) -> None:
    """`ray.kill` on rank 1's actor: every request of the group (on either rank) fails with
    EngineDeadError within 5 s, the message carries Ray's cause, and the AsyncLLM is errored."""
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ray_address=ray_cluster.address,
                        ray_resources={"troupe_engine": 1}, **ENGINE) as llm:
        streams = [await llm.add_request("go " * 8, greedy(100_000), f"s{i}", data_parallel_rank=i % 2)
                   for i in range(4)]
        with anyio.fail_after(60):
            for stream in streams:
                await stream.get()  # every request is running
        ray.kill(llm._graph.engines[1].actor)  # type: ignore[union-attr,attr-defined]
        killed = time.monotonic()
        errors = []
        with anyio.fail_after(10):
            for stream in streams:
                with pytest.raises(EngineDeadError) as info:
                    while True:
                        await stream.get()
                errors.append(str(info.value))
        assert time.monotonic() - killed < 5
        assert llm.errored
        assert "the Ray actor of engine 1 died: ActorDiedError" in errors[0] and "ray.kill" in errors[0], errors[0]


async def test_an_unplaceable_rank_fails_the_start_naming_the_missing_resource(tiny_llama: Path,
                                                                              ray_cluster: Any) -> None:
    """A bundle no node can hold: EngineStartupError within engine_ready_timeout_s (not a hang),
    naming the resource and the most a node has."""
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"node_gpu=1 \(the most a node has: 0\)") as info:
        async with AsyncLLM(str(tiny_llama), ray_address=ray_cluster.address,
                            ray_resources={"troupe_engine": 1, "node_gpu": 1}, **{**ENGINE, "engine_ready_timeout_s": 8}):
            pass
    assert "Ray could not place engine 0 (bundle {'CPU': 1.0, 'troupe_engine': 1.0, 'node_gpu': 1.0}) within " \
           "engine_ready_timeout_s=8 s" in str(info.value)
    assert time.monotonic() - started < 40  # connect (bounded by the timeout too), then the placement's 8 s


async def test_a_failing_actor_constructor_fails_the_start_and_the_other_rank_is_removed(
        tiny_llama: Path, ray_cluster: Any) -> None:
    """Rank 1's actor raises in its constructor: the start fails at once (not at the timeout) with
    Ray's cause and the exception's text; rank 0, placed and starting, is removed too (checked by
    the fixture)."""
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match="injected actor failure") as info:
        async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ray_address=ray_cluster.address,
                            ray_resources={"troupe_engine": 1},
                            hooks=fault_hooks("fail_actor_init=injected actor failure,engine=1"), **ENGINE):
            pass
    assert "the Ray actor of engine 1 died: ActorDiedError" in str(info.value)
    assert time.monotonic() - started < 60  # engine_ready_timeout_s is 120


async def test_a_start_cancelled_while_the_engines_load_leaves_nothing(tiny_llama: Path, ray_cluster: Any,
                                                                      tmp_path: Path) -> None:
    """Cancelled once both actors run (their engines held in start-up by a fault): the start ends
    at once, and the actors and placement groups are removed (checked by the fixture)."""
    release = tmp_path / "release"  # never created: the engines would wait for ever
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async def start() -> None:
                async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ray_address=ray_cluster.address,
                                    ray_resources={"troupe_engine": 1}, **ENGINE,
                                    hooks=fault_hooks(f"block_startup=1,release={release}")):
                    raise AssertionError("the engines cannot be ready")

            tg.start_soon(start)
            while True:  # the cluster's state (other processes): polled under the deadline
                if ray.is_initialized() and len(await anyio.to_thread.run_sync(engine_actors, ray)) == 2:
                    break
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert not ray.is_initialized()  # the frontend's connection closed with it


async def test_two_frontends_of_one_process_share_the_ray_connection(tiny_llama: Path, ray_cluster: Any) -> None:
    """Ray allows one connection per process: two AsyncLLMs share it; the first to stop leaves it
    (and the other's actor) alone, the last one closes it."""
    options = dict(ray_address=ray_cluster.address, ray_resources={"troupe_engine": 1}, **ENGINE)
    async with AsyncLLM(str(tiny_llama), **options) as second:
        async with AsyncLLM(str(tiny_llama), **options) as first:
            assert len(await final_tokens(first, "one", 3)) == 3
        assert ray.is_initialized()
        assert len(await final_tokens(second, "two", 3)) == 3
        await second.check_health()
    assert not ray.is_initialized()


def test_a_killed_frontend_takes_its_actors_and_placement_groups_along(tiny_llama: Path, ray_cluster: Any,
                                                                      tmp_path: Path) -> None:
    """A frontend SIGKILLed while its two ranks serve: Ray (the actors' owner is gone) removes
    the actors and the placement groups; nothing is left on the cluster."""
    script = tmp_path / "frontend.py"
    options = {**ENGINE, "data_parallel_size": 2, "ray_address": ray_cluster.address,
               "ray_resources": {"troupe_engine": 1}}
    script.write_text(textwrap.dedent(f"""
        from troupe import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, **{options!r})
        print("ready", flush=True)
        llm.generate(["go " * 8] * 4, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
    """))
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as frontend:
        try:
            assert frontend.stdout is not None
            assert frontend.stdout.readline().strip() == "ready"
            with connected(ray_cluster.address) as r:
                assert len(engine_actors(r)) == 2
            frontend.send_signal(signal.SIGKILL)
            frontend.wait(timeout=10)
        finally:
            frontend.kill()
            frontend.wait(timeout=10)
    wait_clean(ray_cluster.address, within_s=30)


async def test_ranks_land_on_their_nodes_and_a_removed_node_is_noticed(tiny_llama: Path, ray_cluster: Any) -> None:
    """Two more nodes, each with its own custom resource: rank r lands on node r (the actors say
    which node they run on), the frontend advertises this node's IP (not loopback: several nodes),
    and removing rank 1's node fails the group with EngineDeadError naming the node's death."""
    nodes = [ray_cluster.add_node(**node_args(1, {f"node_{r}": 1.0})) for r in range(2)]
    try:
        async with AsyncLLM(str(tiny_llama), data_parallel_size=2, ray_address=ray_cluster.address,
                            ray_resources=[{"node_0": 1}, {"node_1": 1}], **ENGINE) as llm:
            ranks = await placements(llm)
            assert [r["node_id"] for r in ranks] == [node.node_id for node in nodes]
            host = ray.util.get_node_ip_address()
            assert host != "127.0.0.1"
            assert all(side.bind_address == f"tcp://{host}:*" for side in llm._graph.engines)  # type: ignore[union-attr,attr-defined]
            stream = await llm.add_request("go " * 8, greedy(100_000), "far", data_parallel_rank=1)
            with anyio.fail_after(60):
                await stream.get()
            await anyio.to_thread.run_sync(ray_cluster.remove_node, nodes.pop())
            removed = time.monotonic()
            with anyio.fail_after(15), pytest.raises(EngineDeadError, match="its node has died"):
                while True:
                    await stream.get()
            assert time.monotonic() - removed < 10
    finally:
        for node in nodes:
            ray_cluster.remove_node(node)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
