"""Async scheduling (`EngineConfig.async_scheduling`): step N+1 is launched before step N's results are back.

The synchronous step is one chain: schedule, forward, sample, read the ids back, update. On a GPU the read
is the step's one sync, and the device idles while the host updates this step and schedules the next. With
async scheduling each `EngineCore.step()` call does, for step N+1 (`AsyncStepper.step`):

1. schedule N+1 before N's tokens are known: a request whose step-N token is still on the device has a
   placeholder (`Request.num_pending`), so its next chunk is that one token; one whose in-flight token is its
   last by length (`max_tokens`, `max_model_len`) is not scheduled;
2. launch N+1's forward on the device queue: the placeholders' ids are written into its input ids from step
   N's sampled ids, on the device (`ModelRunner.execute(placeholders=...)`);
3. wait for step N's sampled ids (and logprobs) and apply them: grammars accept them, the scheduler appends
   them, checks stops and frees what finished, exactly as the synchronous step does;
4. build N+1's sampling rows now, so that penalties, `min_tokens`, grammar bitmasks and seeds see every token
   up to N, and launch N+1's sampling on the device queue over the rows of the requests still running: a
   request that stopped at N had one forward row computed for nothing, and no row sampled (its seeded
   generator draws nothing), so what a request outputs never depends on the mode.
5. return step N's outputs.

So the host's update of N, its bookkeeping and its scheduling of N+2 overlap N+1's forward. Things that need
the host mid-step still work, with a wait: prompt logprobs read the forward's logits before the sampling
launch; a batched sampling that fails falls back, on the host, to sampling its rows one by one (as the
synchronous step does), and a forward that then lacks its placeholders' ids runs again with them.

The device queue (`DeviceQueue`): `submit(fn)` returns a `concurrent.futures.Future` of `fn()`. `InlineQueue`
(every real device) runs `fn` at once: a CUDA stream already queues the kernels a launch issues, and on a CPU
the work is done when the call returns. Tests use a fake asynchronous device instead (tests/support), whose
one worker thread runs each launch later, after a random delay, reading its inputs only then: any input the
host changed after the launch (a reused buffer, a grown list) would change the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from troupe.core.batch import ScheduledSeq
from troupe.core.logprobs import to_lists
from troupe.core.request import Request, RequestStatus
from troupe.core.request_sampling import request_failed
from troupe.core.sampler import LogprobsRow, SamplerOutput
from troupe.core.sampling_metadata import SamplingRow
from troupe.core.scheduler import SchedulerOutput
from troupe.errors import RequestFailure
from troupe.messages import EngineCoreOutput, EngineCoreOutputs, LogprobsLists

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore

GRAMMAR_WAIT_S = 0.05  # how long an idle step waits for a grammar being compiled (either mode)

T = TypeVar("T")
Launched = tuple[torch.Tensor, Callable[[], SamplerOutput]]  # the sampler's launch: ids on the device, finish


class DeviceQueue(Protocol):
    def submit(self, fn: Callable[[], T]) -> Future[T]: ...

    def close(self) -> None: ...


class InlineQueue:
    """Runs each launch now (module docstring); its future is already done."""

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)
        return future

    def close(self) -> None:
        pass


class _NoPlaceholderIds(Exception):
    """The previous step's batched sampling failed: its ids never reached the device."""


Source = Callable[[], torch.Tensor]  # gives the previous step's sampled ids (on the device)


@dataclass
class InFlight:
    """A launched step whose sampled ids the host has not read yet."""

    sched: SchedulerOutput
    seqs: list[ScheduledSeq]
    placeholders: tuple[list[int], list[int], Source] | None  # (dst token indices, src rows, their ids)
    forward: Future[torch.Tensor]  # logits: one row per seq that needs logits (and prompt rows)
    sample: Future[Launched] | None = None  # None: nothing to sample (every row failed, or none needs one)
    reqs: list[Request] = field(default_factory=list)  # the sampled rows' requests, in order
    rows: list[SamplingRow] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)  # their rows in the forward's logits
    rewind: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)  # seeded generators' states
    failed: dict[str, RequestFailure] = field(default_factory=dict)  # known before the sampling launch
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    fallback_ids: torch.Tensor | None = None  # the ids sampled on the host after a failed batched sampling

    @property
    def ids(self) -> list[str]:
        return [req.request_id for req in self.reqs]

    def row_of(self) -> dict[str, int]:
        return {req.request_id: i for i, req in enumerate(self.reqs)}


class AsyncStepper:
    """The async-scheduling step of one `EngineCore` (module docstring); the core's `step()` calls `step()`."""

    def __init__(self, core: EngineCore, queue: DeviceQueue) -> None:
        self.core = core
        self.queue = queue
        self.inflight: InFlight | None = None

    def close(self) -> None:
        self.inflight = None
        self.queue.close()

    def step(self) -> EngineCoreOutputs:
        core = self.core
        core._admit_grammar_ready()
        sched = core.scheduler.schedule()
        core._log_preempted(sched)
        prev, launched = self.inflight, None
        if sched.scheduled:
            launched = self._launch_forward(sched, prev)
            core.step_counter += 1
        elif prev is None and core.structured.num_waiting:
            core.structured.wait(GRAMMAR_WAIT_S)  # nothing to run until a grammar is ready
        outputs, finished = self._finish(prev) if prev is not None else ([], [])
        if launched is not None:
            self._launch_sampling(launched)
        self.inflight = launched
        return core._step_outputs(outputs, finished, sched, sum(len(o.new_token_ids) for o in outputs))

    # ------------------------------------------------------------------ launches

    def _launch_forward(self, sched: SchedulerOutput, prev: InFlight | None) -> InFlight:
        core = self.core
        seqs = core.scheduler.to_scheduled_seqs(sched)
        placeholders = self._placeholders(seqs, prev)
        runner = core.runner

        def forward() -> torch.Tensor:
            if placeholders is None:
                return runner.execute(seqs)
            dst, src, source = placeholders
            return runner.execute(seqs, (dst, src, source()))

        return InFlight(sched, seqs, placeholders, self.queue.submit(forward))

    @staticmethod
    def _placeholders(seqs: list[ScheduledSeq], prev: InFlight | None
                      ) -> tuple[list[int], list[int], Source] | None:
        """(dst token indices, src rows of `prev`'s sampled ids, a function giving those ids) or None."""
        if not any(s.placeholder for s in seqs):
            return None
        assert prev is not None, "a placeholder without a step in flight"
        row_of = prev.row_of()
        dst: list[int] = []
        src: list[int] = []
        at = 0
        for s in seqs:
            at += len(s.token_ids)
            if s.placeholder:
                dst.append(at - 1)
                src.append(row_of.get(s.request_id, 0))  # absent: its row failed; the request is finished

        def source() -> torch.Tensor:
            if prev.fallback_ids is not None:
                return prev.fallback_ids
            if prev.sample is None:
                raise _NoPlaceholderIds
            try:
                return prev.sample.result()[0]
            except Exception as exc:
                raise _NoPlaceholderIds from exc

        return dst, src, source

    def _launch_sampling(self, step: InFlight) -> None:
        """Step 4 of the module docstring, for `step` (its forward launched, the previous step applied)."""
        core = self.core
        needing = [s.request for s in step.sched.scheduled if s.needs_logits]  # the logits' rows, in order
        if any(s.prompt_logits for s in step.seqs):  # prompt logprobs read the logits on the host: wait for them
            logits = core._prompt_logprobs(step.seqs, needing, self._forward_result(step), step.failed,
                                           step.prompt_logprobs)
            step.forward = InlineQueue().submit(lambda: logits)
        else:
            core._send_prompt_logprobs(needing, step.prompt_logprobs)
        for row, req in enumerate(needing):
            if req.status == RequestStatus.FINISHED or req.request_id in step.failed:
                continue  # stopped by the previous step's update: its forward row goes unused
            try:
                step.rows.append(core.sampling.row(req))
            except Exception as exc:
                step.failed[req.request_id] = request_failed(req, "building its sampling row", exc)
                continue
            step.reqs.append(req)
            step.keep.append(row)
        if not step.rows:
            return
        step.rewind = [(r.generator, r.generator.get_state()) for r in step.rows if r.generator is not None]
        sampler, keep, rows, full = core.sampler, step.keep, step.rows, len(needing)

        def sample() -> Launched:
            logits = self._forward_result(step)
            return sampler.launch(logits if len(keep) == full else logits[keep], rows)

        step.sample = self.queue.submit(sample)

    def _forward_result(self, step: InFlight) -> torch.Tensor:
        """The forward's logits. One that lacked its placeholders' ids (the previous step's batched sampling
        failed and was redone on the host, which then set `fallback_ids`) runs again with them: it had raised
        before computing anything, and a second run writes the same K/V."""
        try:
            return step.forward.result()
        except _NoPlaceholderIds:
            assert step.placeholders is not None
            dst, src, source = step.placeholders
            return self.core.runner.execute(step.seqs, (dst, src, source()))

    # ------------------------------------------------------------------ results

    def _finish(self, step: InFlight) -> tuple[list[EngineCoreOutput], list[str]]:
        """Step 3 of the module docstring: `step`'s ids and logprobs read, then applied as the synchronous
        step applies them (grammars, the scheduler's update)."""
        core = self.core
        sampled: dict[str, int] = {}
        logprobs: dict[str, LogprobsLists] = {}
        failed = step.failed
        if step.sample is None:
            self._forward_result(step)  # nothing sampled: still, a forward that failed fails the step
        else:
            ids = step.ids
            try:
                out = step.sample.result()[1]()
                rows: dict[str, LogprobsRow] = {rid: lp for rid, lp in zip(ids, out.logprobs, strict=True)
                                                if lp is not None}
                sampled = dict(zip(ids, out.token_ids, strict=True))
            except Exception as exc:  # the batched sampling (or the forward under it: re-raised below)
                sampled, rows = self._one_by_one(step, exc)
            live = core._requests  # a request aborted while its step was in flight is forgotten already
            sampled = {rid: token for rid, token in sampled.items() if rid in live}
            logprobs = {rid: to_lists([row]) for rid, row in rows.items() if rid in live}
        core._advance_grammars(sampled, failed)
        return core.scheduler.update_from_output(step.sched, sampled, failed, logprobs, step.prompt_logprobs)

    def _one_by_one(self, step: InFlight, exc: Exception) -> tuple[dict[str, int], dict[str, LogprobsRow]]:
        """The batched sampling raised (on the device queue): rewind the seeded generators and sample the rows
        one by one on the host, as `RequestSampling.sample` does; the ids also go where the next forward finds them."""
        core = self.core
        logits = self._forward_result(step)  # a forward that failed raises here: the engine's failure
        if len(step.keep) != logits.shape[0]:
            logits = logits[step.keep]
        for generator, state in step.rewind:
            generator.set_state(state)
        sampled, logprobs = core.sampling.one_by_one(logits, step.reqs, step.rows, step.failed, exc)
        step.fallback_ids = torch.tensor([sampled.get(rid, 0) for rid in step.ids], dtype=torch.int64,
                                         device=logits.device)
        return sampled, logprobs

