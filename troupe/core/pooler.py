"""`Pooler`: the engine's pooling of final hidden states, chunk by chunk (pure, no I/O).

Contract, per step of a pooling engine (`EngineCore` with `runner="pooling"`):
1. `rows(seqs)` lists the token indices of the step whose final hidden states the pooler needs
   (MEAN: every token; LAST: the last token of a chunk that ends the prompt; CLS: the token at
   position 0), in increasing order: the model runner returns those rows alone, (R, hidden).
2. `update(seqs, hidden, requests)` folds each seq's rows into its request's running state (kept on the
   request: `Request.pooling_state`) and returns the
   pooled vector of every request whose chunk ended its prompt (`needs_logits`), by request id:
   float32 (hidden,) on the hidden states' device, before `dimensions` / normalization.
3. `finish(vector, params)` applies `dimensions` and normalization and returns a list of floats.

A chunk at position 0 starts the request's state afresh, so a request preempted mid-prefill (and
recomputed from 0) pools only its last computation; the state goes with the request when it finishes
or is aborted. MEAN sums in float32 and divides by the prompt length at the end, so a
chunked prefill gives the mean of all chunks' tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from troupe.core.batch import ScheduledSeq
from troupe.core.request import Request
from troupe.pooling import PoolerConfig, PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

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

    def update(self, seqs: list[ScheduledSeq], hidden: torch.Tensor,
               requests: Mapping[str, Request]) -> dict[str, torch.Tensor]:
        """Fold this step's rows (`hidden` (R, hidden), R = len(rows(seqs))) into each request's state
        (MEAN: the float32 running sum; CLS: the position-0 row); the pooled (hidden,) float32 vector of
        each request whose prompt is now complete."""
        kind = self.config.pooling_type
        done: dict[str, torch.Tensor] = {}
        at = 0
        for s in seqs:
            rid = s.request_id
            req = requests[rid]
            if kind == "MEAN":
                n = len(s.token_ids)
                part = hidden[at:at + n].float().sum(dim=0)  # (hidden,)
                at += n
                state = req.pooling_state
                req.pooling_state = part if s.start_pos == 0 or state is None else state + part
                if s.needs_logits:
                    done[rid], req.pooling_state = req.pooling_state / (s.start_pos + n), None
            elif kind == "CLS":
                if s.start_pos == 0:
                    req.pooling_state = hidden[at].float()
                    at += 1
                if s.needs_logits:
                    assert req.pooling_state is not None, f"{rid}: no position-0 row"
                    done[rid], req.pooling_state = req.pooling_state, None
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
