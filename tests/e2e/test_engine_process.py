"""The EngineCore in its own process: death, start-up failure, hangs and shutdown never hang or leak.

Each test owns its engine (most of them break it) and checks afterwards that no engine process and
no ipc socket file is left (`check_leftovers`, from /proc and the ipc dir, not assumed). Faults come
from the test-only fault plugin (tests/support/faults.py), from signals, or from a broken model
folder. Waiting is on events or on polled conditions under a deadline, never on a bare sleep.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.faults import fault_hooks

from troupe import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from troupe.errors import EngineHungError, EngineStartupError

ENGINE: dict[str, Any] = dict(dtype="float32", max_num_seqs=128, max_num_batched_tokens=256, num_kv_blocks=1024)
FOREVER = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def proc_state(pid: int) -> str | None:
    """The /proc state letter of `pid` (Z: zombie, dead but not reaped), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


async def stream_until_killed(llm: AsyncLLM, n: int, started: list[anyio.Event],
                              errors: list[tuple[float, BaseException]]) -> None:
    """`n` endless requests; each records the EngineDeadError that ends it (and when)."""

    async def one(i: int) -> None:
        try:
            async for _ in llm.generate(f"stream {i}", FOREVER, request_id=f"s{i}"):
                started[i].set()
        except EngineDeadError as exc:
            errors.append((time.monotonic(), exc))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)


@pytest.mark.parametrize("how", ["sigkill", "segfault"])
async def test_silent_engine_death_fails_every_request_within_a_second(
    tiny_llama: Path, ipc_root: str, check_leftovers: Any, how: str
) -> None:
    """SIGKILL (or a segfault) of the engine mid-stream: every stream gets EngineDeadError within
    1 s, naming the signal; errored is set; new requests and check_health raise at once."""
    fault = "crash_after_steps=20" if how == "segfault" else None
    async with AsyncLLM(str(tiny_llama), ipc_dir=ipc_root, hooks=fault_hooks(fault), **ENGINE) as llm:
        [pid] = llm.engine_pids
        started = [anyio.Event() for _ in range(8)]
        errors: list[tuple[float, BaseException]] = []
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_until_killed, llm, 8, started, errors)
                for event in started:
                    await event.wait()
                killed_at = time.monotonic()
                if how == "sigkill":
                    os.kill(pid, signal.SIGKILL)
        assert len(errors) == 8
        if how == "sigkill":
            assert max(t for t, _ in errors) - killed_at < 1.0
        assert llm.errored
        assert f"engine process {pid} was killed by {'SIGKILL' if how == 'sigkill' else 'SIGSEGV'}" in str(
            llm.dead_error)
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with anyio.fail_after(1), pytest.raises(EngineDeadError):
            async for _ in llm.generate("after death", FOREVER):
                pass
    check_leftovers([pid])


@pytest.mark.parametrize("multiprocess", [True, False], ids=["multiprocess", "in-process"])
async def test_startup_failure_carries_the_root_cause(
    tiny_llama: Path, tmp_path: Path, ipc_root: str, check_leftovers: Any, multiprocess: bool
) -> None:
    """A corrupt safetensors file: EngineStartupError whose message holds the engine's root cause and
    traceback; nothing is left running and no socket file remains."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with anyio.fail_after(120), pytest.raises(EngineStartupError) as info:
        async with AsyncLLM(str(broken), ipc_dir=ipc_root, multiprocess=multiprocess, **ENGINE):
            pytest.fail("the engine started")
    err = info.value
    assert err.cause_type == "ModelLoadError"
    assert "model.safetensors: not a valid safetensors file" in str(err)
    assert "Engine traceback:" in str(err) and "Traceback (most recent call last)" in err.engine_traceback
    check_leftovers()


async def test_startup_timeout_stops_the_engine(tiny_llama: Path, tmp_path: Path, ipc_root: str,
                                                check_leftovers: Any) -> None:
    """An engine that is not ready within engine_ready_timeout_s is stopped: EngineStartupError, no leak."""
    never = tmp_path / "never-created"
    started = time.monotonic()
    with anyio.fail_after(60), pytest.raises(EngineStartupError, match="not ready after engine_ready_timeout_s=2"):
        async with AsyncLLM(str(tiny_llama), ipc_dir=ipc_root, engine_ready_timeout_s=2,
                            hooks=fault_hooks(f"block_startup=1,release={never}"), **ENGINE):
            pytest.fail("the engine started")
    assert time.monotonic() - started < 2 + 2 + 5  # deadline + SIGTERM grace + slack
    check_leftovers()


async def test_close_during_100_in_flight_streams(tiny_llama: Path, engine_mode: dict[str, Any],
                                                  check_leftovers: Any) -> None:
    """Leaving `async with` while 100 streams are mid-flight: every stream ends (finish_reason
    'abort'), none hangs, the engine stops within the shutdown deadline."""
    reasons: list[str | None] = []
    started = [anyio.Event() for _ in range(100)]

    async def consume(llm: AsyncLLM, i: int) -> None:
        async for out in llm.generate(f"busy {i}", FOREVER, request_id=f"b{i}"):
            started[i].set()
            if out.finished:
                reasons.append(out.outputs[0].finish_reason)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as consumers:
            async with AsyncLLM(str(tiny_llama), **ENGINE, **engine_mode) as llm:
                pids = llm.engine_pids
                for i in range(100):
                    consumers.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
                closing = time.monotonic()
            closed_in = time.monotonic() - closing
    assert reasons == ["abort"] * 100
    assert closed_in < 5.0
    check_leftovers(pids)


async def test_hung_engine_is_reported_by_check_health(tiny_llama: Path, tmp_path: Path, engine_mode: dict[str, Any],
                                                       check_leftovers: Any) -> None:
    """A model call that blocks (alive, requests waiting, no step): check_health raises EngineHungError
    and a warning is logged, nothing is killed; once it goes on, the engine is healthy again."""
    release = tmp_path / "release"
    async with AsyncLLM(str(tiny_llama), engine_hang_timeout_s=0.3, hooks=fault_hooks(f"block_after_steps=2,release={release}"),
                        **ENGINE, **engine_mode) as llm:
        pids = llm.engine_pids
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        with capture_logs() as logs, anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                results: list[Any] = []

                async def one() -> None:
                    results.extend([o async for o in llm.generate("stuck", sp)])

                tg.start_soon(one)
                hung: EngineHungError | None = None
                while hung is None or not any(e["event"].startswith("engine hung") for e in logs):
                    try:  # the conditions, polled under the deadline
                        await llm.check_health()
                    except EngineHungError as exc:
                        hung = exc
                    await anyio.sleep(0.05)
                assert "no step finished" in str(hung) and "1 request(s) wait" in str(hung)
                assert not llm.errored and all(proc_state(p) not in (None, "Z") for p in pids)
                release.touch()
        assert results[-1].finished and len(results[-1].outputs[0].token_ids) == 5
        await llm.check_health()
    check_leftovers(pids)


def test_llm_close_is_idempotent_and_stops_the_engine(tiny_llama: Path, ipc_root: str, check_leftovers: Any) -> None:
    """LLM.close() twice and then leaving `with`: no error; the engine process is gone after the first."""
    with LLM(str(tiny_llama), ipc_dir=ipc_root, **ENGINE) as llm:
        [pid] = llm._engine.engine_pids
        llm.close()
        assert proc_state(pid) is None
        llm.close()
    check_leftovers([pid])


def test_parent_sigkill_leaves_no_orphan(tiny_llama: Path, tmp_path: Path) -> None:
    """A parent SIGKILLed mid-generation: its engine process is gone within 5 s, no socket file left."""
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        from troupe import LLM, SamplingParams
        llm = LLM({str(tiny_llama)!r}, dtype="float32", num_kv_blocks=512, ipc_dir={str(ipc_dir)!r})

        def announce():  # tell the test once requests are in the engine
            while llm._engine.num_unfinished_requests == 0:
                time.sleep(0.01)
            print(llm._engine.engine_pids[0], flush=True)

        threading.Thread(target=announce, daemon=True).start()
        llm.generate(["go " * 20] * 16, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
    """))
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as parent:
        try:
            assert parent.stdout is not None and parent.stderr is not None
            line = parent.stdout.readline().strip()
            assert line.isdigit(), parent.stderr.read()
            engine = int(line)
            assert proc_state(engine) not in (None, "Z")
            parent.kill()
            parent.wait(timeout=10)
            deadline = time.monotonic() + 5.0
            while proc_state(engine) not in (None, "Z"):  # a zombie is dead; reaping is init's job
                assert time.monotonic() < deadline, "the engine outlived its parent by 5 s"
                time.sleep(0.05)
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()
    assert os.listdir(ipc_dir) == []


def test_engine_openmp_settings_yield_to_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned engine gets a short libgomp spin (GOMP_SPINCOUNT) unless the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT; the settings are only in the environment while the child starts."""
    from troupe.process.launch import ENGINE_SPIN_COUNT, engine_environment, engine_omp_settings

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert engine_omp_settings() == {"GOMP_SPINCOUNT": ENGINE_SPIN_COUNT}
    with engine_environment():
        assert os.environ["GOMP_SPINCOUNT"] == ENGINE_SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in os.environ
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "0")):
        monkeypatch.setenv(name, value)
        assert engine_omp_settings() == {}
        with engine_environment():
            assert os.environ[name] == value and os.environ.get("GOMP_SPINCOUNT", "0") in ("0", value)
        assert os.environ[name] == value
        monkeypatch.delenv(name)
