"""`OutputProcessor`: engine outputs -> the `RequestOutput`s users see (pure, synchronous).

Contract:

- `add_request` registers a request before the engine can produce anything for it.
- `process_outputs(outputs)` takes any list of `EngineCoreOutput`s (a whole step, or a slice of
  one: the async caller feeds slices of <= 128 entries with a checkpoint between them). Per
  entry it detokenizes, checks stop strings, and builds the output the request's
  `output_kind` asks for: CUMULATIVE, everything so far; DELTA, what is new since the previous
  output; FINAL_ONLY, one output at the end. Exactly one output per request has
  `finished=True`, and a finished request's state is dropped at once.
- Requests that finished on a stop string are listed in `reqs_to_abort`: the engine does not
  know about stop strings, so the caller must abort them there.
- Outputs for unknown (finished, aborted, never added) ids are dropped silently.
- Concatenated DELTA texts and token ids equal the final CUMULATIVE text and token ids. Token ids
  are never held back: in DELTA mode the ids of tokens whose text is still withheld (stop-string
  hold-back, partial characters) go out before their text (vLLM's known desync). A stop string
  cuts the text but never the token ids.
- DELTA outputs reuse the engine message's `new_token_ids` list (no copy): nothing downstream
  mutates lists in place (`RequestOutput.add` builds new ones).
- n > 1 (troupe.output.parallel): a parent (`add_parent`) and its n children (`add_request(...,
  parent=, index=)`), each child an ordinary request in the engine; their outputs come out under
  the parent's id as the parent makes them (per child with its index while streaming, one output of
  all n for FINAL_ONLY, `finished` once all are done); a parent's id in `abort_requests` /
  `engine_ids` stands for its children.
- The processor is the one owner of the frontend's per-request state (as vLLM's keeps the
  collector in the request state): a request added with a `queue` (an `OutputSink`, e.g. the
  consumer's stream) gets each of its outputs put there, its abort's final output too, and on
  `fail_all` the error; the returned outputs are the same objects, for the caller to read (log)
  at once, not to keep. Without a queue (offline use, tests) the returned outputs are all there is.
- Logprobs (when asked) are kept and sliced by `troupe.output.logprobs.LogprobsState`, aligned with
  the token ids (`RequestState.make_output` puts them on each output).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import msgspec

from troupe.errors import InvalidInputError
from troupe.messages import AddRequest, EngineCoreOutput, FinishReason
from troupe.output.collector import OutputSink
from troupe.output.detokenizer import make_detokenizer
from troupe.output.logprobs import TokenTexts, make_logprobs_state
from troupe.output.parallel import ParentRequest, child_id
from troupe.output.state import RequestState
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams

_DELTA = RequestOutputKind.DELTA
_STOP = FinishReason.STOP


class ProcessedOutputs(NamedTuple):
    """What one `process_outputs` call produced."""

    request_outputs: dict[str, RequestOutput]  # internal id -> output to deliver
    reqs_to_abort: list[str]  # internal ids that finished on a stop string, or failed here
    failed: dict[str, tuple[str, Exception]] = {}  # internal id -> (user's id, what raised processing its output)
    release: list[str] = []  # n > 1: parents whose held children may go to the engine now (`take_held`)


class OutputProcessor:
    """Per-request detokenizers and output state, fed by engine outputs (see module docstring).

    `tokenizer` is an HF tokenizer or a `tokenizers.Tokenizer`; None means no text (token ids
    only), which rejects requests with stop strings.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._by_external: dict[str, list[str]] = {}
        self._parents: dict[str, ParentRequest] = {}  # n > 1, by the parent's internal id
        self._token_texts: dict[int, TokenTexts] = {}  # decode([id]) caches for logprobs, per tokenizer

    # ------------------------------------------------------------ bookkeeping

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def request_ids(self) -> Iterator[str]:
        """Internal ids of the live requests (a snapshot)."""
        return iter(list(self._states))

    def internal_ids(self, external_id: str) -> list[str]:
        """Internal ids of the live requests the user submitted under `external_id` (n > 1: the
        children's)."""
        return list(self._by_external.get(external_id, ()))

    def add_parent(self, request_id: str, external_id: str, n: int, output_kind: RequestOutputKind,
                   queue: OutputSink | None = None, arrival_time: float | None = None) -> ParentRequest:
        """Register an n > 1 request; its children are then added with `add_request(..., parent=)`."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already live")
        parent = ParentRequest(request_id, external_id, n, output_kind, queue,
                               time.monotonic() if arrival_time is None else arrival_time)
        self._parents[request_id] = parent
        return parent

    def discard_parent(self, parent_id: str) -> None:
        """Forget a parent whose registration failed half-way: its children's states go, nothing is
        delivered."""
        parent = self._parents.pop(parent_id, None)
        if parent is not None:
            for cid in (child_id(i, parent_id) for i in range(parent.n)):
                if cid in self._states:
                    self._free(self._states[cid], time.monotonic())

    def take_held(self, parent_id: str) -> list[AddRequest]:
        """The held children of `parent_id` that are still live, pinned to the engine of child 0
        (unless the user pinned a rank); they count as sent from now on."""
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        held, parent.held = parent.held, []
        rank = parent.engine_index
        return [req if rank is None or req.data_parallel_rank is not None
                else msgspec.structs.replace(req, data_parallel_rank=rank)
                for req in held if req.request_id in self._states]

    def add_request(
        self,
        request_id: str,
        external_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        queue: OutputSink | None = None,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Register a request under its internal id (its outputs go to `queue` too, if given; a
        child of an n > 1 request: to its parent's queue, through `parent`, as sample `index`);
        raises ValueError for a live duplicate id."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already live")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidInputError("stop", "stop strings need a tokenizer (this engine has none)")
        detok = make_detokenizer(self.tokenizer, prompt_token_ids, params, request_id)
        self._states[request_id] = RequestState(
            request_id,
            external_id,
            prompt,
            prompt_token_ids,
            params.output_kind,
            detok,
            time.monotonic() if arrival_time is None else arrival_time,
            queue if parent is None else parent.queue,
            index,
            parent,
            make_logprobs_state(self.tokenizer, params, self._token_texts),
        )
        self._by_external.setdefault(external_id, []).append(request_id)

    def _free(self, state: RequestState, now: float) -> None:
        del self._states[state.request_id]
        ids = self._by_external[state.external_id]
        ids.remove(state.request_id)
        if not ids:
            del self._by_external[state.external_id]
        state.metrics.finished_time = now

    def _through_parent(self, state: RequestState, out: RequestOutput | None, finished: bool,
                        now: float) -> tuple[str, RequestOutput | None]:
        """(delivery key, output): a plain request's own; a child's as its parent makes it
        (troupe.output.parallel), under the parent's id; a finished parent is forgotten."""
        parent = state.parent
        if parent is None:
            return state.request_id, out
        out = parent.child_output(state.index, out, finished, state.metrics, now)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
        return parent.request_id, out


    # ------------------------------------------------------------ the hot loop

    def process_outputs(
        self, outputs: Sequence[EngineCoreOutput], now: float | None = None, engine_index: int | None = None
    ) -> ProcessedOutputs:
        """Turn engine outputs into user outputs.

        1. look up the request (unknown ids are skipped);
        2. record timing, prefix-cache hits and the engine (`engine_index`, the engine that sent
           `outputs`);
        3. detokenize and check stop strings; a match finishes the request with "stop" and the
           string as `stop_reason`, and lists it in `reqs_to_abort` unless the engine finished it;
        4. build the output for its output kind; an id seen twice in `outputs` gets one merged
           output;
        5. drop the state of finished requests;
        6. put each output in its request's queue, if it has one.

        An exception in steps 3-4 belongs to that request alone: it finishes with finish_reason
        "error" and the error text (`RequestOutput.error`), is listed in `failed` and, unless the
        engine already finished it, in `reqs_to_abort`; the other entries are processed as usual.
        """
        if now is None:
            now = time.monotonic()
        states = self._states
        request_outputs: dict[str, RequestOutput] = {}
        reqs_to_abort: list[str] = []
        failed: dict[str, tuple[str, Exception]] = {}
        queues: dict[str, OutputSink] = {}
        release: list[str] = []
        for eco in outputs:
            state = states.get(eco.request_id)
            if state is None:
                continue
            new_ids = eco.new_token_ids
            state.record(eco, now, engine_index)
            finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            try:  # this request's own failure (detokenizer, stop strings, logprobs) fails it alone
                if state.logprobs is not None:
                    state.logprobs.update(eco)
                stop_string = state.detokenizer.update(new_ids, finish_reason is _STOP, finish_reason is not None)
                if stop_string is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(eco.request_id)
                    finish_reason, stop_reason = _STOP, stop_string
                out = state.make_output(new_ids, finish_reason, stop_reason, eco.error, eco.error_kind)
                if eco.pooled is not None and out is not None:
                    out.pooled = eco.pooled
            except Exception as exc:
                if finish_reason is None:
                    reqs_to_abort.append(eco.request_id)
                finish_reason = FinishReason.ERROR
                out = state.make_error_output(f"output processing failed: {type(exc).__name__}: {exc}")
                failed[eco.request_id] = (state.external_id, exc)
                if state.parent is None:
                    request_outputs.pop(eco.request_id, None)  # an earlier entry's output in this list is void
            finished = finish_reason is not None
            if finished:
                if state.metrics.engine_index is None:
                    state.metrics.engine_index = engine_index
                self._free(state, now)
            parent = state.parent
            if parent is not None and parent.held and not parent.released:
                parent.released, parent.engine_index = True, engine_index  # child 0's prompt is computed
                release.append(parent.request_id)
            key, out = self._through_parent(state, out, finished, now)
            if out is not None:
                if state.queue is not None:
                    queues[key] = state.queue
                pending = request_outputs.setdefault(key, out)
                if pending is not out:  # the same request twice in one list
                    pending.add(out, aggregate=state.output_kind is _DELTA)
        for key, queue in queues.items():
            queue.put(request_outputs[key])
        return ProcessedOutputs(request_outputs, reqs_to_abort, failed, release)

    # ------------------------------------------------------------ aborts

    def abort_requests(
        self, request_ids: Iterable[str], *, internal: bool = True
    ) -> dict[str, RequestOutput]:
        """Finish live requests with finish_reason "abort"; returns each one's final output.

        The final output follows the request's kind: CUMULATIVE and FINAL_ONLY carry all text and
        ids so far (held-back text included), DELTA carries only what was not sent yet. With
        `internal=False` the ids are users' external ids (every live request under each). A parent's
        id (n > 1) aborts all its children. Unknown ids are ignored. Each final output goes to the
        request's queue too. Returns delivery key (the internal id; a parent's for its children) ->
        final output.
        """
        ids = list(request_ids)
        if not internal:
            ids = [rid for ext in ids for rid in self._by_external.get(ext, ())]
        now = time.monotonic()
        finals: dict[str, RequestOutput] = {}
        queues: dict[str, OutputSink] = {}
        for rid in self.engine_ids(ids):
            state = self._states[rid]
            self._free(state, now)
            state.detokenizer.catch_up()
            key, out = self._through_parent(state, state.make_output([], FinishReason.ABORT, None), True, now)
            if out is None:
                continue
            if state.queue is not None:
                queues[key] = state.queue
            pending = finals.setdefault(key, out)
            if pending is not out:
                pending.add(out, aggregate=state.output_kind is _DELTA)
        for key, queue in queues.items():
            queue.put(finals[key])
        return finals

    def engine_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The live internal ids among `request_ids`, each parent id (n > 1) replaced by its live
        children's: what the engine knows."""
        out: list[str] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is not None:
                out.extend(c for c in (child_id(i, rid) for i in range(parent.n)) if c in self._states)
            elif rid in self._states:
                out.append(rid)
        return out

    def fail_all(self, exc: BaseException) -> dict[str, RequestOutput]:
        """The engine is gone: every live request ends, its queue gets `exc`. Returns each one's
        final output as an abort would build it (what it had got so far, for its log line), by
        delivery key."""
        now = time.monotonic()
        finals: dict[str, RequestOutput] = {}
        for state in list(self._states.values()):
            self._free(state, now)
            if state.queue is not None:
                state.queue.put_error(exc)
            state.detokenizer.catch_up()
            key, out = self._through_parent(state, state.make_output([], FinishReason.ABORT, None), True, now)
            if out is not None:
                finals[key] = out
        self._parents.clear()
        return finals
