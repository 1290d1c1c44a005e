"""`RequestTable`: the frontend's book of live requests, shared by the actors of one graph.

The per-request state has one owner, the pure `OutputProcessor` (detokenization, stop strings,
output kinds, the user-id map), which also holds each request's `RequestStream` (its consumer's
hand-off) and puts every output, abort and failure there. The table adds the graph's own: the
engine's death, pending utility calls and the canonical log lines. Engine statistics live apart
(troupe.actors.engine_stats). All of it is touched from the graph's event loop only, so no locks: the
input processor registers a request *before* sending it to the engine, which orders registration
before any output for it.

Logs: the canonical line, "request finished", once per request however it ends (finished, stopped,
aborted, errored, engine dead): see `log_finished`. At trace level, the hops "output ready" (the
output handler put an output in the request's stream) and "output taken" (the consumer got it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

import anyio
import structlog

from troupe.actors.reply import Reply
from troupe.errors import EngineDeadError
from troupe.log import trace, trace_enabled
from troupe.messages import AddRequest, EngineCoreOutput, UtilityResult
from troupe.output.collector import RequestOutputCollector
from troupe.output.parallel import fan_out
from troupe.output.processor import OutputProcessor
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind

log = structlog.get_logger("troupe.requests")


def log_finished(out: RequestOutput, internal_id: str, *, finish_reason: str | None = None,
                 **extra: Any) -> None:
    """The canonical line of a request that ended, from its final output.

    Fields: `request_id` (the user's id), `internal_id`, `finish_reason`, `prompt_tokens`,
    `output_tokens`, `cached_tokens` (prompt tokens served by the prefix cache), `ttft_s` (arrival
    in the frontend to first token; None if none came), `total_s` (arrival to finish),
    `output_tokens_per_s` (output tokens / total_s), `engine` (None if no engine answered) and
    `preemptions`; plus `extra` (e.g. `error`)."""
    m = out.metrics
    completion = out.outputs[0] if out.outputs else None
    if finish_reason is None:
        finish_reason = completion.finish_reason if completion is not None else None
    ttft = total = None
    output_tokens = preemptions = 0
    engine = None
    if m is not None:
        output_tokens, preemptions, engine = m.num_generation_tokens, m.num_preemptions, m.engine_index
        ttft, total = m.time_to_first_token, m.total_time
    log.info("request finished", request_id=out.request_id, internal_id=internal_id, finish_reason=finish_reason,
             prompt_tokens=len(out.prompt_token_ids or ()), output_tokens=output_tokens,
             cached_tokens=out.num_cached_tokens,
             ttft_s=None if ttft is None else round(ttft, 4), total_s=None if total is None else round(total, 4),
             output_tokens_per_s=round(output_tokens / total, 1) if total else None,
             engine=engine, preemptions=preemptions, **extra)


class RequestStream:
    """One request's outputs for its consumer: a pure collector plus a wake-up event."""

    def __init__(self, request_id: str, external_id: str, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.external_id = external_id
        self._collector = RequestOutputCollector(output_kind)
        self._ready = anyio.Event()
        self._put_at = 0.0  # trace only: when the oldest pending output was put

    def put(self, output: RequestOutput) -> None:
        if trace_enabled():
            trace(log, "output ready", request_id=self.external_id, internal_id=self.request_id,
                  tokens=sum(len(c.token_ids) for c in output.outputs), finished=output.finished,
                  pending=self._collector.ready)
            if not self._collector.ready:
                self._put_at = time.monotonic()
        self._collector.put(output)
        self._ready.set()

    def put_error(self, exc: BaseException) -> None:
        self._collector.put_error(exc)
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        return self._collector.get_nowait()

    async def get(self) -> RequestOutput:
        """The next output (merged with any it was behind on), or the request's error raised."""
        while True:
            out = self._collector.get_nowait()
            if out is not None:
                if trace_enabled():
                    trace(log, "output taken", actor="collector", request_id=self.external_id,
                          internal_id=self.request_id, tokens=sum(len(c.token_ids) for c in out.outputs),
                          finished=out.finished, waited_s=round(time.monotonic() - self._put_at, 5))
                return out
            await self._ready.wait()
            self._ready = anyio.Event()


class RequestTable:
    """The live requests of one graph. Their state has one owner, the `OutputProcessor` (each
    request's detokenizer, output state and `RequestStream`, under its internal id, with the
    user-id map); the table adds what belongs to the graph: the engine's death (`dead_error`), the
    pending utility calls, the canonical log line of each request, and since when requests wait
    (`busy_since`, for the hang watch). It exists from the graph's start; the tokenizer comes when
    the engines are ready (`set_tokenizer`)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.dead_error: EngineDeadError | None = None
        self.busy_since = time.monotonic()  # when the first of the live requests came (after idleness)
        self._calls: dict[int, Reply[UtilityResult]] = {}
        self._call_ids = itertools.count()

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.processor.tokenizer = tokenizer

    # ------------------------------------------------------------ request lifecycle

    def register(self, req: AddRequest, prompt_text: str | None, *,
                 share_prefill_tokens: int | None = None) -> tuple[RequestStream, list[AddRequest]]:
        """Register a request; returns its stream and what to send to the engine now. With n > 1 the
        request is a parent of n children (troupe.output.parallel): one stream, and the children to
        send; when the prompt has at least `share_prefill_tokens` tokens (a KV block; None: no
        prefix cache), only child 0 goes now and the others wait for its prefill (`take_held`)."""
        if self.dead_error is not None:
            raise self.dead_error
        if not self.processor.has_unfinished_requests():  # work after idleness: the engine's clock starts now
            self.busy_since = time.monotonic()
        stream = RequestStream(req.request_id, req.external_id, req.params.output_kind)
        if req.params.n == 1:
            self.processor.add_request(req.request_id, req.external_id, prompt_text, req.prompt_token_ids,
                                       req.params, queue=stream)
            return stream, [req]
        children = fan_out(req)
        parent = self.processor.add_parent(req.request_id, req.external_id, req.params.n, req.params.output_kind,
                                           queue=stream)
        try:
            for i, child in enumerate(children):
                self.processor.add_request(child.request_id, child.external_id, prompt_text, child.prompt_token_ids,
                                           child.params, parent=parent, index=i)
        except BaseException:
            self.processor.discard_parent(req.request_id)
            raise
        if share_prefill_tokens is not None and len(req.prompt_token_ids) >= share_prefill_tokens:
            parent.held = children[1:]
            return stream, children[:1]
        return stream, children

    def take_held(self, parent_id: str) -> list[AddRequest]:
        """n > 1: the children held back for the parent's shared prefill that are still live."""
        return self.processor.take_held(parent_id)

    def process_slice(self, outputs: list[EngineCoreOutput],
                      engine_index: int | None = None) -> tuple[list[str], list[str]]:
        """Deliver one slice of the outputs of engine `engine_index` (the processor puts each in its
        request's stream); returns (ids the engine must abort: stop strings, and requests whose
        output processing failed; n > 1 parents whose held children may go now: `take_held`). Logs
        the canonical line of each request that finished, with `error=` for one that failed (in the
        engine or here)."""
        processed = self.processor.process_outputs(outputs, engine_index=engine_index)
        for rid, (external_id, exc) in processed.failed.items():
            log.error("request failed", request_id=external_id, internal_id=rid,
                      error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        for rid, out in processed.request_outputs.items():
            if out.finished:
                if out.error is not None:
                    log_finished(out, rid, error=out.error)
                else:
                    log_finished(out, rid)
        return list(processed.reqs_to_abort), processed.release

    def internal_ids(self, request_ids: str | Iterable[str]) -> list[str]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return [internal for ext in ids for internal in self.processor.internal_ids(ext)]

    def live_ids(self) -> list[str]:
        return list(self.processor.request_ids())

    def abort(self, internal_ids: Iterable[str]) -> list[str]:
        """Finish these requests with finish_reason 'abort' (a parent's id: all its children);
        returns the live ones the engine knows (children for a parent)."""
        live = self.processor.engine_ids(internal_ids)
        finals = self.processor.abort_requests(live)
        extra = {} if "actor" in structlog.contextvars.get_contextvars() else {"actor": "frontend"}
        for rid, final in finals.items():
            log_finished(final, rid, **extra)
        return live

    def fail_all(self, reason: str, cause: BaseException | None = None) -> EngineDeadError:
        """The engine is gone: every live and every future request gets `EngineDeadError`."""
        if self.dead_error is None:
            err = EngineDeadError(f"EngineCore died: {reason}")
            err.__cause__ = cause
            self.dead_error = err
        for rid, final in self.processor.fail_all(self.dead_error).items():
            log_finished(final, rid, finish_reason="error", error=str(self.dead_error))
        for reply in self._calls.values():
            reply.fail(self.dead_error)
        return self.dead_error

    @property
    def num_unfinished(self) -> int:
        return self.processor.num_unfinished_requests

    # ------------------------------------------------------------ utility calls

    def new_call(self) -> tuple[int, Reply[UtilityResult]]:
        """A utility call's id and its reply (failed with `EngineDeadError` if the engine dies first);
        `end_call` forgets it."""
        call_id = next(self._call_ids)
        reply = Reply[UtilityResult]()
        if self.dead_error is not None:
            reply.fail(self.dead_error)
        self._calls[call_id] = reply
        return call_id, reply

    def end_call(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    def resolve_utility(self, result: UtilityResult) -> None:
        reply = self._calls.get(result.call_id)
        if reply is not None:
            reply.send(result)
