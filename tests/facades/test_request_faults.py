"""Per-request fault isolation: a failure that belongs to one request fails that request alone.

The test-only fault plugin (tests/support/faults.py) makes one request's sampling raise in the engine
(`fail_sampling`) and another's detokenization raise in the frontend (`fail_detokenize`); in every
engine mode (`engine_mode`) the poisoned requests finish with finish_reason "error" and the error
text, every other request finishes as if nothing happened, no request state or KV block is left,
and the engine stays healthy. Also the two requests that used to kill the engine (issue 12:
`min_tokens`, a seed past 64 bits) on the real path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from factories import TINY_ENGINE as ENGINE
from factories import assert_idle
from structlog.testing import capture_logs
from support.faults import fault_hooks

from troupe import AsyncLLM, InvalidInputError, RequestOutput, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow  # engines in processes


FAULTS = "fail_sampling=poison-s,fail_detokenize=poison-d"



@pytest.fixture(scope="module")
async def faulty_llm(tiny_llama: Path, engine_mode: dict[str, Any], check_leftovers: Any) -> AsyncIterator[AsyncLLM]:
    """One engine per mode with the two per-request faults armed."""
    async with AsyncLLM(str(tiny_llama), max_model_len=256, hooks=fault_hooks(FAULTS), **ENGINE, **engine_mode) as llm:
        yield llm
    check_leftovers()


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.DELTA, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)


async def run(llm: AsyncLLM, jobs: dict[str, SamplingParams], prompt: str = "one of many") -> dict[str, list[RequestOutput]]:
    """Every job at once; each request's outputs in order, by request id."""
    got: dict[str, list[RequestOutput]] = {}

    async def one(rid: str, params: SamplingParams) -> None:
        got[rid] = [out async for out in llm.generate(prompt, params, request_id=rid)]

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for rid, params in jobs.items():
                tg.start_soon(one, rid, params)
    return got


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for out in outs for t in out.outputs[0].token_ids]


@pytest.mark.parametrize(("poison", "error"), [("poison-s", "injected sampling failure"),
                                                ("poison-d", "injected detokenization failure")])
async def test_one_failed_request_among_many_finished(faulty_llm: AsyncLLM, poison: str, error: str) -> None:
    """One poisoned request among 9 (greedy and seeded, in one batch): it alone ends with
    finish_reason "error" and the injected error text; the 8 others get exactly the tokens they
    get without it; nothing is left behind and check_health() passes."""
    llm = faulty_llm
    others = {f"ok{i}": greedy(12) for i in range(4)}
    others |= {f"seeded{i}": SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True,
                                            output_kind=RequestOutputKind.DELTA) for i in range(4)}
    alone = await run(llm, others)
    together = await run(llm, {**others, poison: greedy(12)})
    outs = together.pop(poison)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "error"
    assert final.error is not None and error in final.error
    assert final.error_kind == "internal"  # troupe's fault, not the request's: a 500 on the server
    assert sum(o.finished for o in outs) == 1
    assert sorted(together) == sorted(others)
    for rid, got in together.items():
        assert got[-1].outputs[0].finish_reason == "length", rid
        assert tokens(got) == tokens(alone[rid]) and len(tokens(got)) == 12, rid
    await llm.check_health()
    await assert_idle(llm)
    stats = await llm.get_stats()
    assert stats["kv_cache_usage"] == 0.0  # the failed request's blocks were freed too


async def test_a_failure_after_the_stream_started(tiny_llama: Path, check_leftovers: Any) -> None:
    """`fail_after_tokens`: the poisoned stream gets its first tokens, then a final error output
    (the other request finishes); the error reaches the canonical "request finished" line and a
    "request failed" line with the traceback; the engine serves the next request."""
    faults = "fail_sampling=late,fail_after_tokens=3"
    async with AsyncLLM(str(tiny_llama), hooks=fault_hooks(faults), multiprocess=False, **ENGINE) as llm:
        with capture_logs() as logs:
            got = await run(llm, {"late": greedy(10), "fine": greedy(10)})
        finished = {e["request_id"]: e for e in logs if e["event"] == "request finished"}
        assert finished["late"]["finish_reason"] == "error" and "injected sampling failure" in finished["late"]["error"]
        assert finished["fine"]["finish_reason"] == "length" and "error" not in finished["fine"]
        failed = [e for e in logs if e["event"] == "request failed"]
        assert [e["request_id"] for e in failed] == ["late"] and failed[0]["exc_info"] is not None
        late = got["late"]
        assert tokens(late) and len(tokens(late)) == 3
        assert late[-1].outputs[0].finish_reason == "error" and "injected sampling failure" in (late[-1].error or "")
        assert len(tokens(got["fine"])) == 10
        again = await run(llm, {"next": greedy(4, RequestOutputKind.FINAL_ONLY)})
        assert again["next"][-1].outputs[0].finish_reason == "length"
        await llm.check_health()
    check_leftovers()


async def test_min_tokens_and_extreme_seeds_do_not_kill_the_engine(faulty_llm: AsyncLLM, tokenizer: Any) -> None:
    """min_tokens masks EOS on the model runner's own logits (this killed the engine: an in-place
    write to an inference tensor); seeds at both ends of the signed 64-bit range work; one past
    it is refused with InvalidInputError naming `seed` before anything reaches the engine."""
    llm = faulty_llm
    eos = tokenizer.eos_token_id
    jobs = {"min-greedy": SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5, stop_token_ids=[eos]),
            "min-sampled": SamplingParams(min_tokens=3, max_tokens=5, seed=7),
            "seed-max": SamplingParams(seed=2**63 - 1, max_tokens=3, ignore_eos=True),
            "seed-min": SamplingParams(seed=-(2**63), max_tokens=3, ignore_eos=True)}
    got = await run(llm, jobs)
    for rid in ("min-greedy", "min-sampled"):
        n = len(got[rid][-1].outputs[0].token_ids)  # CUMULATIVE: the last output has them all
        assert 3 <= n <= 5 and got[rid][-1].outputs[0].finish_reason in ("stop", "length"), rid
    assert all(len(got[rid][-1].outputs[0].token_ids) == 3 for rid in ("seed-max", "seed-min"))
    for seed in (2**63, -(2**63) - 1, 2**70, True):
        with pytest.raises(InvalidInputError) as info:
            SamplingParams(seed=seed)
        assert info.value.field == "seed"
    await llm.check_health()
    await assert_idle(llm)


async def test_parameters_that_leave_no_token_fail_alone_as_the_requests_own_fault(
        faulty_llm: AsyncLLM, tokenizer: Any) -> None:
    """allowed_token_ids = [EOS] while min_tokens forbids EOS leaves no token to sample: that request
    alone ends with finish_reason "error", the sampler's reason and error_kind "invalid_request" (which
    crosses the engine boundary in every mode: the server's 400), whatever its output kind; the
    request beside it finishes untouched and nothing is left behind."""
    llm = faulty_llm
    eos = tokenizer.eos_token_id
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        got = await run(llm, {"conflict": SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2,
                                                         allowed_token_ids=[eos], output_kind=kind),
                              "fine": greedy(4)})
        final = got["conflict"][-1]
        assert final.finished and final.outputs[0].finish_reason == "error", final
        assert "every token is masked" in (final.error or "") and final.error_kind == "invalid_request"
        assert got["fine"][-1].outputs[0].finish_reason == "length" and got["fine"][-1].error_kind is None
    await llm.check_health()
    await assert_idle(llm)


async def test_a_field_changed_after_construction_is_checked_at_submission(faulty_llm: AsyncLLM) -> None:
    """SamplingParams is mutable: a value set after construction is validated again when the
    request is submitted (InvalidInputError naming the field), so it never reaches the engine."""
    params = SamplingParams(max_tokens=4)
    params.temperature = float("nan")
    with pytest.raises(InvalidInputError) as info:
        async for _ in faulty_llm.generate("hello", params, request_id="mutated"):
            pass
    assert info.value.field == "temperature"
    await faulty_llm.check_health()


async def test_text_that_cannot_cross_the_boundary_is_refused(faulty_llm: AsyncLLM) -> None:
    """A lone surrogate in a prompt, a request id or a stop string (valid Python, not UTF-8: it
    would fail to encode on its way to the engine), and a chat template that raises, are each an
    InvalidInputError naming the field; the engine is untouched."""
    async def refused(field: str, **kw: Any) -> None:
        with pytest.raises(InvalidInputError) as info:
            if "messages" in kw:
                async for _ in faulty_llm.chat(kw.pop("messages"), greedy(2), **kw):
                    pass
            else:
                async for _ in faulty_llm.generate(kw.pop("prompt", "hi"), kw.pop("params", greedy(2)), **kw):
                    pass
        assert info.value.field == field

    await refused("prompt", prompt="bad \udc80 text")
    await refused("request_id", request_id="id-\ud800")
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(stop=["fine", "bad\ud800"])
    assert info.value.field == "stop"
    await refused("messages", messages=[{"role": "user", "content": "hi"}],
                  chat_template="{{ raise_exception('this template refuses everything') }}")
    await faulty_llm.check_health()
    await assert_idle(faulty_llm)


async def test_leaving_the_context_raises_the_body_error_itself(tiny_llama: Path) -> None:
    """An exception raised inside `async with AsyncLLM(...)` comes out as itself, not wrapped in
    an ExceptionGroup by the graph's task groups."""
    class Mine(Exception):
        pass

    with pytest.raises(Mine):
        async with AsyncLLM(str(tiny_llama), multiprocess=False, **ENGINE) as llm:
            await run(llm, {"x": greedy(2)})
            raise Mine
