"""Engine-side logprobs: prompt logprobs from a prefill chunk's logits, and the compact wire form.

Prompt logprobs follow vLLM: the log-softmax of the raw logits (no penalty, bias, mask or temperature),
for every prompt token after the first; each row is [the prompt token, top-1 .. top-k] with the prompt
token's rank (1 = most likely: the count of tokens at least as likely). The logits of chunk position p
predict token p + 1, so a chunk covering positions `start .. start + n - 1` yields the rows of prompt
tokens `start + 1 .. start + n` that are not done yet (`Request.prompt_logprob_rows`; a recomputed
chunk after a preemption adds nothing twice).
"""

from __future__ import annotations

import torch

from troupe.core.request import Request
from troupe.core.sampler import LogprobsRow
from troupe.messages import LogprobsLists


def to_lists(rows: list[LogprobsRow]) -> LogprobsLists:
    return LogprobsLists([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def topk_rows(logprobs: torch.Tensor, targets: list[int], k: int) -> list[LogprobsRow]:
    """Rows for `logprobs` (N, V) and the N `targets` (the token each row is about); `k` -1 = the vocab."""
    V = logprobs.shape[1]
    k = V if k == -1 else min(k, V)
    target = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)  # (N, 1)
    target_lp = logprobs.gather(1, target)  # (N, 1)
    ranks = (logprobs >= target_lp).sum(dim=-1).tolist()  # (N,)
    top_v, top_i = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], target[:, :0])  # (N, k)
    ids = torch.cat([target, top_i], dim=1).tolist()
    values = torch.cat([target_lp, top_v], dim=1).tolist()
    return [(i, v, int(r)) for i, v, r in zip(ids, values, ranks, strict=True)]


def add_prompt_logprobs(req: Request, logits: torch.Tensor, start: int) -> None:
    """Extend `req.prompt_logprob_rows` from the logits (n, V) of its chunk at positions `start ..`."""
    P = req.num_prompt_tokens
    done = len(req.prompt_logprob_rows)  # rows of prompt tokens 1 .. done
    lo, hi = max(start, done), min(start + logits.shape[0], P - 1)  # chunk positions still needed
    if lo >= hi:
        return
    assert lo == done, (lo, done)
    logprobs = logits[lo - start:hi - start].float().log_softmax(dim=-1)  # (hi - lo, V)
    assert req.params.prompt_logprobs is not None
    req.prompt_logprob_rows.extend(topk_rows(logprobs, req.prompt_token_ids[lo + 1:hi + 1], req.params.prompt_logprobs))
