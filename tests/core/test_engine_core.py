"""EngineCore as a plain synchronous object: seeds, bad input, and serving on after errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from factories import add_request

from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.errors import InvalidInputError
from troupe.messages import AddRequest, FinishReason
from troupe.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=128, num_kv_blocks=256,
                                   max_num_batched_tokens=128, num_threads=1))


def run(core: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add_request(r)
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    return got


def req(rid: str, prompt: list[int], max_tokens: int = 12, **kw: Any) -> AddRequest:
    return add_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_16(core: EngineCore) -> None:
    """A seeded request samples the same tokens alone and among 15 other random requests."""
    prompt = [10, 20, 30, 40, 50]
    alone = run(core, [req("s", prompt, temperature=1.0, seed=1234)])["s"]
    batch = [req("s", prompt, temperature=1.0, seed=1234)]
    batch += [req(f"o{i}", [7 + i] * (3 + i), temperature=1.0) for i in range(15)]
    together = run(core, batch)
    assert together["s"] == alone
    other_seed = run(core, [req("t", prompt, temperature=1.0, seed=99)])["t"]
    assert other_seed != alone  # the seed matters (12 tokens over a 49k vocabulary)


def test_greedy_does_not_depend_on_the_batch(core: EngineCore) -> None:
    """Greedy tokens are the same alone and in a batch with other requests."""
    alone = run(core, [req("g", [5, 6, 7, 8], temperature=0.0)])["g"]
    together = run(core, [req("g", [5, 6, 7, 8], temperature=0.0)]
                   + [req(f"x{i}", [9] * (20 + i), temperature=0.0) for i in range(8)])
    assert together["g"] == alone


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "field"),
    [
        ([], 4, "prompt"),
        ([1, 2, 10**6], 4, "prompt_token_ids"),
        ([-1, 2], 4, "prompt_token_ids"),
        (list(range(1, 129)), 4, "prompt"),  # context is 128 tokens
        ([1, 2, 3], 0, "max_tokens"),
    ],
    ids=["empty", "oov", "negative", "too-long", "max_tokens-0"],
)
def test_bad_requests_raise_and_the_engine_keeps_serving(
    core: EngineCore, prompt: list[int], max_tokens: int, field: str
) -> None:
    """Invalid adds raise InvalidInputError naming the field; a valid request right after finishes."""
    with pytest.raises(InvalidInputError) as info:
        core.add_request(AddRequest("bad", prompt, SamplingParams(max_tokens=None), max_tokens))
    assert info.value.field == field
    assert run(core, [req("ok", [1, 2, 3], max_tokens=3)])["ok"].__len__() == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(n=0), "n"),
        (dict(n=2, temperature=0.0), "n"),
        (dict(logprobs=-2), "logprobs"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    """SamplingParams validation: ValueError naming the field and the allowed range."""
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, InvalidInputError) and info.value.field == field


def test_context_length_ends_a_request_with_length(core: EngineCore) -> None:
    """A request that reaches max_model_len finishes with 'length' and frees its blocks."""
    prompt = list(range(1, 120))
    core.add_request(AddRequest("long", prompt, SamplingParams(max_tokens=None, ignore_eos=True), 128 - len(prompt)))
    outs = []
    while core.has_unfinished_requests():
        outs.extend(core.step().outputs)
    assert sum(len(o.new_token_ids) for o in outs) == 128 - len(prompt)
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert core.kv.usage == 0.0


def test_abort_frees_everything(core: EngineCore) -> None:
    """Aborting running and waiting requests leaves no blocks in use and reports them finished."""
    for i in range(4):
        core.add_request(req(f"a{i}", [3] * 40, max_tokens=50))
    core.step()
    aborted = core.abort_requests([f"a{i}" for i in range(4)] + ["unknown"])
    assert sorted(aborted) == [f"a{i}" for i in range(4)]
    assert not core.has_unfinished_requests()
    assert core.kv.usage == 0.0
    assert sorted(core.step().finished_requests) == [f"a{i}" for i in range(4)]


def test_priority_needs_the_priority_policy(core: EngineCore, tiny_llama: Path) -> None:
    """A priority under FCFS is an error, never silently ignored; the priority policy honours it."""
    with pytest.raises(InvalidInputError) as info:
        core.add_request(AddRequest("p", [1, 2], SamplingParams(max_tokens=2), 2, priority=5))
    assert info.value.field == "priority"
    prio = EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, max_num_seqs=1,
                                   num_threads=1, scheduling_policy="priority"))
    order: list[str] = []
    for rid, priority in (("late", 5), ("urgent", -1)):
        prio.add_request(AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), 1,
                                    priority=priority))
    while prio.has_unfinished_requests():
        order.extend(o.request_id for o in prio.step().outputs if o.finished)
    assert order == ["urgent", "late"]
