"""Device sampling (`troupe.kernels.cuda.sampling`) against troupe's CPU `Sampler` on the same inputs:
identical tokens for greedy and for seeded draws, identical filtered distributions for every filter."""

from __future__ import annotations

import pytest
import torch

from troupe.core.sampler import Sampler, SamplingRow
from troupe.kernels.cuda.sampling import DeviceSampler, SamplingTensors, filtered_probs, masked_logits, sample
from troupe.sampling_params import SamplingParams

VOCAB = 3000  # above the CPU sampler's 1024-token top-p slice, so its full-sort fallback is exercised too


def logits_for(S: int, seed: int, flat_rows: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.randn(S, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    for r in flat_rows:  # nearly flat: the top-p cut-off lies deep in the vocabulary
        x[r] = x[r] * 0.01
    return x


def make_rows(params: list[SamplingParams], suppressed: dict[int, frozenset[int]] | None = None) -> list[SamplingRow]:
    """Rows with fresh per-request generators (seeded params only), so two calls give equal, separate RNGs."""
    suppressed = suppressed or {}
    return [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
                        suppressed.get(i, frozenset())) for i, p in enumerate(params)]


FILTERS = {
    "temperature": [SamplingParams(temperature=t) for t in (0.3, 0.7, 1.0, 1.9)],
    "min_p": [SamplingParams(temperature=0.8, min_p=m) for m in (0.0, 0.05, 0.2, 0.9)],
    "top_k_every_row": [SamplingParams(temperature=1.0, top_k=k) for k in (1, 5, 50, 4000)],
    "top_k_some_rows": [SamplingParams(temperature=1.0, top_k=k) for k in (0, 7, -1, 300)],
    "top_p": [SamplingParams(temperature=1.0, top_p=p) for p in (0.1, 0.5, 0.9, 0.99)],
    "top_k_then_top_p": [SamplingParams(temperature=1.0, top_k=k, top_p=p)  # top-p over the top-k survivors
                         for k, p in ((5, 0.5), (100, 0.3), (20, 0.9), (2000, 0.7))],
    "all_filters": [SamplingParams(temperature=0.9, top_k=k, top_p=p, min_p=m)
                    for k, p, m in ((40, 0.9, 0.05), (0, 0.8, 0.0), (1000, 0.95, 0.01), (3, 1.0, 0.5))],
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_filtered_distributions_match_cpu_sampler(name: str) -> None:
    """After temperature / min-p / top-k / top-p the probabilities equal the CPU sampler's, row by row
    (each row with its own parameters; flat rows put the top-p cut-off past the CPU's fast slice)."""
    params = FILTERS[name]
    logits = logits_for(len(params), seed=1, flat_rows=(1, 3))
    t = SamplingTensors.build(make_rows(params), VOCAB, torch.Generator(), "cpu")
    ours = filtered_probs(masked_logits(logits, t), t)
    theirs = Sampler._probs(params, logits.clone(), VOCAB)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens survive


def test_greedy_tokens_identical() -> None:
    """Greedy rows (temperature 0), with min_tokens suppressions, pick exactly the CPU sampler's tokens."""
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    logits = logits_for(6, seed=2)
    top = logits.argmax(-1).tolist()
    suppressed = {0: frozenset({top[0]}), 3: frozenset({top[3], 5, VOCAB + 10})}  # ids past the vocab are ignored
    ours = DeviceSampler().sample(logits, make_rows(params, suppressed))
    assert ours == Sampler().sample(logits.clone(), make_rows(params, suppressed))
    assert ours[0] != top[0] and ours[3] != top[3] and ours[1] == top[1]


def test_seeded_and_unseeded_draws_identical_over_steps() -> None:
    """A mixed batch (greedy, seeded with filters, unseeded) over 12 steps: every token equals the CPU
    sampler's, since the uniforms come from the same generators in the same order."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=11, top_k=50),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.2, top_p=0.9, seed=12),
              SamplingParams(temperature=0.7, min_p=0.05)]
    ours_rows, cpu_rows = make_rows(params), make_rows(params)
    ours_sampler, cpu_sampler = DeviceSampler(seed=3), Sampler(seed=3)
    for step in range(12):
        logits = logits_for(len(params), seed=100 + step)
        assert ours_sampler.sample(logits, ours_rows) == cpu_sampler.sample(logits.clone(), cpu_rows)


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    """A seeded request draws the same tokens alone and next to other requests."""
    seeded = SamplingParams(temperature=1.0, seed=7, top_p=0.95)
    alone, crowded = make_rows([seeded]), make_rows([SamplingParams(temperature=1.0), seeded, SamplingParams()])
    a_sampler, c_sampler = DeviceSampler(seed=0), DeviceSampler(seed=1)
    for step in range(8):
        logits = logits_for(1, seed=200 + step)
        batch = torch.cat([logits_for(1, seed=300 + step), logits, logits_for(1, seed=400 + step)])
        assert a_sampler.sample(logits, alone)[0] == c_sampler.sample(batch, crowded)[1]


def test_sample_keeps_inputs_and_returns_device_ids() -> None:
    """`sample` leaves the logits untouched (float32 and bf16 inputs), returns (S,) int64 on their device."""
    params = [SamplingParams(temperature=0.5, top_k=10, min_p=0.1), SamplingParams(temperature=0.0)]
    for dtype in (torch.float32, torch.bfloat16):
        logits = logits_for(2, seed=5).to(dtype)
        before = logits.clone()
        t = SamplingTensors.build(make_rows(params, {0: frozenset({1, 2})}), VOCAB, torch.Generator(), "cpu")
        ids = sample(logits, t)
        assert torch.equal(logits, before)
        assert ids.dtype == torch.int64 and ids.shape == (2,) and ids.device == logits.device
        assert ids[1] == logits[1].float().argmax() and int(ids[0]) in logits[0].float().topk(10).indices.tolist()
