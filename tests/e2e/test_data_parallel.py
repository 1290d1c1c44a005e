"""Data parallelism: N = 2 real engines behind one AsyncLLM (in-process, spawned, headless over
loopback TCP), checked through the engines' own counters (`get_stats()["engines"]`), not the
balancer's view of them. The balancer alone, on fake engines: tests/actors/test_dp_balancer.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from engines import POOL_PIDS, free_port_pair, headless_engines
from support.faults import fault_hooks

from troupe import AsyncLLM, EngineDeadError, InvalidInputError, SamplingParams

ENGINE = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=512, block_size=16)


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


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees `count` GPUs (its spawned engines find none and run on the CPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode().partition("=")[::2] for entry in raw.split(b"\0") if entry)


@pytest.mark.parametrize("mode", ["in-process", "multiprocess"])
async def test_two_engines_share_200_requests(tiny_llama: Path, ipc_root: str, check_leftovers: Any,
                                              mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "multiprocess":  # one GPU per rank: the parent sees two (fake), each rank is given its own
        fake_gpus(monkeypatch, 2)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, multiprocess=mode == "multiprocess",
                        ipc_dir=ipc_root, **ENGINE) as llm:
        graph = llm._graph
        assert graph is not None and graph.balancer is not None
        if mode == "multiprocess":
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,3"  # the parent's own is left as it was
            seen = [process_environ(pid).get("CUDA_VISIBLE_DEVICES") for e in graph.engines for pid in e.pids]
            assert seen == ["5", "3"]  # rank r: the r-th GPU this process may use
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


def test_rank_gpu_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rank_gpu`: rank r of several local engines gets the r-th GPU; nothing to assign on the CPU, for one
    engine or where no GPU is visible; fewer GPUs than local ranks is an error before anything starts."""
    from troupe.config import EngineConfig
    from troupe.process.launch import rank_gpu

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_gpus(monkeypatch, 4)
    three = EngineConfig(model="m", data_parallel_size=3)
    assert [rank_gpu(three, r) for r in range(3)] == [{"CUDA_VISIBLE_DEVICES": str(r)} for r in range(3)]
    local = EngineConfig(model="m", data_parallel_size=4, data_parallel_size_local=2,
                         data_parallel_address="tcp://127.0.0.1:5000")
    assert [rank_gpu(local, r) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert rank_gpu(EngineConfig(model="m"), 0) == {}  # one engine: it sees every GPU, uses the first
    assert rank_gpu(EngineConfig(model="m", data_parallel_size=3, device="cpu"), 1) == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7, 2,4,1")
    assert rank_gpu(three, 1) == {"CUDA_VISIBLE_DEVICES": "2"}
    fake_gpus(monkeypatch, 2)
    for config, field in ((three, "data_parallel_size"), (EngineConfig(model="m", data_parallel_size=5,
                          data_parallel_size_local=3, data_parallel_address="tcp://127.0.0.1:5000"),
                          "data_parallel_size_local")):
        with pytest.raises(InvalidInputError, match=rf"{field}: 3 local engines on device='auto' need one GPU each, "
                           "and this process sees 2"):
            rank_gpu(config, 0)
    fake_gpus(monkeypatch, 0)
    assert rank_gpu(three, 2) == {}  # "auto" with no GPU: every rank on the CPU


@pytest.mark.parametrize("multiprocess", [True, False])
async def test_too_few_gpus_for_the_local_ranks(tiny_llama: Path, ipc_root: str, monkeypatch: pytest.MonkeyPatch,
                                                check_leftovers: Any, multiprocess: bool) -> None:
    """Three spawned ranks on two GPUs, or two in-process ranks on CUDA, fail the start-up naming the field;
    no engine is spawned."""
    fake_gpus(monkeypatch, 2)
    ranks, field = (3, "data_parallel_size") if multiprocess else (2, "multiprocess")
    with pytest.raises(InvalidInputError, match=rf"^{field}: {ranks} "):
        async with AsyncLLM(str(tiny_llama), data_parallel_size=ranks, multiprocess=multiprocess, ipc_dir=ipc_root,
                            **ENGINE):
            pass
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
                        hooks=fault_hooks(f"block_after_steps=1,engine=1,release={release}"), **ENGINE) as llm:
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
