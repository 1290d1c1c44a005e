"""Sampling on the logits' device: greedy, temperature, min-p, top-k, top-p and seeded draws (torch).

Same semantics as `troupe.core.sampler.Sampler` (vLLM's order, `shared/reference/vllm-semantics.md`
§2.10), vectorised over the batch so that nothing but the sampled ids crosses back to the host:
1. logits to float32 (a copy: the caller's logits are not modified); the `min_tokens` suppressions
   (row, token) are masked to -inf;
2. greedy rows take the argmax of that;
3. random rows: divide by temperature, min-p (`p < min_p * max p` masked), then top-k and top-p on the
   descending order (top-k only needs `topk(max k)` when every row has one, otherwise a full sort),
   top-p keeping the smallest prefix whose mass reaches `top_p` over the top-k-filtered
   distribution; softmax; an inverse-CDF draw `searchsorted(cumsum(p), u * total)`.

Draws: the uniform numbers `u` are drawn on the host, one per random row in batch order, from the
request's own `torch.Generator` when it has a seed and from the shared one otherwise, exactly as
`Sampler` does; they travel to the device packed with the other parameters (a few small copies). So a seeded
request gets the same tokens from the same logits on either device, and never depends on its batch.
Flags the host already knows (all greedy, any top-k, ...) pick the work without a device read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from troupe.core.sampler import SamplingRow  # the rows' type only: core.sampler imports this module


@dataclass(slots=True)
class SamplingTensors:
    """One step's sampling parameters on the logits' device; `build` makes them from the batch's rows."""

    greedy: torch.Tensor  # (S,) bool
    temperature: torch.Tensor  # (S,) float32; 1 on greedy rows (never used there)
    top_k: torch.Tensor  # (S,) int64; the vocabulary size when off
    top_p: torch.Tensor  # (S,) float32; 1 when off
    min_p: torch.Tensor  # (S,) float32; 0 when off
    uniform: torch.Tensor  # (S,) float32 in [0, 1): the draw of each random row; 0 on greedy rows
    suppress: torch.Tensor | None  # (2, N) int64 (row, token) pairs to mask, or None
    all_greedy: bool
    any_min_p: bool
    any_top_k: bool
    all_top_k: bool
    any_top_p: bool
    max_top_k: int  # the largest top-k among rows that have one (0: none)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab: int, generator: torch.Generator,
              device: torch.device | str) -> SamplingTensors:
        """Host-side: read the rows' parameters, draw their uniforms, copy them to `device` (packed)."""
        S = len(rows)
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        ks = [p.top_k if p.top_k > 0 and not g else 0 for p, g in zip(params, greedy, strict=True)]
        floats = torch.zeros(S, 4, dtype=torch.float32)  # temperature, top_p, min_p, uniform
        for i, (p, g) in enumerate(zip(params, greedy, strict=True)):
            if g:
                floats[i, 0], floats[i, 1] = 1.0, 1.0
            else:
                floats[i, 0], floats[i, 1], floats[i, 2] = p.temperature, p.top_p, p.min_p
                floats[i, 3] = torch.rand(1, generator=rows[i].generator or generator)[0]
        pairs = [(i, t) for i, r in enumerate(rows) for t in sorted(r.suppressed) if t < vocab]
        ints = torch.tensor([k if k > 0 else vocab for k in ks], dtype=torch.int64)
        floats, ints = _to(floats, device), _to(ints, device)
        suppress = _to(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device) if pairs else None
        return cls(
            greedy=_to(torch.tensor(greedy), device),
            temperature=floats[:, 0], top_p=floats[:, 1], min_p=floats[:, 2], uniform=floats[:, 3],
            top_k=ints, suppress=suppress,
            all_greedy=all(greedy), any_min_p=any(p.min_p > 0 and not g for p, g in zip(params, greedy, strict=True)),
            any_top_k=any(k > 0 for k in ks),
            all_top_k=all(k > 0 for k, g in zip(ks, greedy, strict=True) if not g) and not all(greedy),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)),
            max_top_k=max(ks, default=0),
        )


def _to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device` without a host sync: a CUDA copy goes from pinned memory (the caching host
    allocator keeps the staging block until the copy is done)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def masked_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """(S, V) float32 copy of `logits` with the suppressed tokens at -inf."""
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()  # (S, V), never aliased
    if t.suppress is not None:
        out.index_put_((t.suppress[0], t.suppress[1]), torch.tensor(float("-inf"), device=out.device))
    return out


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Probabilities (S, V) of the random rows after temperature, min-p, top-k and top-p.

    `logits`: the masked float32 logits (modified in place). Greedy rows come out as a plain softmax
    (they are not drawn from)."""
    x = logits.div_(t.temperature[:, None])  # (S, V)
    if t.any_min_p:
        probs = x.softmax(dim=-1)
        x.masked_fill_(probs < t.min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if t.any_top_k or t.any_top_p:
        vocab = x.shape[1]
        if t.all_top_k:  # every random row has a top-k: only the max-k candidates can survive
            sorted_x, order = x.topk(min(t.max_top_k, vocab), dim=-1)  # (S, W)
        else:
            sorted_x, order = x.sort(dim=-1, descending=True)  # (S, V)
        ranks = torch.arange(sorted_x.shape[1], device=x.device)[None, :]  # (1, W)
        sorted_x.masked_fill_(ranks >= t.top_k[:, None], float("-inf"))
        if t.any_top_p:
            sorted_p = sorted_x.softmax(dim=-1)  # over the top-k-filtered vocabulary
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
            sorted_x.masked_fill_(before > t.top_p[:, None], float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x)
    return x.softmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """`logits` (S, V) -> (S,) int64 token ids on the logits' device (no host sync)."""
    x = masked_logits(logits, t)  # (S, V)
    picked = x.argmax(dim=-1)  # (S,)
    if t.all_greedy:
        return picked
    probs = filtered_probs(x, t)  # (S, V)
    cdf = probs.cumsum(dim=-1)  # (S, V)
    u = (t.uniform * cdf[:, -1])[:, None]  # (S, 1)
    drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)  # (S,)
    return torch.where(t.greedy, picked, drawn)


class DeviceSampler:
    """`Sampler`'s interface over `sample`: the logits stay on their device, the ids come back as a list."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """`logits` (S, V), one row per entry of `rows`; returns S token ids (the step's one sync).

        Like `Sampler.sample`, it never writes to `logits` (the engine may sample rows again one by one
        from them after a failure). A batch of greedy rows with nothing suppressed is one argmax: no
        parameter goes to the device."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(r.params.greedy and not r.suppressed for r in rows):
            ids: list[int] = logits.argmax(dim=-1).tolist()
            return ids
        tensors = SamplingTensors.build(rows, logits.shape[1], self._generator, logits.device)
        return sample(logits, tensors).tolist()
