"""AsyncLLM behaviour over the actor graph (modelled on vLLM's tests/v1/engine/test_async_llm.py).

A tiny random-weight Llama built at test time stands in for the model: these tests check the
plumbing (streams, aborts, errors, cleanup), not the text. Every test runs in both engine modes
(`engine_mode`: the EngineCore in its own process, or in this one); the tests that leave the engine
healthy share one engine per mode (a spawned engine costs seconds of torch import).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from factories import TINY_ENGINE, assert_idle
from support.faults import fault_hooks

from troupe import AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow  # engines in processes


ENGINE = TINY_ENGINE


def params(kind: RequestOutputKind, max_tokens: int = 10, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)



@pytest.fixture(scope="module")
async def shared_llm(tiny_llama: Path, engine_mode: dict[str, Any], check_leftovers: Any) -> AsyncIterator[AsyncLLM]:
    """One engine per mode for the tests that leave it healthy; afterwards nothing is left behind."""
    async with AsyncLLM(str(tiny_llama), max_model_len=256, **ENGINE, **engine_mode) as llm:
        yield llm
    check_leftovers()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
async def test_load_100_concurrent_requests(shared_llm: AsyncLLM, kind: RequestOutputKind) -> None:
    """100 concurrent requests all finish with their tokens and leave no state behind."""
    results: dict[str, list[int]] = {}
    finished_flags: dict[str, list[bool]] = {}

    llm = shared_llm
    async def one(i: int) -> None:
        ids: list[int] = []
        flags = []
        async for out in llm.generate(f"request number {i} says", params(kind), request_id=f"r{i}"):
            flags.append(out.finished)
            if kind == RequestOutputKind.DELTA:
                ids.extend(out.outputs[0].token_ids)
            else:
                ids = list(out.outputs[0].token_ids)
        results[f"r{i}"] = ids
        finished_flags[f"r{i}"] = flags

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)
    await assert_idle(llm)
    assert len(results) == 100
    assert all(len(ids) == 10 for ids in results.values())
    for flags in finished_flags.values():  # only the last output is finished
        assert flags[-1] and not any(flags[:-1])
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(flags) == 1


async def test_cancelling_half_the_consumers_aborts_exactly_those(shared_llm: AsyncLLM) -> None:
    """Cancelled consumers abort their requests; the others finish untouched; ids can be reused."""
    llm = shared_llm
    done: dict[int, int] = {}
    started = {i: anyio.Event() for i in range(20)}

    async def one(i: int) -> None:
        n = 0
        async for out in llm.generate("tell me a story", params(RequestOutputKind.DELTA, 40),
                                      request_id=f"r{i}"):
            n += len(out.outputs[0].token_ids)
            started[i].set()
        done[i] = n

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            scopes = []
            for i in range(20):
                scope = anyio.CancelScope()
                scopes.append(scope)

                async def run(i: int = i, scope: anyio.CancelScope = scope) -> None:
                    with scope:
                        await one(i)

                tg.start_soon(run)
            for i in range(0, 20, 2):
                await started[i].wait()
                scopes[i].cancel()
    assert sorted(done) == list(range(1, 20, 2))
    assert all(n == 40 for n in done.values())
    await assert_idle(llm)
    # the cancelled ids are free again
    outs = [o async for o in llm.generate("again", params(RequestOutputKind.FINAL_ONLY, 3), request_id="r0")]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


async def test_abort_by_id_returns_partial_output(shared_llm: AsyncLLM) -> None:
    """abort([ids]) ends those streams with finish_reason='abort' and the tokens made so far."""
    llm = shared_llm
    finals: dict[str, Any] = {}
    got_some = {rid: anyio.Event() for rid in ("a", "b", "c")}

    async def one(rid: str, max_tokens: int) -> None:
        async for out in llm.generate("count with me", params(RequestOutputKind.CUMULATIVE, max_tokens),
                                      request_id=rid):
            if out.outputs[0].token_ids:
                got_some[rid].set()
            if out.finished:
                finals[rid] = out

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a", 200)
            tg.start_soon(one, "b", 200)
            tg.start_soon(one, "c", 5)
            await got_some["a"].wait()
            await got_some["b"].wait()
            await llm.abort(["a", "b"])
    for rid in ("a", "b"):
        out = finals[rid].outputs[0]
        assert out.finish_reason == "abort" and out.stop_reason is None
        assert 0 < len(out.token_ids) < 200
    assert finals["c"].outputs[0].finish_reason == "length"
    await assert_idle(llm)


async def test_model_failure_kills_every_request(tiny_llama: Path, engine_mode: dict[str, Any],
                                                 check_leftovers: Any) -> None:
    """A model exception after N steps: in-flight requests get EngineDeadError, errored is set, new calls fail."""
    async with AsyncLLM(str(tiny_llama), hooks=fault_hooks("raise_after_steps=3"), **ENGINE, **engine_mode) as llm:
        pids = llm.engine_pids
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                async for _ in llm.generate("doomed", params(RequestOutputKind.DELTA, 50), request_id=f"d{i}"):
                    pass
            except EngineDeadError as exc:
                errors.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        assert len(errors) == 8
        assert llm.errored
        assert "injected model failure" in str(llm.dead_error)
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("after death", params(RequestOutputKind.DELTA)):
                pass
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
    check_leftovers(pids)


@pytest.mark.parametrize(
    ("prompt", "sp", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, 2, 10**7]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": list(range(5000))}, SamplingParams(), "prompt"),
        ("hello", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
    ],
    ids=["empty", "oov", "too-long", "stop-id-oov"],
)
async def test_bad_input_is_rejected_and_the_engine_stays_healthy(
    shared_llm: AsyncLLM, prompt: Any, sp: SamplingParams, field: str
) -> None:
    """Bad input raises ValueError naming the field; a good request right after still finishes."""
    llm = shared_llm
    with pytest.raises(ValueError, match=field):
        async for _ in llm.generate(prompt, sp):
            pass
    outs = [o async for o in llm.generate("fine", params(RequestOutputKind.FINAL_ONLY, 4))]
    assert outs[-1].finished and not llm.errored
    await assert_idle(llm)


async def test_utility_calls(shared_llm: AsyncLLM) -> None:
    """reset_prefix_cache and get_stats reach the engine and come back; a failing call names the
    method and the cause and leaves the engine healthy."""
    llm = shared_llm
    [o async for o in llm.generate("warm the cache " * 10, params(RequestOutputKind.FINAL_ONLY, 2))]
    assert await llm.reset_prefix_cache() is True
    stats = await llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    with pytest.raises(RuntimeError, match="Call to fail method failed: boom"):
        await llm._utility("fail", "boom")
    with pytest.raises(RuntimeError, match="no utility method 'nope'"):
        await llm._utility("nope")
    await llm.check_health()
    assert not llm.errored


async def test_engine_pids_name_the_engine_process(shared_llm: AsyncLLM, engine_mode: dict[str, Any]) -> None:
    """In multiprocess mode each engine this frontend starts is a live child process; in-process
    there is none, and headless engines (started by someone else) are not ours to list."""
    pids = shared_llm.engine_pids
    started_here = engine_mode.get("data_parallel_size_local", engine_mode.get("data_parallel_size", 1))
    if engine_mode["multiprocess"]:
        assert len(pids) == started_here and os.getpid() not in pids
        for pid in pids:
            os.kill(pid, 0)  # it exists
    else:
        assert pids == []
