"""`EngineCore`: scheduler + KV cache manager + model runner + sampler, stepped synchronously.

No I/O and no event loop: the engine-core actor (or a plain loop) calls it.

Flow of one `step()`:
1. the scheduler picks this step's requests and token counts (continuous batching, chunked
   prefill, preemption when KV blocks run out);
2. the model runner computes the scheduled tokens through the paged KV cache and returns logits
   for the requests whose chunk reached their last token (and at every position of the chunks of
   requests that want prompt logprobs, which are computed here);
3. the sampler picks one token for each of those (with its logprobs when asked), under each
   structured-output request's grammar bitmask; the grammars then accept the tokens;
4. the scheduler appends them, checks stop conditions, frees finished requests and returns one
   `EngineCoreOutput` per request with something new.

Pooling (`runner="pooling"`, troupe.pooling): step 2 returns the final hidden states the pooler needs
instead of logits (`ModelRunner.execute_hidden`), the `Pooler` folds each chunk into its request, and a
request whose chunk ended its prompt finishes with its vector (`EngineCoreOutput.pooled`); nothing is
sampled, and its KV blocks are freed at once.

Structured outputs: a request with `structured_outputs` enters the scheduler's queue as
`WAITING_FOR_FSM`, which admission skips (it keeps its place), while its grammar compiles in the
`StructuredOutputManager`'s worker thread (never on this step path); once it is ready the request holds
its matcher (`Request.matcher`) and is `WAITING`; a compilation that fails finishes that request alone
with an error.

Per-request fault isolation: an exception that belongs to one request (building its sampling row or
grammar bitmask, sampling its row, its grammar, its prompt logprobs, its stop checks, its add) finishes that request alone with
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
from troupe.core.batch import ScheduledSeq
from troupe.core.kv_cache import KVCacheManager
from troupe.core.logprobs import add_prompt_logprobs, to_lists
from troupe.core.model_runner import ModelRunner
from troupe.core.overlap import GRAMMAR_WAIT_S, AsyncStepper, DeviceQueue, InlineQueue
from troupe.core.pooler import Pooler
from troupe.core.request import Request, RequestStatus
from troupe.core.request_sampling import RequestSampling, request_failed
from troupe.core.sampler import LogprobsRow, make_sampler
from troupe.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from troupe.errors import ErrorKind, InvalidInputError, RequestFailure
from troupe.inputs import ModelLimits, check_runner, validate_prompt_ids, validate_sampling
from troupe.log import trace, trace_enabled
from troupe.messages import AddRequest, EngineCoreOutput, EngineCoreOutputs, FinishReason, LogprobsLists
from troupe.models.loader import load_tokenizer, resolve_tokenizer
from troupe.pooling import resolve_pooler
from troupe.structured.manager import StructuredOutputManager

log = structlog.get_logger("troupe.engine")


class EngineCore:
    def __init__(self, config: EngineConfig, *, engine_index: int = 0,
                 model_runner: ModelRunner | None = None, device_queue: DeviceQueue | None = None) -> None:
        self.config = config
        self.engine_index = engine_index
        self.runner = model_runner if model_runner is not None else ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   policy="priority" if config.scheduling_policy == "priority" else "fcfs",
                                   async_scheduling=config.async_scheduling)
        self.sampler = make_sampler(self.runner.device, seed=config.seed, logprobs_mode=config.logprobs_mode)
        self.sampling = RequestSampling(self.sampler, self.runner.vocab_size)  # rows, fault isolation
        tokenizer_path = resolve_tokenizer(config.tokenizer) if config.tokenizer else self.runner.model_path
        self.structured = StructuredOutputManager(lambda: load_tokenizer(tokenizer_path), self.runner.vocab_size,
                                                  list(self.runner.info.eos_token_ids),
                                                  compile_timeout_s=config.grammar_compile_timeout_s)
        self._failed_outside: list[EngineCoreOutput] = []  # failed outside the scheduler's step update
        self._requests: dict[str, Request] = {}
        self._step_started = 0.0  # trace only: when this step's schedule() returned
        self._aborted_since_last_step: list[str] = []
        self.pooler: Pooler | None = None  # runner="pooling": prefill-only requests, pooled hidden states
        if config.runner == "pooling":
            info = self.runner.info
            self.pooler = Pooler(resolve_pooler(self.runner.model_path, info.hf_config, info.arch.hidden_size,
                                                config.pooler_config))
        self.step_counter = 0
        # async scheduling (troupe.core.overlap): step N+1 launched before step N's ids are read
        self.stepper = AsyncStepper(self, device_queue or InlineQueue()) if config.async_scheduling else None
        self.num_added = 0  # requests accepted by add_request (cumulative)
        self.num_aborted = 0  # requests stopped by abort_requests (cumulative)
        self.limits = ModelLimits(
            vocab_size=self.runner.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(self.runner.info.eos_token_ids),
            kv_capacity_tokens=self.kv_capacity_tokens,
            priority_scheduling=config.scheduling_policy == "priority",
            max_logprobs=config.max_logprobs,
            pooler=self.pooler.config if self.pooler is not None else None,
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
        check_runner(self.limits.pooler, msg.pooling_params)
        validate_prompt_ids(msg.prompt_token_ids, self.limits, 0 if msg.pooling_params is not None else 1)
        if msg.priority != 0 and not self.limits.priority_scheduling:
            raise InvalidInputError("priority", f"got {msg.priority}, but the engine schedules first-come-first-"
                                    "served; start it with scheduling_policy='priority' to use priorities")
        if msg.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {msg.max_tokens}")
        if msg.params.n != 1:  # the frontend fans an n > 1 request out into n children of n = 1
            raise InvalidInputError("n", f"the engine takes one sample per request, got n={msg.params.n}")
        validate_sampling(msg.params, self.limits)
        req = Request.from_message(msg)
        # A request that can never fit the pool would wait (or preempt itself) forever: cap it.
        req.max_tokens = min(req.max_tokens, self.kv_capacity_tokens - req.num_prompt_tokens)
        spec = msg.params.structured_outputs
        if spec is not None:
            req.status = RequestStatus.WAITING_FOR_FSM  # queued, skipped until its grammar is ready
        self.scheduler.add_request(req)  # the last check that can refuse it: nothing to undo before
        if spec is not None:
            self.structured.submit(msg.request_id, spec)  # compiles in the manager's thread
        self._requests[msg.request_id] = req
        self.num_added += 1
        if trace_enabled():
            req.added_at = time.monotonic()

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
        """Requests to run, or (async scheduling) a step in flight whose outputs are still to report."""
        return self.scheduler.has_unfinished_requests() or (self.stepper is not None and self.stepper.inflight is not None)

    def close(self) -> None:
        """Stop the grammar compiler's thread and the device queue (idempotent; also done when the engine is
        collected)."""
        self.structured.close()
        if self.stepper is not None:
            self.stepper.close()

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
        self.structured.forget(request_id)

    # ------------------------------------------------------------------ stepping

    def step(self) -> EngineCoreOutputs:
        """Run one scheduling + forward + sampling iteration (with async scheduling: launch one and report
        the previous one, troupe.core.overlap)."""
        if self.stepper is not None:
            return self.stepper.step()
        self._admit_grammar_ready()
        sched_out = self.scheduler.schedule()
        self._log_preempted(sched_out)
        sampled: dict[str, int] = {}
        failed: dict[str, RequestFailure] = {}  # request id -> why it failed (its own fault: see _sample)
        logprobs: dict[str, LogprobsLists] = {}
        prompt_logprobs: dict[str, LogprobsLists] = {}
        pooled: dict[str, list[float]] = {}
        if sched_out.scheduled and self.pooler is not None:
            pooled = self._pool(self.scheduler.to_scheduled_seqs(sched_out), self.pooler, failed)
            self.step_counter += 1
        elif sched_out.scheduled:
            seqs = self.scheduler.to_scheduled_seqs(sched_out)
            sampling_reqs = [s.request for s in sched_out.scheduled if s.needs_logits]
            logits = self._prompt_logprobs(seqs, sampling_reqs, self.runner.execute(seqs), failed,
                                           prompt_logprobs)  # (S, V)
            if sampling_reqs:
                sampled, sample_failed, rows = self._sample(logits, sampling_reqs)
                failed.update(sample_failed)
                self._advance_grammars(sampled, failed)
                logprobs = {rid: to_lists([row]) for rid, row in rows.items()}
            self.step_counter += 1
        elif self.structured.num_waiting:
            self.structured.wait(GRAMMAR_WAIT_S)  # nothing to run until a grammar is ready
        outputs, finished = self.scheduler.update_from_output(sched_out, sampled, failed, logprobs, prompt_logprobs,
                                                              pooled)
        return self._step_outputs(outputs, finished, sched_out, len(sampled))

    def _log_preempted(self, sched_out: SchedulerOutput) -> None:
        for rid in sched_out.preempted_req_ids:
            preempted = self._requests[rid]
            log.debug("request preempted", request_id=preempted.external_id, internal_id=rid,
                      preemptions=preempted.num_preemptions, kv_cache_usage=round(self.kv.usage, 3))
        if trace_enabled():
            self._step_started = time.monotonic()
            self._trace_scheduled(sched_out.scheduled)

    def _step_outputs(self, outputs: list[EngineCoreOutput], finished: list[str], sched_out: SchedulerOutput,
                      num_sampled: int) -> EngineCoreOutputs:
        """The step's message: its outputs, those that failed outside the update, every id that finished
        (aborts included), the scheduler's stats; finished requests forgotten."""
        tracing = trace_enabled()
        if self._failed_outside:
            outputs = self._failed_outside + outputs
            finished = [o.request_id for o in self._failed_outside] + finished
            self._failed_outside = []
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
                  prompt_tokens=stats.num_prompt_tokens, sampled=num_sampled, running=stats.num_running,
                  waiting=stats.num_waiting, kv_cache_usage=round(stats.kv_cache_usage, 3),
                  step_s=round(time.monotonic() - self._step_started, 5))
        return EngineCoreOutputs(engine_index=self.engine_index, outputs=outputs,
                                 scheduler_stats=stats, finished_requests=finished)

    def _pool(self, seqs: list[ScheduledSeq], pooler: Pooler, failed: dict[str, RequestFailure]
              ) -> dict[str, list[float]]:
        """The pooling runner's step: the hidden states the pooler needs, folded into each request's
        state; the finished vectors by request id (a request whose `finish` raises fails alone)."""
        hidden = self.runner.execute_hidden(seqs, pooler.rows(seqs))  # (R, hidden)
        pooled: dict[str, list[float]] = {}
        for rid, vector in pooler.update(seqs, hidden, self._requests).items():
            req = self._requests[rid]
            assert req.pooling_params is not None
            try:
                pooled[rid] = pooler.finish(vector, req.pooling_params)
            except Exception as exc:
                failed[rid] = request_failed(req, "pooling", exc)
        return pooled

    def _trace_scheduled(self, scheduled: Iterable[ScheduledRequest]) -> None:
        now = time.monotonic()
        for s in scheduled:
            added, s.request.added_at = s.request.added_at, None
            if added is not None:  # its first admission
                trace(log, "request scheduled", request_id=s.request.external_id, internal_id=s.request.request_id,
                      waited_s=round(now - added, 5), cached_tokens=max(0, s.request.num_cached_tokens),
                      chunk_tokens=s.num_new_tokens)

    def _admit_grammar_ready(self) -> None:
        """Requests whose grammar compiled take their matcher and become WAITING (admission no longer
        skips them); those whose compilation failed finish."""
        if not self.structured.num_waiting:
            return
        ready, failed = self.structured.poll()
        for rid, matcher in ready.items():
            req = self._requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_FSM:
                req.matcher = matcher
                req.status = RequestStatus.WAITING
        for rid, error in failed.items():
            req = self._requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_FSM:
                self.scheduler.finish_requests([rid], FinishReason.ERROR)
                log.error("request failed", request_id=req.external_id, internal_id=rid, error=error)
                # the spec passed the edge's checks, but its grammar did not compile (in time): the
                # request's own input, a 400; a matcher that failed on a compiled grammar is ours
                kind: ErrorKind = "internal" if error.startswith("grammar matcher failed") else "invalid_request"
                self._failed_outside.append(EngineCoreOutput(rid, [], FinishReason.ERROR, error=error,
                                                             error_kind=kind))

    def _fail_now(self, req: Request, failure: RequestFailure) -> None:
        """Finish a scheduled request with an error outside the sampled-token path (its blocks freed)."""
        self.scheduler.finish_requests([req.request_id], FinishReason.ERROR)
        self._failed_outside.append(EngineCoreOutput(req.request_id, [], FinishReason.ERROR, error=failure.error,
                                                     num_preemptions=req.num_preemptions,
                                                     error_kind=failure.kind))

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], sampling_reqs: list[Request], logits: torch.Tensor,
                         failed: dict[str, RequestFailure], out: dict[str, LogprobsLists]) -> torch.Tensor:
        """Take the prompt-logits rows out of `logits` (see `troupe.core.batch`), compute those requests'
        prompt logprobs, and return the rows to sample from, one per seq that needs logits (`sampling_reqs`,
        in order). A request's prompt logprobs go into `out` with its first token."""
        if any(s.prompt_logits for s in seqs):
            logits = self._take_prompt_logits(seqs, logits, failed)
        self._send_prompt_logprobs(sampling_reqs, out)
        return logits

    @staticmethod
    def _send_prompt_logprobs(sampling_reqs: list[Request], out: dict[str, LogprobsLists]) -> None:
        """Each of these requests that asked for prompt logprobs and has not had them: into `out` (they go
        with its first token)."""
        for req in sampling_reqs:
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                out[req.request_id] = to_lists(req.prompt_logprob_rows)
                req.prompt_logprobs_sent = True

    def _take_prompt_logits(self, seqs: list[ScheduledSeq], logits: torch.Tensor,
                            failed: dict[str, RequestFailure]) -> torch.Tensor:
        keep: list[int] = []
        at = 0
        for seq in seqs:
            n = len(seq.token_ids) if seq.prompt_logits else int(seq.needs_logits)
            if seq.prompt_logits:
                req = self._requests[seq.request_id]
                try:
                    add_prompt_logprobs(req, logits[at:at + n], seq.start_pos)
                except Exception as exc:
                    error = request_failed(req, "computing its prompt logprobs", exc)
                    if seq.needs_logits:
                        failed[req.request_id] = error
                    else:
                        self._fail_now(req, error)
            if seq.needs_logits:
                keep.append(at + n - 1)
            at += n
        return logits[keep]

    def _advance_grammars(self, sampled: dict[str, int], failed: dict[str, RequestFailure]) -> None:
        """Each structured request's grammar accepts its sampled token; one it rejects fails the request."""
        for rid, token in list(sampled.items()):
            matcher = self._requests[rid].matcher
            if matcher is None:
                continue
            try:
                if not matcher.accept(token):
                    raise ValueError(f"token {token} is not allowed by the grammar here")
            except Exception as exc:
                failed[rid] = request_failed(self._requests[rid], "advancing its grammar", exc)
                del sampled[rid]
                continue
            if matcher.terminated:
                self._requests[rid].grammar_terminated = True

    def _sample(self, logits: torch.Tensor, reqs: list[Request]
                ) -> tuple[dict[str, int], dict[str, RequestFailure], dict[str, LogprobsRow]]:
        """`RequestSampling.sample` (a method of its own: `troupe.bench.host` times it)."""
        return self.sampling.sample(logits, reqs)
