"""`Sampler`: turns one step's logits into one token per request.

Order of operations (vLLM's, `shared/reference/vllm-semantics.md` §2.10), per row:
1. logits to float32; `min_tokens` masks the request's EOS and stop tokens until reached;
2. greedy rows (temperature 0): argmax, nothing else;
3. random rows: divide by temperature, min-p, then top-k and top-p on the sorted row, then an
   inverse-CDF draw (the same distribution as vLLM's exponential race, far cheaper on CPU).

Seeds: a request with a seed owns a `torch.Generator` and draws exactly one number per sampled
token from it, so its tokens do not depend on what else is in the batch. Unseeded rows
share the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from troupe.sampling_params import SamplingParams

_TOP_P_SLICE = 1024


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about the request behind one logits row."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    suppressed: frozenset[int] = frozenset()  # token ids masked this step (min_tokens)
    request_id: str = ""  # the engine's id of the request (errors, the test-only fault hook)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """`logits` (S, V), one row per entry of `rows`; returns S token ids.

        `logits` is never written to (it may be an inference tensor of the model runner, and the
        engine samples rows again one by one from it when a batch fails): every row is copied out
        by the indexing below before it is masked or filtered in place."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()  # (S, V); the same tensor when it already is float32
        vocab = logits.shape[1]
        out = [0] * len(rows)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            picked = self._masked(logits, greedy, rows).argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked, strict=True):
                out[i] = t
        rand = [i for i, row in enumerate(rows) if not row.params.greedy]
        if rand:
            probs = self._probs([rows[i].params for i in rand], self._masked(logits, rand, rows), vocab)  # (R, V)
            # Inverse-CDF draw: one uniform number per row, from the request's own generator when
            # it has a seed (so its tokens do not depend on the batch), else the shared one.
            cdf = probs.cumsum(dim=-1)  # (R, V)
            u = torch.cat([torch.rand(1, generator=rows[i].generator or self._generator) for i in rand])
            u = (u * cdf[:, -1]).unsqueeze(1)  # (R, 1)
            drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1)  # (R, 1)
            for i, t in zip(rand, drawn.squeeze(1).tolist(), strict=True):
                out[i] = t
        return out

    @staticmethod
    def _masked(logits: torch.Tensor, index: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
        """A copy of rows `index` of `logits` (N, V), with each row's suppressed ids at -inf."""
        picked = logits[index]  # (N, V): advanced indexing copies
        vocab = logits.shape[1]
        for j, i in enumerate(index):
            if rows[i].suppressed:
                ids = [t for t in rows[i].suppressed if t < vocab]
                if ids:
                    picked[j, ids] = float("-inf")
        return picked

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Filtered probabilities for random rows. `logits` (R, V) float32, a copy: modified in place.
        top-k values above the vocabulary size mean the whole vocabulary."""
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        logits.div_(temps.unsqueeze(1))
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            probs = logits.softmax(dim=-1)  # (R, V)
            threshold = torch.tensor(min_ps).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits.masked_fill_(probs < threshold, float("-inf"))
        top_ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            # Only the candidates that can survive top-k need sorting; with top-k on every row
            # that is a cheap topk instead of a full (R, V) sort.
            if all(k > 0 for k in top_ks):
                sorted_logits, order = logits.topk(min(max(top_ks), vocab), dim=-1)  # (R, W)
            else:
                # top-p alone: sorting the whole vocabulary is slow on CPU, and the cut-off almost
                # always lies in the first few hundred tokens. Take a top slice and fall back to
                # the full sort only if some row's slice holds less mass than its top_p.
                sorted_logits, order = logits.topk(min(_TOP_P_SLICE, vocab), dim=-1)  # (R, W)
                mass = (sorted_logits - logits.logsumexp(-1, keepdim=True)).exp().sum(-1)  # (R,)
                if bool((mass < torch.tensor(top_ps)).any()):
                    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
            ranks = torch.arange(sorted_logits.shape[1]).unsqueeze(0)  # (1, W)
            k = torch.tensor([k if k > 0 else vocab for k in top_ks]).unsqueeze(1)  # (R, 1)
            sorted_logits.masked_fill_(ranks >= k, float("-inf"))
            p = torch.tensor(top_ps, dtype=torch.float32).unsqueeze(1)  # (R, 1)
            # Probabilities over the whole (top-k filtered) vocabulary, not just the slice.
            lse = torch.where(k < vocab, sorted_logits.logsumexp(-1, keepdim=True),
                              logits.logsumexp(-1, keepdim=True))  # (R, 1)
            sorted_probs = (sorted_logits - lse).exp()  # (R, W)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            sorted_logits.masked_fill_(before > p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)
