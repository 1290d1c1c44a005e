"""A local Ray cluster the frontend starts and owns (no `ray_address`, no RAY_ADDRESS).

`troupe serve --data-parallel-size 2 --data-parallel-backend ray`, the one command, serves on two
Ray actors and on the death of one behaves as for any engine death (503, then exit 1); the cluster
outlives the frontend's idle worker threads (its processes die with the thread that started them);
and no Ray process is left behind either way."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

ray = pytest.importorskip("ray")

from ray_helpers import QUIET_ENV, wait_no_processes  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from troupe import AsyncLLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a Ray cluster behind a server

ARGS = ["--dtype", "float32", "--num-threads", "1", "--data-parallel-size", "2", "--data-parallel-backend", "ray",
        "--exit-on-engine-death-after", "1"]


def log_events(srv: ServerProcess) -> list[dict[str, Any]]:
    """The server's JSON log lines (Ray's own lines on the same stderr are not JSON: skipped)."""
    events = []
    for line in (srv.log_dir / "stderr.txt").read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def ray_session_dir(driver_pid: int) -> str:
    """The session dir of the local cluster another process started: Ray names it after the
    driver's pid (the newest such dir: an old run's process may have had the same pid)."""
    root = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")
    return max(glob.glob(os.path.join(root, f"session_*_{driver_pid}")), key=os.path.getmtime)


async def test_serve_on_two_ray_actors_then_exit_on_the_death_of_one(tiny_llama: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """20 completions are served, some by each actor (the per-request log lines name the engine);
    SIGKILL of rank 1's actor process: /health and new requests answer 503 within 5 s, the log
    names Ray's cause, the server exits 1 by itself, and its Ray session leaves no process."""
    for name, value in QUIET_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with ServerProcess([str(tiny_llama), *ARGS], tmp_path) as srv:
        assert srv.proc is not None
        session = ray_session_dir(srv.proc.pid)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            async def one(i: int) -> None:
                resp = await http.post("/v1/completions", json={"prompt": f"word {i} " * 4, "max_tokens": 4,
                                                                "temperature": 0.0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 4

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for i in range(20):
                        tg.start_soon(one, i)
            served = [e.get("engine") for e in log_events(srv) if e.get("event") == "request finished"]
            assert len(served) == 20 and {served.count(0), served.count(1)} != {0, 20}, served
            actors = {e["engine"]: e["pid"] for e in log_events(srv) if e.get("event") == "engine ready"}
            assert sorted(actors) == [0, 1] and os.getpid() not in actors.values()
            os.kill(actors[1], signal.SIGKILL)
            killed = time.monotonic()
            with anyio.fail_after(10):
                while True:  # another process's state: polled under the deadline
                    if (await http.get("/health")).status_code == 503:
                        break
                    await anyio.sleep(0.05)
            assert time.monotonic() - killed < 5
            resp = await http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
            assert resp.status_code == 503
        code = srv.wait_exit(60)
        assert code == 1, srv.stderr_tail()
        assert any("the Ray actor of engine 1 died: ActorDiedError" in json.dumps(e) for e in log_events(srv)), \
            srv.stderr_tail()
    await anyio.to_thread.run_sync(wait_no_processes, session)


async def test_a_local_cluster_outlives_the_frontends_idle_worker_threads(tiny_llama: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster's processes die with the thread that started them (PR_SET_PDEATHSIG): that is
    troupe's session thread, alive while the frontend runs; once anyio has reaped the worker threads
    busy during the start (idle ones go at the next hand-off after `MAX_IDLE_TIME`: anyio's 10 s, made
    0.5 s here so that the test does not wait for it), the engines still serve and the group is healthy;
    leaving stops the cluster and the thread, and no process is left."""
    from anyio._backends._asyncio import WorkerThread

    monkeypatch.setattr(WorkerThread, "MAX_IDLE_TIME", 0.5)
    for name, value in QUIET_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with AsyncLLM(str(tiny_llama), data_parallel_size=2, data_parallel_backend="ray", num_threads=1,
                        dtype="float32", num_kv_blocks=256, log_stats_interval_s=None) as llm:
        session = ray._private.worker._global_node.get_session_dir_path()  # this process's connection
        owners = [t for t in threading.enumerate() if t.name == "troupe-ray-session"]
        workers = {t for t in threading.enumerate() if t.name.startswith("AnyIO worker thread")}
        assert workers  # the start ran Ray's blocking calls in them
        with anyio.fail_after(60):
            while True:  # each hand-off reuses the latest idle worker and reaps those idle for MAX_IDLE_TIME
                poker = await anyio.to_thread.run_sync(threading.current_thread)
                if not any(t.is_alive() for t in workers - {poker}):
                    break
                await anyio.sleep(0.2)
        for i in range(4):
            outs = [o async for o in llm.generate(f"still here {i}", params, data_parallel_rank=i % 2)]
            assert len(outs[-1].outputs[0].token_ids) == 4
        await llm.check_health()
        with anyio.fail_after(10):  # the cluster itself still answers
            nodes = await anyio.to_thread.run_sync(ray.nodes, abandon_on_cancel=True)
        assert [node["Alive"] for node in nodes] == [True]
        assert len(owners) == 1 and owners[0].is_alive()
    assert not owners[0].is_alive()
    await anyio.to_thread.run_sync(wait_no_processes, session)
