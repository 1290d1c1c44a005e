"""`EngineCore`: scheduler + KV cache manager + model runner + sampler, stepped synchronously.

No I/O and no event loop: the engine-core actor (or a plain loop) calls it.

Flow of one `step()`:
1. the scheduler picks this step's requests and token counts (continuous batching, chunked
   prefill, preemption when KV blocks run out);
2. the model runner computes the scheduled tokens through the paged KV cache and returns logits
   for the requests whose chunk reached their last token;
3. the sampler picks one token for each of those;
4. the scheduler appends them, checks stop conditions, frees finished requests and returns one
   `EngineCoreOutput` per request with something new.

Per-request fault isolation: an exception that belongs to one request (building its sampling row,
sampling its row, its stop checks, its add) finishes that request alone with
`FinishReason.ERROR` and the error text (`EngineCoreOutput.error`), its blocks freed; the other
requests and the engine go on. Only what cannot be pinned on one request (the forward, a broken
invariant) raises out of `step()`, and the engine-core actor reports the engine dead.

Logs (the caller binds `actor`, `engine` and `step`): "request aborted" and "request preempted" at
debug; at trace, one "step" line per step and the hops "request scheduled" (first admission, with
its wait in the queue) and "request finished in engine". All of it is skipped behind one
`trace_enabled()` test per step when tracing is off.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
import structlog
import torch

from troupe.config import EngineConfig
from troupe.core.kv_cache import KVCacheManager
from troupe.core.model_runner import ModelRunner
from troupe.core.request import Request
from troupe.core.sampler import Sampler, SamplingRow
from troupe.core.scheduler import ScheduledRequest, Scheduler
from troupe.errors import InvalidInputError
from troupe.inputs import ModelLimits, validate_prompt_ids
from troupe.log import trace, trace_enabled
from troupe.messages import AddRequest, EngineCoreOutputs, FinishReason

log = structlog.get_logger("troupe.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, *, engine_index: int = 0,
                 model_runner: ModelRunner | None = None) -> None:
        self.config = config
        self.engine_index = engine_index
        self.runner = model_runner if model_runner is not None else ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   policy="priority" if config.scheduling_policy == "priority" else "fcfs")
        self.sampler = Sampler(seed=config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._requests: dict[str, Request] = {}
        self._aborted_since_last_step: list[str] = []
        self._added_at: dict[str, float] = {}  # trace only: when a request joined, until first scheduled
        self.step_counter = 0
        self.num_added = 0  # requests accepted by add_request (cumulative)
        self.num_aborted = 0  # requests stopped by abort_requests (cumulative)
        self.limits = ModelLimits(
            vocab_size=self.runner.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.runner.info.eos_token_ids),
            kv_capacity_tokens=self.kv_capacity_tokens,
            priority_scheduling=config.scheduling_policy == "priority",
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one request can hold when it has the whole pool."""
        return self.kv.num_usable_blocks * self.runner.block_size

    # ------------------------------------------------------------------ requests

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request. Raises `InvalidInputError` if it is invalid; whatever it raises, the
        request leaves no trace here (the caller answers it with an error, the engine goes on)."""
        if msg.request_id in self._requests:
            raise InvalidInputError("request_id", f"{msg.request_id!r} is already running in this engine")
        validate_prompt_ids(msg.prompt_token_ids, self.limits)
        if msg.priority != 0 and not self.limits.priority_scheduling:
            raise InvalidInputError("priority", f"got {msg.priority}, but the engine schedules first-come-first-"
                                    "served; start it with scheduling_policy='priority' to use priorities")
        if msg.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {msg.max_tokens}")
        req = Request.from_message(msg)
        # A request that can never fit the pool would wait (or preempt itself) forever: cap it.
        req.max_tokens = min(req.max_tokens, self.kv_capacity_tokens - req.num_prompt_tokens)
        generator = None if msg.params.seed is None else torch.Generator().manual_seed(msg.params.seed)
        self.scheduler.add_request(req)  # the last check that can refuse it: nothing to undo before
        if generator is not None:
            self._generators[msg.request_id] = generator
        self._requests[msg.request_id] = req
        self.num_added += 1
        if trace_enabled():
            self._added_at[msg.request_id] = time.monotonic()

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop these requests and free their blocks; unknown or finished ids are ignored."""
        ids = [r for r in request_ids if r in self._requests]
        aborted = self.scheduler.finish_requests(ids, FinishReason.ABORT)
        for rid in aborted:
            req = self._requests[rid]
            log.debug("request aborted", request_id=req.external_id, internal_id=rid,
                      output_tokens=req.num_output_tokens)
            self._forget(rid)
        self._aborted_since_last_step.extend(aborted)
        self.num_aborted += len(aborted)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_unreported_finishes(self) -> bool:
        """Requests aborted since the last step, not yet reported in `finished_requests`."""
        return bool(self._aborted_since_last_step)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def get_stats(self) -> dict[str, int | float]:
        """The scheduler's latest counters plus the KV pool's size."""
        stats = msgspec.structs.asdict(self.scheduler.stats(step_counter=self.step_counter))
        stats.update(num_kv_blocks=self.kv.num_usable_blocks, block_size=self.runner.block_size,
                     engine_index=self.engine_index, num_requests_added=self.num_added,
                     num_requests_aborted=self.num_aborted)
        return stats

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._added_at.pop(request_id, None)

    # ------------------------------------------------------------------ stepping

    def step(self) -> EngineCoreOutputs:
        """Run one scheduling + forward + sampling iteration."""
        tracing = trace_enabled()
        started = time.monotonic() if tracing else 0.0
        sched_out = self.scheduler.schedule()
        for rid in sched_out.preempted_req_ids:
            preempted = self._requests[rid]
            log.debug("request preempted", request_id=preempted.external_id, internal_id=rid,
                      preemptions=preempted.num_preemptions, kv_cache_usage=round(self.kv.usage, 3))
        if tracing:
            self._trace_scheduled(sched_out.scheduled)
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}  # request id -> why it failed (its own fault: see _sample)
        if sched_out.scheduled:
            seqs = self.scheduler.to_scheduled_seqs(sched_out)
            logits = self.runner.execute(seqs)  # (S, V)
            sampling_reqs = [self._requests[s.request_id] for s in seqs if s.needs_logits]
            if sampling_reqs:
                sampled, failed = self._sample(logits, sampling_reqs)
            self.step_counter += 1
        outputs, finished = self.scheduler.update_from_output(sched_out, sampled, failed)
        for rid in finished:
            if tracing:
                req = self._requests[rid]
                trace(log, "request finished in engine", request_id=req.external_id, internal_id=rid,
                      finish_reason=str(req.finish_reason), output_tokens=req.num_output_tokens)
            self._forget(rid)
        finished = self._aborted_since_last_step + list(finished)
        self._aborted_since_last_step = []
        stats = self.scheduler.stats(step_counter=self.step_counter)
        if tracing:
            trace(log, "step", scheduled=len(sched_out.scheduled), tokens=sched_out.num_scheduled_tokens,
                  prompt_tokens=stats.num_prompt_tokens, sampled=len(sampled), running=stats.num_running,
                  waiting=stats.num_waiting, kv_cache_usage=round(stats.kv_cache_usage, 3),
                  step_s=round(time.monotonic() - started, 5))
        return EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs,
                                 scheduler_stats=stats, finished_requests=finished)

    def _trace_scheduled(self, scheduled: Iterable[ScheduledRequest]) -> None:
        now = time.monotonic()
        for s in scheduled:
            added = self._added_at.pop(s.request.request_id, None)
            if added is not None:  # its first admission
                trace(log, "request scheduled", request_id=s.request.external_id, internal_id=s.request.request_id,
                      waited_s=round(now - added, 5), cached_tokens=max(0, s.request.num_cached_tokens),
                      chunk_tokens=s.num_new_tokens)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[dict[str, int], dict[str, str]]:
        """One token per request of `reqs` (row i of `logits` (S, V) is `reqs[i]`'s), and the requests
        that failed: `(sampled, failed)`, by request id.

        Per-request fault isolation: an exception while building one request's sampling row fails
        that request alone; if the batched sampler raises, its rows are sampled again one by one
        (the seeded generators first rewound to where they were) and only the rows that raise on
        their own fail. Nothing here raises: what cannot be pinned on a request (the forward
        itself) has failed before this is called."""
        failed: dict[str, str] = {}
        rows: list[SamplingRow] = []
        kept: list[int] = []
        for i, req in enumerate(reqs):
            try:
                rows.append(self._sampling_row(req))
                kept.append(i)
            except Exception as exc:
                failed[req.request_id] = self._request_failed(req, "building its sampling row", exc)
        if not rows:
            return {}, failed
        if len(kept) < len(reqs):
            logits = logits[kept]  # (K, V)
        ids = [reqs[i].request_id for i in kept]
        rewind = [(row.generator, row.generator.get_state()) for row in rows if row.generator is not None]
        try:
            return dict(zip(ids, self.sampler.sample(logits, rows), strict=True)), failed
        except Exception as exc:
            log.warning("batched sampling failed: sampling its rows one by one", rows=len(rows),
                        error=f"{type(exc).__name__}: {exc}")
        for generator, state in rewind:
            generator.set_state(state)
        sampled: dict[str, int] = {}
        for i, (rid, row) in enumerate(zip(ids, rows, strict=True)):
            try:
                sampled[rid] = self.sampler.sample(logits[i:i + 1], [row])[0]
            except Exception as exc:
                failed[rid] = self._request_failed(self._requests[rid], "sampling", exc)
        return sampled, failed

    @staticmethod
    def _request_failed(req: Request, stage: str, exc: Exception) -> str:
        """Log one request's own failure (with its traceback) and return the text its caller gets."""
        error = f"{stage} failed: {type(exc).__name__}: {exc}"
        log.error("request failed", request_id=req.external_id, internal_id=req.request_id, error=error,
                  exc_info=exc)
        return error

    def _sampling_row(self, req: Request) -> SamplingRow:
        suppressed: frozenset[int] = frozenset()
        if req.num_output_tokens < req.params.min_tokens:
            suppressed = req.eos_token_ids | req.stop_token_ids
        return SamplingRow(req.params, self._generators.get(req.request_id), suppressed, req.request_id)
