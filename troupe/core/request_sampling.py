"""`RequestSampling`: one token per request from a step's logits, with per-request fault isolation.

The engine's sampling around the batched `Sampler` (troupe.core.sampler): each request's `SamplingRow`
(`row`: kept on the request while nothing in it changes step to step), the batched call, and, when that
raises, the rows again one by one so that only a request whose own row raises fails (`one_by_one`).
`request_failed` is how every per-request failure of the engine is logged and reported. Used by both the
synchronous step (`EngineCore._sample`) and async scheduling (troupe.core.overlap, which launches the
batched call itself and falls back to `one_by_one`).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
import torch

from troupe.core.request import Request
from troupe.core.sampler import LogprobsRow, TokenSampler
from troupe.core.sampling_metadata import SamplingRow
from troupe.errors import RequestFailure, error_kind
from troupe.structured.backend import bitmask_width

log = structlog.get_logger("troupe.engine")


def request_failed(req: Request, stage: str, exc: Exception) -> RequestFailure:
    """Log one request's own failure (with its traceback) and return what its caller gets: the text
    and whose fault it was (`error_kind`: the request's own conflicting parameters, or internal)."""
    error = f"{stage} failed: {type(exc).__name__}: {exc}"
    kind = error_kind(exc)
    if kind == "internal":
        log.error("request failed", request_id=req.external_id, internal_id=req.request_id, error=error,
                  exc_info=exc)
    else:  # the client's to fix: no traceback
        log.warning("request failed", request_id=req.external_id, internal_id=req.request_id, error=error,
                    error_kind=kind)
    return RequestFailure(error, kind)


class RequestSampling:
    def __init__(self, sampler: TokenSampler, vocab_size: int) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, reqs: list[Request]
               ) -> tuple[dict[str, int], dict[str, RequestFailure], dict[str, LogprobsRow]]:
        """One token per request of `reqs` (row i of `logits` (S, V) is `reqs[i]`'s), the requests
        that failed, and the logprobs rows of those that asked: `(sampled, failed, logprobs)`, by id.

        Per-request fault isolation: an exception while building one request's sampling row fails
        that request alone; if the batched sampler raises, its rows are sampled again one by one
        (the seeded generators first rewound to where they were) and only the rows that raise on
        their own fail. Nothing here raises: what cannot be pinned on a request (the forward
        itself) has failed before this is called."""
        failed: dict[str, RequestFailure] = {}
        rows: list[SamplingRow] = []
        kept: list[int] = []
        for i, req in enumerate(reqs):
            try:
                rows.append(self.row(req))
                kept.append(i)
            except Exception as exc:
                failed[req.request_id] = request_failed(req, "building its sampling row", exc)
        if not rows:
            return {}, failed, {}
        if len(kept) < len(reqs):
            logits = logits[kept]  # (K, V)
        sampled_reqs = [reqs[i] for i in kept]
        ids = [req.request_id for req in sampled_reqs]
        rewind = [(row.generator, row.generator.get_state()) for row in rows if row.generator is not None]
        try:
            out = self.sampler.sample(logits, rows)
            lps = {rid: lp for rid, lp in zip(ids, out.logprobs, strict=True) if lp is not None}
            return dict(zip(ids, out.token_ids, strict=True)), failed, lps
        except Exception as exc:
            error = exc
        for generator, state in rewind:
            generator.set_state(state)
        sampled, logprobs = self.one_by_one(logits, sampled_reqs, rows, failed, error)
        return sampled, failed, logprobs

    def one_by_one(self, logits: torch.Tensor, reqs: Sequence[Request], rows: list[SamplingRow],
                   failed: dict[str, RequestFailure], error: Exception
                   ) -> tuple[dict[str, int], dict[str, LogprobsRow]]:
        """After the batched sampler raised `error` (the seeded generators rewound): each row alone (row i of
        `logits` is `reqs[i]`'s); a row that raises on its own fails its request (into `failed`)."""
        log.warning("batched sampling failed: sampling its rows one by one", rows=len(rows),
                    error=f"{type(error).__name__}: {error}")
        sampled: dict[str, int] = {}
        logprobs: dict[str, LogprobsRow] = {}
        for i, (req, row) in enumerate(zip(reqs, rows, strict=True)):
            rid = req.request_id
            try:
                one = self.sampler.sample(logits[i:i + 1], [row])
            except Exception as exc:
                failed[rid] = request_failed(req, "sampling", exc)
                continue
            sampled[rid] = one.token_ids[0]
            if one.logprobs[0] is not None:
                logprobs[rid] = one.logprobs[0]
        return sampled, logprobs

    def row(self, req: Request) -> SamplingRow:
        """The request's row for this step. A row without a per-step part (no grammar bitmask, no `min_tokens`
        suppression) is built once and kept on the request: it holds the request's token lists themselves,
        which grow in place."""
        if req.sampling_row is not None:
            return req.sampling_row
        suppressed: frozenset[int] = frozenset()
        if req.num_output_tokens < req.params.min_tokens:
            suppressed = req.eos_token_ids | req.stop_token_ids
        bitmask = None
        matcher = req.matcher
        if matcher is not None:
            bitmask = torch.empty(1, bitmask_width(self.vocab_size), dtype=torch.int32)  # (1, ceil(V/32))
            matcher.fill(bitmask, 0)
            bitmask = bitmask[0]
        row = SamplingRow(req.params, req.generator, suppressed, req.request_id,
                          req.output_token_ids, req.prompt_token_ids, req.bad_words_token_ids, bitmask)
        if not suppressed and matcher is None:
            req.sampling_row = row
        return row
