"""`SamplingMetadata`: one step's sampling parameters as tensors on the logits' device.

Built once per step by `SamplingMetadata.build` from the batch's `SamplingRow`s (each what the sampler
knows of the request behind one logits row; host reads of each request's parameters and token
history, then a few small copies to the device); the sampler then runs
on the logits without reading the host again. What each field holds (S rows, V the vocabulary):

- draws: `temperature`, `top_k`, `top_p`, `min_p` per random row (the `rand` rows), and their uniform
  numbers `uniform`, drawn on the host from each request's own generator (a seeded request) or the
  shared one, one per random row in batch order, so a seeded request never depends on its batch;
- masks: `bitmask` (G, ceil(V/32)) int32, the structured-output grammar's allowed tokens of the rows
  `bitmask_rows` (bit t % 32 of word t // 32); `allowed` (A, V) bool, True where a row of `allowed_rows`
  may NOT sample (outside its `allowed_token_ids`); `banned` (2, N) (row, token) pairs set to -inf: the
  `min_tokens` suppressions and the bad words whose prefix the output ends with;
- `bias` (row, token) pairs and their values (`bias_values`), added to the logits;
- penalties, for the rows `penalty_rows` (P): `output_counts` (P, V) float32 (how often each token
  was generated, by scatter_add), `prompt_mask` (P, V) bool (in the prompt), and the three penalties (P,);
- logprobs: `logprob_rows` (L) and each one's `logprob_k` (-1: the whole vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from troupe.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about the request behind one logits row."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    suppressed: frozenset[int] = frozenset()  # token ids masked this step (min_tokens)
    request_id: str = ""  # the engine's id of the request (errors, the test-only fault hook)
    output_token_ids: Sequence[int] = ()  # generated so far (penalties, bad words)
    prompt_token_ids: Sequence[int] = ()  # (repetition penalty)
    bad_words: Sequence[Sequence[int]] = ()  # token sequences (vLLM's bad-words rule)
    bitmask: torch.Tensor | None = None  # (ceil(V/32),) int32: the grammar's allowed tokens this step
    plain_greedy: bool = field(init=False)  # an argmax and nothing else: no mask, processor or logprobs

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (p.greedy and not self.suppressed and p.logprobs is None and not p.has_penalties
                             and p.logit_bias is None and p.allowed_token_ids is None and not self.bad_words
                             and self.bitmask is None)


@dataclass(slots=True)
class SamplingMetadata:
    vocab: int
    device: torch.device
    greedy_rows: list[int] = field(default_factory=list)
    rand_rows: list[int] = field(default_factory=list)
    temperature: torch.Tensor | None = None  # (R,) float32
    top_k: list[int] = field(default_factory=list)  # per random row; 0: off
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    uniform: torch.Tensor | None = None  # (R,) float32 in [0, 1)
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None  # (G, ceil(V/32)) int32
    allowed_rows: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # (A, V) bool: True = not allowed
    banned: torch.Tensor | None = None  # (2, N) int64 (row, token)
    bias: torch.Tensor | None = None  # (2, B) int64 (row, token)
    bias_values: torch.Tensor | None = None  # (B,) float32
    penalty_rows: list[int] = field(default_factory=list)
    output_counts: torch.Tensor | None = None  # (P, V) float32
    prompt_mask: torch.Tensor | None = None  # (P, V) bool
    presence: torch.Tensor | None = None  # (P, 1) float32
    frequency: torch.Tensor | None = None  # (P, 1) float32
    repetition: torch.Tensor | None = None  # (P, 1) float32
    logprob_rows: list[int] = field(default_factory=list)
    logprob_k: list[int] = field(default_factory=list)

    @property
    def any_mask(self) -> bool:
        """Some row has tokens it may not sample (a row could be left with none)."""
        return self.bitmask is not None or self.allowed is not None or self.banned is not None

    @property
    def any_processing(self) -> bool:
        """Anything changes the logits before the draw (else greedy is a plain argmax)."""
        return self.any_mask or self.bias is not None or bool(self.penalty_rows)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab: int, generator: torch.Generator,
              device: torch.device) -> SamplingMetadata:
        m = cls(vocab=vocab, device=device)
        banned: list[tuple[int, int]] = []
        bias: list[tuple[int, int]] = []
        bias_values: list[float] = []
        allowed_pairs: list[tuple[int, int]] = []
        bitmasks: list[torch.Tensor] = []
        uniforms: list[float] = []
        temps: list[float] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy:
                m.greedy_rows.append(i)
            else:
                m.rand_rows.append(i)
                temps.append(p.temperature)
                m.top_k.append(min(p.top_k, vocab) if p.top_k > 0 else 0)
                m.top_p.append(p.top_p)
                m.min_p.append(p.min_p)
                uniforms.append(float(torch.rand(1, generator=row.generator or generator)[0]))
            banned.extend((i, t) for t in sorted(row.suppressed) if t < vocab)
            if row.bad_words:
                banned.extend((i, t) for t in banned_by_bad_words(row.bad_words, row.output_token_ids) if t < vocab)
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if t < vocab:
                        bias.append((i, t))
                        bias_values.append(b)
            if p.allowed_token_ids is not None:
                a = len(m.allowed_rows)
                m.allowed_rows.append(i)
                allowed_pairs.extend((a, t) for t in p.allowed_token_ids if t < vocab)
            if row.bitmask is not None:
                m.bitmask_rows.append(i)
                bitmasks.append(row.bitmask)
            if p.has_penalties:
                m.penalty_rows.append(i)
            if p.logprobs is not None:
                m.logprob_rows.append(i)
                m.logprob_k.append(p.logprobs)
        if temps:
            m.temperature = _to(torch.tensor(temps, dtype=torch.float32), device)
            m.uniform = _to(torch.tensor(uniforms, dtype=torch.float32), device)
        if banned:
            m.banned = _to(torch.tensor(banned, dtype=torch.int64).T.contiguous(), device)
        if bias:
            m.bias = _to(torch.tensor(bias, dtype=torch.int64).T.contiguous(), device)
            m.bias_values = _to(torch.tensor(bias_values, dtype=torch.float32), device)
        if m.allowed_rows:
            mask = torch.ones(len(m.allowed_rows), vocab, dtype=torch.bool)
            if allowed_pairs:
                idx = torch.tensor(allowed_pairs, dtype=torch.int64).T
                mask[idx[0], idx[1]] = False
            m.allowed = _to(mask, device)
        if bitmasks:
            m.bitmask = _to(torch.stack(bitmasks), device)
        if m.penalty_rows:
            m._build_penalties([rows[i] for i in m.penalty_rows])
        return m

    def _build_penalties(self, rows: list[SamplingRow]) -> None:
        """Output-token counts and the prompt+output presence mask of the penalized rows, by scatter_add
        over the rows' token ids padded with an extra column (`vocab`) that is dropped afterwards."""
        V, P = self.vocab, len(rows)
        outputs = _padded([list(r.output_token_ids) for r in rows], V)  # (P, Lo)
        prompts = _padded([list(r.prompt_token_ids) for r in rows], V)  # (P, Lp)
        counts = torch.zeros(P, V + 1, dtype=torch.float32)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        in_prompt = torch.zeros(P, V + 1, dtype=torch.bool)
        in_prompt.scatter_(1, prompts, True)
        self.output_counts = _to(counts[:, :V].contiguous(), self.device)
        self.prompt_mask = _to(in_prompt[:, :V].contiguous(), self.device)
        pens = torch.tensor([[r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty]
                             for r in rows], dtype=torch.float32)
        pens = _to(pens, self.device)
        self.presence, self.frequency, self.repetition = pens[:, 0:1], pens[:, 1:2], pens[:, 2:3]


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output ends with the word's other tokens
    (a one-token word is always banned)."""
    out: list[int] = []
    n = len(output)
    for word in bad_words:
        k = len(word) - 1
        if k > n:
            continue
        if k == 0 or list(output[n - k:]) == list(word[:k]):
            out.append(word[-1])
    return out


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    """(len(lists), longest) int64, each list padded with `pad` (at least one column)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a host sync: a CUDA copy goes from pinned memory (the caching host
    allocator keeps the staging block until the copy is done)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
