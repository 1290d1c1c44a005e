"""n > 1 through the real engine (the tiny random Llama; the default model once): one request fanned
out into n children in the frontend, with per-child seeds, the prompt's prefill shared through the
prefix cache (its hit counters say so), outputs gathered per output kind, the parent's abort reaching
every child, one child's failure finishing that child alone. In-process, with two engines behind the
balancer (the children follow child 0 to its engine), and in an engine process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from factories import TINY_ENGINE, assert_idle
from support.faults import fault_hooks

from troupe import LLM, AsyncLLM, RequestOutput, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow  # engines, one of them in a process

K = RequestOutputKind
MODES: dict[str, dict[str, Any]] = {
    "in-process": {"multiprocess": False},
    "dp2-in-process": {"multiprocess": False, "data_parallel_size": 2},
    "multiprocess": {"multiprocess": True},
}
BLOCK = TINY_ENGINE["block_size"]


def params(n: int, kind: RequestOutputKind = K.FINAL_ONLY, max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)


def prompt(first: int, length: int) -> dict[str, list[int]]:
    """A prompt no other test uses (token ids from `first` on), so the prefix cache holds none of it."""
    return {"prompt_token_ids": list(range(first, first + length))}


async def outputs(llm: AsyncLLM, p: Any, sp: SamplingParams, request_id: str | None = None) -> list[RequestOutput]:
    with anyio.fail_after(120):
        return [o async for o in llm.generate(p, sp, request_id)]


@pytest.fixture(scope="module", params=list(MODES))
async def llm(request: pytest.FixtureRequest, tiny_llama: Path, ipc_root: str,
              check_leftovers: Any) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM(str(tiny_llama), max_model_len=256, ipc_dir=ipc_root, **TINY_ENGINE,
                        **MODES[request.param]) as engine:
        yield engine
    check_leftovers()


async def test_final_only_is_one_output_of_n_samples_each_with_its_seed(llm: AsyncLLM) -> None:
    """FINAL_ONLY, n=3, seed 7: one finished output with indices 0..2, sample i equal to an n=1
    request with seed 7 + i (vLLM's per-child seeds), the samples not all equal."""
    p = prompt(1000, 5)
    (out,) = await outputs(llm, p, params(3, seed=7))
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    for i, sample in enumerate(out.outputs):
        (alone,) = await outputs(llm, p, params(1, seed=7 + i))
        assert sample.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.metrics is not None and out.metrics.num_generation_tokens == 24
    await assert_idle(llm)


@pytest.mark.parametrize("kind", [K.DELTA, K.CUMULATIVE])
async def test_streamed_updates_carry_their_index_and_add_up(llm: AsyncLLM, kind: RequestOutputKind) -> None:
    """DELTA / CUMULATIVE, n=2: every update names its samples by index, only the last is finished,
    and per index the updates add up to the FINAL_ONLY samples of the same seed."""
    p = prompt(2000, 7)
    streamed = await outputs(llm, p, params(2, kind, seed=11))
    (final,) = await outputs(llm, p, params(2, seed=11))
    assert [o.finished for o in streamed] == [False] * (len(streamed) - 1) + [True]
    ids: dict[int, list[int]] = {0: [], 1: []}
    for o in streamed:
        for c in o.outputs:
            ids[c.index] = ids[c.index] + c.token_ids if kind is K.DELTA else c.token_ids
    assert ids == {c.index: c.token_ids for c in final.outputs}
    await assert_idle(llm)


async def test_the_children_share_the_prompts_prefill_through_the_prefix_cache(llm: AsyncLLM) -> None:
    """A prompt of three full blocks and a bit, n=4: child 0 computes it; the three others find its
    full blocks in the prefix cache (the engine's hit counter grows by 3 x 48 tokens) on the same engine."""
    assert await llm.reset_prefix_cache()
    before = (await llm.get_stats())["prefix_cache_hits"]
    (out,) = await outputs(llm, prompt(3000, 3 * BLOCK + 5), params(4))
    after = (await llm.get_stats())["prefix_cache_hits"]
    assert after - before == 3 * 3 * BLOCK
    assert out.num_cached_tokens == 3 * BLOCK and len(out.outputs) == 4
    await assert_idle(llm)


async def test_aborting_the_parent_aborts_every_child(llm: AsyncLLM) -> None:
    """n=3 streaming long requests: aborting the user's id after the first update ends every sample
    with "abort" in one finished output; nothing is left in the frontend or the engine."""
    sp = params(3, K.DELTA, max_tokens=200)
    seen: list[RequestOutput] = []
    with anyio.fail_after(120):
        async for out in llm.generate(prompt(4000, 4), sp, "par-abort"):
            seen.append(out)
            if len(seen) == 1:
                await llm.abort("par-abort")
    last = seen[-1]
    assert last.finished and sum(o.finished for o in seen) == 1
    assert {c.index: c.finish_reason for c in last.outputs} == {0: "abort", 1: "abort", 2: "abort"}
    assert sum(len(c.token_ids) for o in seen for c in o.outputs) < 3 * 200
    await assert_idle(llm)


async def test_one_failing_child_finishes_alone(tiny_llama: Path) -> None:
    """Sampling fails for child 1 only (the test-only fault on its id `1_<parent id>`): that sample
    finishes with "error", the others run to their length, the final output names the sample."""
    async with AsyncLLM(str(tiny_llama), max_model_len=256, multiprocess=False, hooks=fault_hooks("fail_sampling=1_bad"),
                        **TINY_ENGINE) as llm:
        (out,) = await outputs(llm, prompt(5000, 4), params(3, seed=1), "bad-request")
        assert {c.index: c.finish_reason for c in out.outputs} == {0: "length", 1: "error", 2: "length"}
        assert out.error is not None and out.error.startswith("sample 1:") and out.error_kind == "internal"
        assert [len(c.token_ids) for c in out.outputs if c.index != 1] == [8, 8]
        (healthy,) = await outputs(llm, prompt(5000, 4), params(2, seed=1), "good-request")
        assert [c.finish_reason for c in healthy.outputs] == ["length", "length"]
        await assert_idle(llm)


def test_llm_generate_returns_one_output_per_prompt_with_n_samples(tiny_llama: Path) -> None:
    """`LLM.generate` with n=2 over three prompts: three outputs in input order, two samples each."""
    prompts = [prompt(6000 + 10 * i, 3 + i) for i in range(3)]
    with LLM(str(tiny_llama), max_model_len=256, multiprocess=False, **TINY_ENGINE) as llm:
        outs = llm.generate(prompts, params(2, seed=5), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert all(o.finished and [c.index for c in o.outputs] == [0, 1] for o in outs)


@pytest.mark.timeout(600)  # the default model loads
def test_n_samples_of_the_default_model() -> None:
    """SmolLM2, n=3 with a seed on a prompt of two KV blocks and more: three different texts (each its
    token ids decoded), the prompt's full blocks served from the prefix cache, the same texts again
    for the same seed and the same schedule. (Sample i equals an n=1 request with seed + i on the tiny float32 model above;
    the default model's quantized kernels are not batch-invariant, so a sample computed beside
    others may part from its solo run at a near tie.)"""
    text = ("Write three short sentences about the sea, the wind and the old lighthouse on the hill, "
            "where the keeper lived alone with his dog and a shelf of books about ships.")
    sp = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    with LLM(max_model_len=512, multiprocess=False) as llm:
        tokenizer = llm.get_tokenizer()
        assert len(tokenizer.encode(text)) >= 2 * BLOCK
        (out,) = llm.generate([text], sp, use_tqdm=False)
        assert llm.reset_prefix_cache()  # the same schedule again: child 0 computes the whole prompt
        (again,) = llm.generate([text], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert all(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out.outputs)
    assert len({c.text for c in out.outputs}) == 3
    assert out.num_cached_tokens >= 2 * BLOCK
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]
