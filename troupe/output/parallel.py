"""n > 1: one user request fanned out into n children, and their outputs gathered back (vLLM's
`ParentRequest`, pure and synchronous like the rest of troupe.output).

- `fan_out(req)` makes the children of a parent `AddRequest`: ids `<i>_<parent id>`, params copied
  with `n=1` and, when the parent has a seed, `seed + i` (vLLM's rule). Each child is an ordinary
  request in the engine.
- A `ParentRequest` holds what the children share on the frontend: the user's id, the consumer's
  queue, the output kind, the metrics of the whole request, and the children not yet sent to the
  engine (`held`: see below).
- `ParentRequest.child_output(index, out, finished, metrics, now)` turns one child's output into
  what the consumer sees: DELTA / CUMULATIVE pass each child's update on at once, carrying its
  `CompletionOutput.index`, with `finished=True` only on the output that finishes the last child
  (that output carries the whole request's metrics and, if a child failed, its error); FINAL_ONLY
  gathers every child's final completion and gives one output with all n, sorted by index, once the
  last child is done. A finished child is never reported again.

Shared prefill: the children have the same prompt. When the prompt fills at least one KV block, the
frontend sends child 0 alone and holds the others until child 0's first output shows its prompt was
computed (its full blocks are then in the engine's prefix cache); the others are sent then, to the
same engine, and find the prompt's full blocks there. A prompt shorter than a block has nothing to
share: all children go at once.
"""

from __future__ import annotations

import msgspec

from troupe.errors import ErrorKind
from troupe.messages import AddRequest
from troupe.output.collector import OutputSink
from troupe.outputs import CompletionOutput, RequestMetrics, RequestOutput
from troupe.sampling_params import RequestOutputKind

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def child_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def fan_out(req: AddRequest) -> list[AddRequest]:
    """The n children of `req` (n = `req.params.n` > 1)."""
    params = req.params
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        child_params = msgspec.structs.replace(params, n=1, seed=seed)  # verified again (a seed past 2**63 - 1 raises)
        children.append(msgspec.structs.replace(req, request_id=child_id(i, req.request_id), params=child_params))
    return children


class ParentRequest:
    """The frontend's state of one fanned-out request (see the module docstring)."""

    __slots__ = ("request_id", "external_id", "n", "output_kind", "queue", "metrics", "held", "released",
                 "engine_index", "_done", "_finals", "_error", "_error_kind", "_cached")

    def __init__(self, request_id: str, external_id: str, n: int, output_kind: RequestOutputKind,
                 queue: OutputSink | None, arrival_time: float) -> None:
        self.request_id = request_id
        self.external_id = external_id
        self.n = n
        self.output_kind = output_kind
        self.queue = queue
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.held: list[AddRequest] = []  # children waiting for child 0's prefill
        self.released = False  # the held children were asked for (child 0 has output)
        self.engine_index: int | None = None  # where child 0 runs: the held children go there too
        self._done: set[int] = set()
        self._finals: dict[int, CompletionOutput] = {}
        self._error: str | None = None
        self._error_kind: ErrorKind | None = None
        self._cached = 0

    @property
    def finished(self) -> bool:
        return len(self._done) == self.n

    def child_output(self, index: int, out: RequestOutput | None, finished: bool, metrics: RequestMetrics,
                     now: float) -> RequestOutput | None:
        """What the consumer sees of child `index`'s output `out` (None: nothing new from it);
        `finished`: the child is done, with `metrics` its own."""
        if out is not None:
            self._cached = max(self._cached, out.num_cached_tokens)
        if finished and index not in self._done:
            self._done.add(index)
            self._fold(metrics)
            if out is not None and out.error is not None and self._error is None:
                self._error, self._error_kind = f"sample {index}: {out.error}", out.error_kind
            if out is not None and self.output_kind is _FINAL_ONLY:
                self._finals[index] = out.outputs[0]
        all_done = self.finished
        if all_done:
            self.metrics.finished_time = now
        if self.output_kind is _FINAL_ONLY:
            if not all_done:
                return None
            completions = [self._finals[i] for i in sorted(self._finals)]
            return RequestOutput(self.external_id, out.prompt if out else None, out.prompt_token_ids if out else None,
                                 completions, True, num_cached_tokens=self._cached, metrics=self.metrics,
                                 error=self._error, error_kind=self._error_kind)
        if out is None:
            return None
        out.finished = all_done
        out.num_cached_tokens = self._cached
        out.metrics = self.metrics if all_done else None
        out.error = self._error if all_done else None
        out.error_kind = self._error_kind if all_done else None
        return out

    def _fold(self, child: RequestMetrics) -> None:
        m = self.metrics
        m.num_generation_tokens += child.num_generation_tokens
        m.num_preemptions += child.num_preemptions
        if child.first_token_time is not None and (m.first_token_time is None
                                                   or child.first_token_time < m.first_token_time):
            m.first_token_time = child.first_token_time
        if child.last_token_time is not None and (m.last_token_time is None
                                                  or child.last_token_time > m.last_token_time):
            m.last_token_time = child.last_token_time
        if m.engine_index is None:
            m.engine_index = child.engine_index
