"""`Pooler`: the engine's pooling of final hidden states, chunk by chunk (pure, no I/O).

Contract, per step of a pooling engine (`EngineCore` with `runner="pooling"`):
1. `rows(seqs)` lists the token indices of the step whose final hidden states the pooler needs
   (MEAN: every token; LAST: the last token of a chunk that ends the prompt; CLS: the token at
   position 0), in increasing order: the model runner returns those rows alone, (R, hidden).
2. `update(seqs, hidden)` folds each seq's rows into its request's running state and returns the
   pooled vector of every request whose chunk ended its prompt (`needs_logits`), by request id:
   float32 (hidden,) on the hidden states' device, before `dimensions` / normalization.
3. `finish(vector, params)` applies `dimensions` and normalization and returns a list of floats.

A chunk at position 0 starts the request's state afresh, so a request preempted mid-prefill (and
recomputed from 0) pools only its last computation. `forget(request_id)` drops a request's state
(finished or aborted). MEAN sums in float32 and divides by the prompt length at the end, so a
chunked prefill gives the mean of all chunks' tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from troupe.core.batch import ScheduledSeq
from troupe.pooling import PoolerConfig, PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._sums: dict[str, torch.Tensor] = {}  # MEAN: request id -> (hidden,) float32 running sum
        self._first: dict[str, torch.Tensor] = {}  # CLS: request id -> (hidden,) the position-0 row

    def rows(self, seqs: list[ScheduledSeq]) -> list[int]:
        """Token indices of the step (increasing) whose hidden states `update` needs."""
        kind = self.config.pooling_type
        rows: list[int] = []
        start = 0
        for s in seqs:
            n = len(s.token_ids)
            if kind == "MEAN":
                rows.extend(range(start, start + n))
            elif kind == "CLS":
                if s.start_pos == 0:
                    rows.append(start)
            elif s.needs_logits:
                rows.append(start + n - 1)
            start += n
        return rows

    def update(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fold this step's rows (`hidden` (R, hidden), R = len(rows(seqs))) into each request's state;
        the pooled (hidden,) float32 vector of each request whose prompt is now complete."""
        kind = self.config.pooling_type
        done: dict[str, torch.Tensor] = {}
        at = 0
        for s in seqs:
            rid = s.request_id
            if kind == "MEAN":
                n = len(s.token_ids)
                part = hidden[at:at + n].float().sum(dim=0)  # (hidden,)
                at += n
                self._sums[rid] = part if s.start_pos == 0 else self._sums[rid] + part
                if s.needs_logits:
                    done[rid] = self._sums.pop(rid) / (s.start_pos + n)
            elif kind == "CLS":
                if s.start_pos == 0:
                    self._first[rid] = hidden[at].float()
                    at += 1
                if s.needs_logits:
                    done[rid] = self._first.pop(rid)
            elif s.needs_logits:
                done[rid] = hidden[at].float()
                at += 1
        assert at == hidden.shape[0], f"{hidden.shape[0]} rows for {at} wanted"
        return done

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> list[float]:
        """`dimensions` first (Matryoshka), then L2 normalization when the request or the model asks."""
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, p=2.0, dim=-1)
        out: list[float] = vector.cpu().tolist()
        return out

    def forget(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
        self._first.pop(request_id, None)
