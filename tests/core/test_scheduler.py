"""Scheduler: continuous batching, chunked prefill, preemption, prefix hits, stop conditions, priority
(ported from vLLM's `tests/v1/core/test_scheduler.py` FCFS and priority subsets)."""

from __future__ import annotations

import random

import pytest
from factories import EOS, make_request

from troupe.core.kv_cache import KVCacheManager
from troupe.core.request import Request, RequestStatus
from troupe.core.scheduler import Scheduler, SchedulerOutput
from troupe.errors import InvalidInputError
from troupe.messages import FinishReason


def make_scheduler(*, num_blocks: int = 1000, block_size: int = 16, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 8192, max_model_len: int = 4096, policy: str = "fcfs",
                   enable_prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, policy=policy)  # type: ignore[arg-type]


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list, list[str]]:
    """One engine step where the model samples `token` for everyone that needs logits."""
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.needs_logits}
    outputs, finished = sched.update_from_output(out, sampled)
    return out, outputs, finished


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_add_and_finish_from_waiting() -> None:
    """Added requests wait; finishing them (abort) removes them; unknown ids are ignored."""
    sched = make_scheduler()
    reqs = [make_request() for _ in range(10)]
    for i, r in enumerate(reqs):
        sched.add_request(r)
        assert sched.num_waiting == i + 1
    assert sched.finish_requests(["nope", reqs[0].request_id]) == [reqs[0].request_id]
    for i, r in enumerate(reqs[1:]):
        assert sched.finish_requests(r.request_id) == [r.request_id]
        assert sched.num_waiting == 8 - i
        assert r.status == RequestStatus.FINISHED and r.finish_reason == FinishReason.ABORT
    assert not sched.has_unfinished_requests()
    assert sched.finish_requests(reqs[0].request_id) == []


def test_schedule_all_in_order() -> None:
    """With room for everyone, one step admits every prompt in full, in arrival order."""
    sched = make_scheduler()
    reqs = [make_request(10 + i) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == reqs == sched.running
    assert all(s.num_new_tokens == s.request.num_prompt_tokens and s.needs_logits for s in out.scheduled)
    assert out.num_scheduled_tokens == sum(r.num_prompt_tokens for r in reqs)
    assert sched.num_waiting == 0 and all(r.status == RequestStatus.RUNNING for r in reqs)


def test_chunked_prefill_across_steps() -> None:
    """Budget 1024, three 800-token prompts: 800 + 224 (+ nothing), then 1 + 576 + 447."""
    sched = make_scheduler(max_num_batched_tokens=1024)
    a, b, c = (make_request(800) for _ in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    out, outputs, _ = step(sched)
    assert tokens_of(out) == {a.request_id: 800, b.request_id: 224}
    assert [o.request_id for o in outputs] == [a.request_id]  # no output for a partial chunk
    assert (b.num_computed_tokens, c.status) == (224, RequestStatus.WAITING)
    out, outputs, _ = step(sched)
    assert tokens_of(out) == {a.request_id: 1, b.request_id: 576, c.request_id: 447}
    assert [o.request_id for o in outputs] == [a.request_id, b.request_id]


def test_to_scheduled_seqs_uses_old_num_computed() -> None:
    """The runner sees start_pos before the advance, the chunk's tokens and the whole block table."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6)
    r = make_request(10)
    sched.add_request(r)
    out = sched.schedule()
    assert r.num_computed_tokens == 6  # advanced at the end of schedule()
    (seq,) = sched.to_scheduled_seqs(out)
    assert (seq.start_pos, seq.token_ids, seq.needs_logits) == (0, r.prompt_token_ids[:6], False)
    assert seq.block_ids == sched.kv_cache.get_block_ids(r.request_id) and len(seq.block_ids) == 2
    sched.update_from_output(out, {})
    (seq,) = sched.to_scheduled_seqs(sched.schedule())
    assert (seq.start_pos, seq.token_ids, seq.needs_logits) == (6, r.prompt_token_ids[6:], True)
    assert len(seq.block_ids) == 3


def test_running_before_waiting() -> None:
    """A decoding request takes its token before a new prompt gets the rest of the budget."""
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_request(5)
    sched.add_request(a)
    step(sched)
    b = make_request(20)
    sched.add_request(b)
    out, _, _ = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]


def test_max_num_seqs_caps_running() -> None:
    """No more than max_num_seqs requests run; the rest wait until one finishes."""
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(4, max_tokens=2) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == reqs[:2] and sched.num_waiting == 1
    out, _, finished = step(sched)
    assert finished == [reqs[0].request_id, reqs[1].request_id]
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == [reqs[2]]
    assert out.finished_req_ids == finished


def test_preemption_recomputes_and_resumes() -> None:
    """Out of blocks, the last admitted request is preempted (blocks freed, computed reset, front of
    waiting, tokens kept), no one is admitted that step, and it later recomputes everything."""
    sched = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)  # 4 usable blocks
    a, b = make_request(4, max_tokens=10), make_request(4, max_tokens=10)
    late = make_request(2, max_tokens=2)
    for r in (a, b):
        sched.add_request(r)
    for _ in range(5):  # a and b each hold 2 blocks after their 5th token
        step(sched)
    sched.add_request(late)
    out, _, _ = step(sched)  # a needs a 3rd block: b is preempted
    assert out.preempted_req_ids == [b.request_id] and tokens_of(out) == {a.request_id: 1}
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.num_tokens == 9 and sched.kv_cache.get_block_ids(b.request_id) == []
    assert sched.waiting.peek() is b and late.status == RequestStatus.WAITING
    while a.status != RequestStatus.FINISHED:
        step(sched)
    out, outputs, _ = step(sched)
    assert tokens_of(out)[b.request_id] == 9  # prompt + 5 outputs recomputed from 0
    assert outputs[0].num_preemptions == 1 and b.num_output_tokens == 6


def test_priority_preempts_worst() -> None:
    """Under priority, the victim is the worst (priority, arrival) running request, even if it was
    already scheduled this step (its chunk is undone)."""
    sched = make_scheduler(num_blocks=5, block_size=4, policy="priority", enable_prefix_caching=False)
    low = make_request(4, priority=5, arrival=0.0, max_tokens=10)
    high = make_request(8, priority=0, arrival=1.0, max_tokens=5)
    sched.add_request(low)
    step(sched)
    sched.add_request(high)
    step(sched)  # low holds 2 blocks, high 2: the pool is full
    assert sched.running == [low, high]
    out, _, _ = step(sched)  # low (first in running) schedules, then high needs a 3rd block
    assert out.preempted_req_ids == [low.request_id] and tokens_of(out) == {high.request_id: 1}
    assert low.status == RequestStatus.PREEMPTED


def test_priority_self_preemption_lets_better_requests_run() -> None:
    """A worst-priority request that must preempt itself frees its blocks, and the better requests
    after it in the running list still run in that step."""
    sched = make_scheduler(num_blocks=5, block_size=4, policy="priority", enable_prefix_caching=False)
    low = make_request(4, priority=5, arrival=0.0, max_tokens=10)
    high = make_request(5, priority=0, arrival=1.0, max_tokens=8)
    sched.add_request(low)
    step(sched)
    sched.add_request(high)
    for _ in range(4):
        step(sched)
    assert sched.running == [low, high] and sched.kv_cache.num_free_blocks == 0
    out, _, _ = step(sched)  # both reach position 8; low comes first and is the worst
    assert out.preempted_req_ids == [low.request_id] and tokens_of(out) == {high.request_id: 1}


@pytest.mark.parametrize(("policy", "specs", "expected"), [
    ("fcfs", [(3, 0.0), (1, 1.0), (2, 2.0)], [0, 1, 2]),
    ("priority", [(3, 0.0), (1, 1.0), (2, 2.0)], [1, 2, 0]),
    ("priority", [(1, 2.0), (1, 0.0), (1, 1.0)], [1, 2, 0]),  # ties broken by arrival
    ("priority", [(0, 5.0), (1, 0.0), (0, 1.0)], [2, 0, 1]),
])
def test_admission_order(policy: str, specs: list[tuple[int, float]], expected: list[int]) -> None:
    """FCFS admits in add order; priority by lower priority value, then earlier arrival."""
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    reqs = [make_request(4, priority=p, arrival=t, max_tokens=1) for p, t in specs]
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        out, _, _ = step(sched)
        order += [reqs.index(s.request) for s in out.scheduled]
    assert order == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_waiting_for_its_grammar_is_skipped_and_keeps_its_place(policy: str) -> None:
    """WAITING_FOR_FSM (its structured-output grammar compiling): admission passes over it, the requests
    behind it run, it counts as waiting and can be aborted there; once WAITING it is admitted before
    the requests that came after it."""
    sched = make_scheduler(policy=policy, max_num_seqs=2)
    reqs = [make_request(4, max_tokens=4) for _ in range(4)]
    reqs[0].status = RequestStatus.WAITING_FOR_FSM
    reqs[1].status = RequestStatus.WAITING_FOR_FSM
    for r in reqs:
        sched.add_request(r)
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == reqs[2:]
    assert sched.num_waiting == 2 and [r.status for r in reqs[:2]] == [RequestStatus.WAITING_FOR_FSM] * 2
    assert list(sched.waiting) == reqs[:2]  # still in their order, at the front
    assert sched.finish_requests(reqs[1].request_id) == [reqs[1].request_id]
    reqs[0].status = RequestStatus.WAITING
    later = make_request(4, max_tokens=4)
    sched.add_request(later)
    sched.finish_requests([r.request_id for r in reqs[2:]])
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == [reqs[0], later]


def test_abort_frees_blocks() -> None:
    """Aborting running and waiting requests frees every block; the ids reach the next output."""
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request(40), make_request(40)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert sched.kv_cache.num_free_blocks < sched.kv_cache.num_usable_blocks
    assert sched.finish_requests([a.request_id, b.request_id]) == [a.request_id, b.request_id]
    assert sched.update_from_output(out, {a.request_id: 1}) == ([], [])  # aborted mid-step: skipped
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_usable_blocks
    assert sched.schedule().finished_req_ids == [a.request_id, b.request_id]
    assert sched.num_running == sched.num_waiting == 0


def test_prefix_hit_sets_num_cached_tokens() -> None:
    """A shared prefix is served from the cache (block-aligned, last token recomputed); the first
    admission's value is kept after a preemption."""
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    first, second = make_request(prompt), make_request(prompt[:8] + [5, 6, 7])
    sched.add_request(first)
    step(sched)
    sched.add_request(second)
    out, outputs, _ = step(sched)
    assert tokens_of(out)[second.request_id] == 3 and second.num_cached_tokens == 8
    assert outputs[1].num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)
    sched._preempt_victim()  # second is last in running
    assert second.num_cached_tokens == 8


def test_generated_blocks_are_cached() -> None:
    """Blocks filled by generated tokens are registered once computed, so prompt+output is a hit."""
    sched = make_scheduler(block_size=4)
    a = make_request([1, 2, 3], max_tokens=6)
    sched.add_request(a)
    while a.status != RequestStatus.FINISHED:
        step(sched, token=9)
    follow_up = make_request(a.all_token_ids + [4])  # 10 tokens; 8 computed by a
    sched.add_request(follow_up)
    step(sched)
    assert follow_up.num_cached_tokens == 8


@pytest.mark.parametrize(
    ("params", "max_tokens", "max_model_len", "tokens", "n_out", "reason", "stop_reason"), [
    ({}, 16, 4096, [5, EOS, 5], 2, FinishReason.STOP, None),
    ({"ignore_eos": True}, 4, 4096, [EOS] * 5, 4, FinishReason.LENGTH, None),
    ({"stop_token_ids": [42]}, 16, 4096, [5, 42], 2, FinishReason.STOP, 42),
    ({"stop_token_ids": [EOS]}, 16, 4096, [EOS], 1, FinishReason.STOP, None),  # EOS is checked first
    ({}, 3, 4096, [5] * 5, 3, FinishReason.LENGTH, None),
    ({}, 16, 7, [5] * 5, 3, FinishReason.LENGTH, None),  # 4 prompt + 3 = max_model_len
    ({"min_tokens": 3}, 16, 4096, [EOS, EOS, EOS], 3, FinishReason.STOP, None),
    ({"min_tokens": 3, "stop_token_ids": [42]}, 16, 4096, [42, 5, 42, 42], 3, FinishReason.STOP, 42),
    ({"min_tokens": 5}, 16, 6, [EOS] * 5, 2, FinishReason.LENGTH, None),  # length beats min_tokens
])
def test_stop_conditions(params: dict, max_tokens: int, max_model_len: int, tokens: list[int], n_out: int,
                         reason: FinishReason, stop_reason: int | None) -> None:
    """vLLM's check order: min_tokens holds back EOS/stop ids, then EOS, stop ids, length."""
    sched = make_scheduler(max_model_len=max_model_len)
    r = make_request(4, max_tokens=max_tokens, **params)
    sched.add_request(r)
    for tok in tokens:
        _, outputs, finished = step(sched, token=tok)
        assert outputs[0].new_token_ids == [tok]
        if outputs[0].finished:
            break
    assert r.num_output_tokens == n_out
    assert (outputs[0].finish_reason, outputs[0].stop_reason) == (reason, stop_reason)
    assert finished == [r.request_id] and not sched.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_usable_blocks


def test_rejects_request_that_never_fits() -> None:
    """A request whose prompt + max_tokens - 1 exceeds the whole pool is refused at add time."""
    sched = make_scheduler(num_blocks=3, block_size=4)  # 8 slots
    assert sched.can_fit(4, 5) and not sched.can_fit(4, 6)
    with pytest.raises(InvalidInputError, match="max_tokens"):
        sched.add_request(make_request(4, max_tokens=6))
    sched.add_request(make_request(4, max_tokens=5))


def test_no_livelock_when_pool_fits_one() -> None:
    """With room for exactly one request, requests take turns and all finish."""
    sched = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False)
    reqs = [make_request(4, max_tokens=5) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert sched.num_preemptions > 0


def test_stats_snapshot() -> None:
    """stats() reports queue sizes, usage, and this step's prompt/generation token counts."""
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request(10))
    sched.add_request(make_request(10))
    step(sched)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.step_counter) == (1, 1, 1)
    assert (s.num_prompt_tokens, s.num_generation_tokens) == (10, 1)
    assert s.kv_cache_usage > 0


@pytest.mark.parametrize(("policy", "seed"), [("fcfs", 0), ("priority", 1)])
def test_random_workload_leaks_nothing(policy: str, seed: int) -> None:
    """1,000 random requests with shared prefixes, random aborts and tokens on a small pool: every
    step's KV reads see exactly the request's tokens, and at the end every block is free. The
    first eight requests are fixed, never aborted and run to max_tokens: they share a 16-token
    prefix (later ones hit the cache) and need 80 blocks together against 23 (the pool preempts), so
    both paths run under the checks whatever the generator draws."""
    rng = random.Random(seed)
    bs = 4
    sched = make_scheduler(num_blocks=24, block_size=bs, max_num_seqs=8, max_num_batched_tokens=32,
                           max_model_len=64, policy=policy)
    kv = sched.kv_cache
    slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (position, token)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    pending = []
    for _ in range(1000):
        tail = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))]
        prompt = rng.choice(prefixes)[:rng.randrange(0, 24)] + tail
        pending.append(make_request(prompt, max_tokens=rng.randrange(1, 20), priority=rng.randrange(3),
                                    min_tokens=rng.choice([0, 0, 1])))
    shared = prefixes[0][:4] * 4
    lead = [make_request(shared + [40 + i] * 4, max_tokens=19, min_tokens=19, priority=1) for i in range(8)]
    pending += reversed(lead)  # popped first
    live: list[Request] = []
    for _ in range(100_000):
        if not pending and not sched.has_unfinished_requests():
            break
        for _ in range(rng.randrange(0, 4)):
            if pending:
                sched.add_request(req := pending.pop())
                live.append(req)
        out = sched.schedule()
        sampled = {}
        for seq in sched.to_scheduled_seqs(out):
            req = sched.requests[seq.request_id]
            for i, tok in enumerate(seq.token_ids):
                p = seq.start_pos + i
                slots[seq.block_ids[p // bs], p % bs] = (p, tok)
            end = seq.start_pos + len(seq.token_ids)
            seen = [slots[seq.block_ids[p // bs], p % bs] for p in range(end)]
            assert seen == list(enumerate(req.all_token_ids[:end]))
            if seq.needs_logits:
                sampled[seq.request_id] = rng.choice([EOS, 5, 6, 7, 8, 9, 10, 11])
        abortable = [r for r in live if r not in lead]
        if rng.random() < 0.2 and abortable:  # abort mid-step, before the output arrives
            sched.finish_requests(rng.choice(abortable).request_id)
        sched.update_from_output(out, sampled)
        live = [r for r in live if not r.is_finished]
        held = [b for t in kv._tables.values() for b in t]
        assert all(kv.ref_cnt[b] == held.count(b) for b in range(1, kv.num_blocks))
        assert kv.num_free_blocks == sum(1 for b in range(1, kv.num_blocks) if kv.ref_cnt[b] == 0)
    assert not pending and not sched.has_unfinished_requests()
    assert sched.num_running == sched.num_waiting == 0
    assert kv.num_free_blocks == kv.num_usable_blocks and not any(kv.ref_cnt)
    assert sched.num_preemptions > 0 and kv.prefix_hits > 0  # the fixed lead's, by construction
    assert all(r.num_output_tokens == 19 for r in lead)
    assert kv.reset_prefix_cache()
