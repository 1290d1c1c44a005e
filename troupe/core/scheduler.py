"""`Scheduler`: vLLM v1's continuous-batching policy (`vllm/v1/core/sched/scheduler.py`), pure and sync.

One rule drives everything: each request catches `num_computed_tokens` up to `num_tokens` within a
per-step token budget. That gives chunked prefill, prefix caching, recompute preemption and
continuous batching without separate prefill and decode phases. Requests that want prompt logprobs
skip the prefix-cache read while those are incomplete; a structured-output request ends when its grammar
does (docs/sampling.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from troupe.core.batch import ScheduledSeq
from troupe.core.kv_cache import KVCacheManager
from troupe.core.request import Request, RequestStatus
from troupe.core.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from troupe.errors import InvalidInputError, RequestFailure
from troupe.messages import EngineCoreOutput, FinishReason, LogprobsLists, SchedulerStats


class ScheduledRequest(NamedTuple):
    """One request's work in a step: tokens `start_pos .. start_pos + num_new_tokens - 1`."""

    request: Request
    num_new_tokens: int
    start_pos: int  # num_computed_tokens before this step
    needs_logits: bool  # the chunk ends at the last known token: sample one after it


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running first, then admitted
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # finished since the previous schedule()
    num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests compute how many tokens; owns the waiting/running queues.

    Contract (the engine calls, per step, `schedule()` -> run the model -> `update_from_output()`;
    `add_request`/`finish_requests` between steps):
    - `schedule()` mutates: queues (admission WAITING/PREEMPTED -> RUNNING; preemption RUNNING ->
      PREEMPTED at the *front* of waiting, blocks freed, `num_computed_tokens = 0`,
      `num_preemptions += 1`), block tables (`allocate_slots`), `num_cached_tokens` (set once, at
      first admission, to the prefix-cache hit) and, last, `num_computed_tokens += num_new_tokens`
      for every scheduled request (vLLM's `_update_after_schedule`). So the model runner must use
      `ScheduledRequest.start_pos` (the old value), as `to_scheduled_seqs` does.
    - `update_from_output(out, sampled, failed)` appends one sampled token per `needs_logits` entry
      (or finishes it with an error), checks stop conditions, registers newly computed full blocks
      in the prefix cache, and frees finished requests. It skips requests finished (aborted) since
      `schedule()`.
    - `finish_requests` removes requests from either queue and frees their blocks.
    Policy: the waiting queue (`troupe.core.request_queue`) orders admission and picks the
    preemption victim: "fcfs" (arrival order; the victim is the last running) or "priority" (lower
    `priority`, then earlier `arrival_time`, first; the victim is the worst running).
    """

    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: SchedulingPolicy = "fcfs", async_scheduling: bool = False) -> None:
        self.async_scheduling = async_scheduling  # schedule() runs before the previous step's update
        self.waiting: RequestQueue = create_request_queue(policy)
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0  # cumulative
        self.step_counter = 0
        self._step_prompt_tokens = 0
        self._step_generation_tokens = 0

    # ------------------------------------------------------------------ queues

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def max_kv_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Most tokens a request holds in the KV cache at once (its last sampled token is never
        computed, and it stops once it has `max_model_len` tokens)."""
        return max(num_prompt_tokens, min(num_prompt_tokens + max_tokens - 1, self.max_model_len - 1))

    def can_fit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """Whether the request fits in the KV pool when it runs alone (else it could never finish)."""
        return self.max_kv_tokens(num_prompt_tokens, max_tokens) <= self.kv_cache.max_tokens_capacity

    def check_fits(self, req: Request) -> None:
        """Raise `InvalidInputError` if the request could never fit in the KV pool."""
        if not self.can_fit(req.num_prompt_tokens, req.max_tokens):
            need = self.max_kv_tokens(req.num_prompt_tokens, req.max_tokens)
            raise InvalidInputError(
                "max_tokens", f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) "
                f"needs {need} KV slots; the KV cache holds {self.kv_cache.max_tokens_capacity}")

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises `InvalidInputError` if it could never fit in the KV pool."""
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        assert req.num_prompt_tokens >= 1 and req.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM)
        self.check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.add(req)

    # ------------------------------------------------------------------ schedule

    def _preempt_victim(self) -> Request:
        victim = self.waiting.victim(self.running)
        self.running.remove(victim)
        self.kv_cache.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        """1. Running requests, in order: allocate their next chunk, preempting until it fits.
        2. If nothing was preempted: admit waiting requests (prefix-cache hit + a chunk) while the
        budget, `max_num_seqs` and the free blocks allow. 3. Advance `num_computed_tokens`."""
        kv, budget = self.kv_cache, self.max_num_batched_tokens
        chunks: dict[str, tuple[Request, int]] = {}  # request id -> (request, num_new_tokens)
        preempted: list[str] = []
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            computed, pending = req.num_computed_tokens, req.num_pending
            if pending and (len(req.output_token_ids) + pending >= req.max_tokens
                            or len(req.all_token_ids) + pending >= self.max_model_len):
                continue  # async: its token in flight is its last (length); the update finishes it
            n = min(len(req.all_token_ids) + pending - computed, budget, self.max_model_len - computed)
            assert n > 0, req
            while kv.allocate_slots(req, n) is None:
                victim = self._preempt_victim()
                preempted.append(victim.request_id)
                if victim.request_id in chunks:  # priority: undo its chunk
                    budget += chunks.pop(victim.request_id)[1]
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # it preempted itself (fcfs: it was last; priority: better ones may follow)
            chunks[req.request_id] = (req, n)
            budget -= n
        skipped: list[Request] = []  # waiting for their grammar: they keep their place, the next go first
        while not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting.peek()
            if head is None:
                break
            if head.status == RequestStatus.WAITING_FOR_FSM:
                skipped.append(self.waiting.pop())
                continue
            # prompt logprobs and pooling need every prompt position computed: no prefix-cache read
            hit_blocks, hit_tokens = ([], 0) if head.needs_every_position else kv.get_computed_blocks(head)
            n = min(head.num_tokens - hit_tokens, budget)
            if kv.allocate_slots(head, n, hit_blocks, hit_tokens) is None:
                break  # no skipping ahead: the head would starve
            self.waiting.pop()
            if head.num_cached_tokens < 0:
                head.num_cached_tokens = hit_tokens
            head.num_computed_tokens = hit_tokens
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            chunks[head.request_id] = (head, n)
            budget -= n
        for req in reversed(skipped):
            self.waiting.prepend(req)
        out = SchedulerOutput(preempted_req_ids=preempted, finished_req_ids=self._finished_ids)
        self._finished_ids = []
        scheduled, tokens, prompt_tokens, ahead = out.scheduled, 0, 0, self.async_scheduling
        for req, n in chunks.values():
            start = req.num_computed_tokens
            end = req.num_computed_tokens = start + n
            needs_logits = end == len(req.all_token_ids) + req.num_pending
            if needs_logits and ahead:
                req.num_pending += 1  # sampled on the device; appended by this step's update
            scheduled.append(ScheduledRequest(req, n, start, needs_logits))
            tokens += n
            if start < len(req.prompt_token_ids):
                prompt_tokens += min(end, len(req.prompt_token_ids)) - start
        out.num_scheduled_tokens = tokens
        self._step_prompt_tokens = prompt_tokens
        return out

    def to_scheduled_seqs(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """The model runner's view of `out` (same order; `prompt_logits` where the request still needs
        prompt logprobs); call before `update_from_output`."""
        blocks = self.kv_cache.get_block_ids
        seqs = [ScheduledSeq(req.request_id, req.all_token_ids[start:start + n], start, blocks(req.request_id),
                             needs_logits, req.params.prompt_logprobs is not None and req.needs_prompt_logits)
                for req, n, start, needs_logits in out.scheduled]
        if self.async_scheduling:
            for seq, (_, n, _, _) in zip(seqs, out.scheduled, strict=True):
                if len(seq.token_ids) < n:  # its last token is still on the device
                    assert len(seq.token_ids) == n - 1, (seq.request_id, n, len(seq.token_ids))
                    seq.token_ids.append(0)
                    seq.placeholder = True
        return seqs

    # ------------------------------------------------------------------ after the step

    def _check_stop(self, req: Request) -> bool:
        """vLLM's order: min_tokens holds back EOS/stop ids; EOS; stop_token_ids; the grammar's end; length."""
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= req.params.min_tokens:
            if last in req.eos_token_ids:
                req.finish_reason, req.stop_reason = FinishReason.STOP, None
                return True
            if last in req.stop_token_ids:
                req.finish_reason, req.stop_reason = FinishReason.STOP, last
                return True
        if req.grammar_terminated:  # the structured-output grammar ended (on a stop token)
            req.finish_reason, req.stop_reason = FinishReason.STOP, None
            return True
        if req.num_tokens >= self.max_model_len or req.num_output_tokens >= req.max_tokens:
            req.finish_reason = FinishReason.LENGTH
            return True
        return False

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           failed: dict[str, RequestFailure] | None = None,
                           logprobs: dict[str, LogprobsLists] | None = None,
                           prompt_logprobs: dict[str, LogprobsLists] | None = None,
                           pooled: dict[str, list[float]] | None = None,
                           ) -> tuple[list[EngineCoreOutput], list[str]]:
        """Apply one step's sampled tokens (`sampled[request_id]` for each `needs_logits` entry, or
        `failed[request_id]`, why a request's sampling failed: its error text and kind), with their logprobs
        and prompt logprobs where the engine computed them (passed on in the outputs). Returns one output
        per request that got a token or failed (never for a partial prefill chunk) and the ids that
        finished in this call. A pooling request whose chunk ended its prompt finishes ("stop") with
        `pooled[request_id]`, its vector; it registers no blocks in the prefix cache. A failed request (or one whose stop check raises) finishes with
        `FinishReason.ERROR` and its error text; its blocks are freed like any finished request's."""
        self.step_counter += bool(out.scheduled)
        outputs: list[EngineCoreOutput] = []
        finished: list[str] = []
        cache_blocks = self.kv_cache.cache_blocks if self.kv_cache.enable_prefix_caching else None
        running = RequestStatus.RUNNING
        for s in out.scheduled:
            req = s.request
            if req.status == RequestStatus.FINISHED:
                continue  # aborted since schedule(), or (async) stopped by the previous step's update
            pooling = req.pooling_params is not None
            if cache_blocks is not None and not pooling and req.status == running:
                cache_blocks(req)
            if not s.needs_logits:
                continue
            failure = failed.get(req.request_id) if failed else None
            if req.num_pending:  # async: this step's token is in (or failed)
                req.num_pending -= 1
            new: list[int] = []
            if failure is None and pooling:
                req.finish_reason, stopped = FinishReason.STOP, True
            elif failure is None:
                token = sampled[req.request_id]
                req.output_token_ids.append(token)  # `Request.append_token`, inlined: the per-token path
                req.all_token_ids.append(token)
                new = [token]
                try:
                    stopped = self._check_stop(req)
                except Exception as exc:  # this request's own failure
                    failure = RequestFailure(f"stop check failed: {type(exc).__name__}: {exc}")
            if failure is not None:
                req.finish_reason, req.stop_reason = FinishReason.ERROR, None
                stopped = True
            if stopped:
                if req.status != running:  # async: preempted by the schedule() that ran after its step
                    self.waiting.remove(req)
                req.status = RequestStatus.FINISHED
                self.kv_cache.free(req)
                del self.requests[req.request_id]
                finished.append(req.request_id)
            outputs.append(EngineCoreOutput(
                req.request_id, new, req.finish_reason, req.stop_reason,
                num_cached_tokens=max(0, req.num_cached_tokens), num_preemptions=req.num_preemptions,
                error=failure.error if failure else None, error_kind=failure.kind if failure else None,
                new_logprobs=logprobs.get(req.request_id) if logprobs and new else None,
                prompt_logprobs=prompt_logprobs.get(req.request_id) if prompt_logprobs else None,
                pooled=pooled.get(req.request_id) if pooled and failure is None else None))
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            self._finished_ids.extend(finished)
        self._step_generation_tokens = sum(len(o.new_token_ids) for o in outputs)
        return outputs, finished

    def finish_requests(self, request_ids: str | Iterable[str],
                        reason: FinishReason = FinishReason.ABORT) -> list[str]:
        """Finish (by default abort) requests wherever they are; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done: list[str] = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self.kv_cache.free(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            done.append(rid)
        self._finished_ids.extend(done)
        return done

    def stats(self, step_counter: int | None = None) -> SchedulerStats:
        """A snapshot; `step_counter` overrides the scheduler's own count of non-empty steps."""
        kv = self.kv_cache
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_counter if step_counter is None else step_counter,
            num_prompt_tokens=self._step_prompt_tokens, num_generation_tokens=self._step_generation_tokens)
