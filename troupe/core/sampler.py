"""`Sampler`: turns one step's logits into one token per request, with its logprobs when asked.

One batched torch implementation for every device: the logits stay where the model left them (CPU or
GPU), one `SamplingMetadata` per step carries the batch's parameters there, and only the sampled ids
and the asked-for logprobs come back to the host (one transfer). Order of operations (vLLM's), per row:

1. logits to float32 (a copy: the runner's logits are never written, the engine may sample rows again
   one by one from them after a failure); the structured-output grammar's bitmask masks what the
   grammar forbids;
2. raw logprobs (`logprobs_mode` "raw_logprobs", the default: log-softmax of these logits; "raw_logits":
   the logits themselves), for the rows that asked;
3. `allowed_token_ids` (everything else to -inf), bad words and the `min_tokens` suppressions (-inf),
   `logit_bias` (added), then the penalties over the request's tokens: repetition (prompt and output:
   positive logits divided by it, negative ones multiplied), frequency (minus `f * count in output`),
   presence (minus `p` if in the output);
4. greedy rows (temperature 0): argmax;
5. random rows: divide by temperature, min-p, then top-k and top-p on the sorted row, then an
   inverse-CDF draw `searchsorted(cumsum(p), u * total)` (the same distribution as vLLM's exponential
   race, far cheaper on CPU);
6. processed logprobs ("processed_logprobs" / "processed_logits"): of the distribution the token was
   drawn from (after step 5's filters for random rows, after step 3 for greedy rows).

Each logprobs row is the chosen token, then the row's top-k (`logprobs`, -1 the whole vocabulary), with
the chosen token's rank (1 = most likely: the count of tokens at least as likely).

Seeds: a request with a seed owns a `torch.Generator` and draws exactly one number per sampled token
from it, so its tokens do not depend on what else is in the batch; unseeded rows share the sampler's.

A row left with no token to sample (every token masked, e.g. a grammar that allows only EOS while
`min_tokens` suppresses it) raises `NoTokenAllowedError`; the engine then samples the batch's rows one
by one, so only that request fails. `make_sampler(device, seed)` returns this sampler for either
device; top-p on the CPU sorts a top slice first (a full sort of the vocabulary is slow there), on a
GPU the whole row (no host read mid-step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from troupe.core.sampling_metadata import SamplingMetadata, SamplingRow
from troupe.errors import NoTokenAllowedError
from troupe.sampling_params import SamplingParams

_TOP_P_SLICE = 1024
NEG_INF = float("-inf")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


LogprobsRow = tuple[list[int], list[float], int]  # [chosen, top-1..top-k] ids, their values, chosen's rank


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[LogprobsRow | None]  # one per row; None where the row asked for none


class TokenSampler(Protocol):
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput: ...

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
               ) -> tuple[torch.Tensor, Callable[[], SamplerOutput]]: ...


def make_sampler(device: torch.device, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> TokenSampler:
    """The engine's sampler for logits on `device` (one implementation for every device)."""
    return Sampler(seed=seed, logprobs_mode=logprobs_mode)


class Sampler:
    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        assert logprobs_mode in LOGPROBS_MODES, logprobs_mode
        self._generator = torch.Generator().manual_seed(seed)
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` (S, V), one row per entry of `rows`, on any device; never written to."""
        _, finish = self.launch(logits, rows)
        return finish()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
               ) -> tuple[torch.Tensor, Callable[[], SamplerOutput]]:
        """`sample` in two halves: the sampled ids (S,) int64 on the logits' device, computed without reading
        them back, and the function that brings them (and the logprobs asked for) to the host. Async scheduling
        (troupe.core.overlap) feeds the ids to the next step's forward on the device and calls the second half
        later. The only host read before that: whether a masked row has no token left (`NoTokenAllowedError`)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        S, V = logits.shape
        if all(r.plain_greedy for r in rows):
            ids = row_argmax(logits)  # nothing to copy or send
            return ids, lambda: SamplerOutput(ids.tolist(), [None] * S)
        meta = SamplingMetadata.build(rows, V, self._generator, logits.device)
        want_processed = bool(meta.logprob_rows) and not self.logprobs_mode.startswith("raw")
        x = logits.float()  # (S, V); the same tensor when it already is float32
        if x is logits and (meta.any_processing or want_processed):
            x = x.clone()  # written below; otherwise only copies of rows are (advanced indexing)
        if meta.bitmask is not None:
            apply_bitmask(x, meta.bitmask_rows, meta.bitmask)
        raw = None
        if meta.logprob_rows and self.logprobs_mode.startswith("raw"):
            picked = x[meta.logprob_rows]  # (L, V) a copy
            raw = picked if self.logprobs_mode == "raw_logits" else picked.log_softmax(dim=-1)
        apply_processors(x, meta)
        if meta.any_mask:
            empty = torch.isneginf(x.amax(dim=-1))  # (S,)
            if bool(empty.any()):
                bad = [rows[i].request_id for i in empty.nonzero().flatten().tolist()]
                raise NoTokenAllowedError(f"every token is masked for {bad} (allowed_token_ids, bad_words, "
                                          "min_tokens and the structured-output grammar leave none)")
        tokens = torch.empty(S, dtype=torch.int64, device=x.device)
        processed = None
        if len(meta.greedy_rows) == S:
            tokens = row_argmax(x)
        elif meta.greedy_rows:
            tokens[meta.greedy_rows] = row_argmax(x[meta.greedy_rows])
        if meta.rand_rows:
            filtered = filter_logits(x[meta.rand_rows], meta)  # (R, V) a copy
            probs = filtered.softmax(dim=-1)  # (R, V)
            cdf = probs.cumsum(dim=-1)  # (R, V)
            assert meta.uniform is not None
            u = (meta.uniform * cdf[:, -1]).unsqueeze(1)  # (R, 1)
            drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=V - 1)  # (R, 1)
            tokens[meta.rand_rows] = drawn.squeeze(1)
            if want_processed:
                x[meta.rand_rows] = filtered  # the rows' processed logits, for the logprobs below
        if want_processed:
            picked = x[meta.logprob_rows]
            processed = picked if self.logprobs_mode == "processed_logits" else picked.log_softmax(dim=-1)
        if not meta.logprob_rows:
            return tokens, lambda: SamplerOutput(tokens.tolist(), [None] * S)
        source = raw if raw is not None else processed
        assert source is not None
        return tokens, lambda: self._with_logprobs(tokens, source, meta, S)

    @staticmethod
    def _with_logprobs(tokens: torch.Tensor, source: torch.Tensor, meta: SamplingMetadata, S: int) -> SamplerOutput:
        """The ids and, for the logprob rows, [chosen, top-k] ids, values and the chosen token's rank,
        brought to the host together."""
        V = source.shape[1]
        ks = [V if k == -1 else min(k, V) for k in meta.logprob_k]
        chosen = tokens[meta.logprob_rows].unsqueeze(1)  # (L, 1)
        chosen_lp = source.gather(1, chosen)  # (L, 1)
        ranks = (source >= chosen_lp).sum(dim=-1)  # (L,)
        k = max(ks)
        top_v, top_i = source.topk(k, dim=-1) if k > 0 else (source[:, :0], chosen[:, :0])  # (L, k)
        ids = torch.cat([chosen, top_i], dim=1).tolist()
        values = torch.cat([chosen_lp, top_v], dim=1).tolist()
        out: list[LogprobsRow | None] = [None] * S
        for j, (row, kk, rank) in enumerate(zip(meta.logprob_rows, ks, ranks.tolist(), strict=True)):
            out[row] = (ids[j][:kk + 1], values[j][:kk + 1], int(rank))
        return SamplerOutput(tokens.tolist(), out)

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Filtered probabilities (R, V) of random rows with these params (a test seam)."""
        rows = [SamplingRow(p, None) for p in params]
        meta = SamplingMetadata.build(rows, vocab, torch.Generator(), logits.device)
        return filter_logits(logits, meta).softmax(dim=-1)


ARGMAX_CHUNK = 1024  # values per chunk of `row_argmax`'s first pass


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for (S, V) logits: the index of each row's first maximum (a NaN counting as the
    maximum, as in torch). On the CPU, torch's argmax is a scalar loop while `amax` is vectorized, so
    wide contiguous rows take two passes, several times faster at a batch's width: the max of each
    1024-value chunk, then the argmax inside the first chunk holding the row's max. Elsewhere, for narrow
    rows, or for a single row: `argmax`. One row, straight after the LM head wrote it, is cheaper in one
    pass than in the two passes' several ops (`python -m troupe.bench.step` times the sampler at B = 1)."""
    S, V = x.shape
    if x.device.type != "cpu" or V < 4 * ARGMAX_CHUNK or not x.is_contiguous() or S <= 1:
        return x.argmax(dim=-1)
    C, B = ARGMAX_CHUNK, V // ARGMAX_CHUNK
    chunks = x[:, :B * C].view(S, B, C)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # (S,) first chunk holding the max (amax keeps NaN)
    rows = torch.arange(S)
    index = best * C + chunks[rows, best].argmax(dim=-1)  # (S,)
    if B * C < V:  # the tail wins where it holds a larger value, or the first NaN of a NaN-free head
        head, tail = x[rows, index], x[:, B * C:]
        tail_max = tail.amax(dim=-1)
        wins = (tail_max > head) | (tail_max.isnan() & ~head.isnan())
        index = torch.where(wins, B * C + tail.argmax(dim=-1), index)
    return index


def apply_bitmask(x: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Rows `rows` of `x` (S, V): -inf where the grammar's bit is 0. `bitmask` (G, W) int32."""
    V = x.shape[1]
    shifts = torch.arange(32, device=x.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]  # (G, V)
    x[rows] = x[rows].masked_fill(~allowed, NEG_INF)


def apply_processors(x: torch.Tensor, meta: SamplingMetadata) -> None:
    """Step 3 of the module docstring, in place on `x` (S, V) float32."""
    if meta.allowed is not None:
        x[meta.allowed_rows] = x[meta.allowed_rows].masked_fill(meta.allowed, NEG_INF)
    if meta.banned is not None:
        x.index_put_((meta.banned[0], meta.banned[1]), torch.full((), NEG_INF, device=x.device))  # no host copy
    if meta.bias is not None:
        assert meta.bias_values is not None
        x.index_put_((meta.bias[0], meta.bias[1]), meta.bias_values, accumulate=True)
    if meta.penalty_rows:
        assert meta.output_counts is not None and meta.prompt_mask is not None
        assert meta.repetition is not None and meta.frequency is not None and meta.presence is not None
        p = x[meta.penalty_rows]  # (P, V)
        counts = meta.output_counts
        seen = meta.prompt_mask | (counts > 0)  # (P, V)
        rep = torch.where(seen, meta.repetition, 1.0)  # (P, V)
        p = p * torch.where(p > 0, 1.0 / rep, rep)
        p = p - meta.frequency * counts - meta.presence * (counts > 0)
        x[meta.penalty_rows] = p


def filter_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Random rows (R, V) float32, a copy that is modified in place: temperature, min-p, top-k, top-p
    (-inf outside what survives). top-k values above the vocabulary size mean the whole vocabulary."""
    assert meta.temperature is not None
    vocab = logits.shape[1]
    dev = logits.device
    logits.div_(meta.temperature.unsqueeze(1))
    if any(m > 0 for m in meta.min_p):
        probs = logits.softmax(dim=-1)  # (R, V)
        threshold = _col(meta.min_p, dev) * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(probs < threshold, NEG_INF)
    top_ks, top_ps = meta.top_k, meta.top_p
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        # Only the candidates that can survive top-k need sorting; with top-k on every row
        # that is a cheap topk instead of a full (R, V) sort.
        if all(k > 0 for k in top_ks):
            sorted_logits, order = logits.topk(min(max(top_ks), vocab), dim=-1)  # (R, W)
        elif dev.type == "cpu":
            # top-p alone: sorting the whole vocabulary is slow on CPU, and the cut-off almost
            # always lies in the first few hundred tokens. Take a top slice and fall back to
            # the full sort only if some row's slice holds less mass than its top_p.
            sorted_logits, order = logits.topk(min(_TOP_P_SLICE, vocab), dim=-1)  # (R, W)
            mass = (sorted_logits - logits.logsumexp(-1, keepdim=True)).exp().sum(-1)  # (R,)
            if bool((mass < torch.tensor(top_ps)).any()):
                sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
        ranks = torch.arange(sorted_logits.shape[1], device=dev).unsqueeze(0)  # (1, W)
        k = _col([k if k > 0 else vocab for k in top_ks], dev, torch.int64)  # (R, 1)
        sorted_logits.masked_fill_(ranks >= k, NEG_INF)
        p = _col(top_ps, dev)  # (R, 1)
        # Probabilities over the whole (top-k filtered) vocabulary, not just the slice.
        lse = torch.where(k < vocab, sorted_logits.logsumexp(-1, keepdim=True),
                          logits.logsumexp(-1, keepdim=True))  # (R, 1)
        sorted_probs = (sorted_logits - lse).exp()  # (R, W)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        sorted_logits.masked_fill_(before > p, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter_(1, order, sorted_logits)
    return logits


def _col(values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(R, 1) column of per-row values on `device`."""
    t = torch.tensor(values, dtype=dtype).unsqueeze(1)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
