"""Sampler behaviour: greedy, filters, seeds, min_tokens masking, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from troupe.core.sampler import ARGMAX_CHUNK, Sampler, SamplingRow, row_argmax
from troupe.sampling_params import SamplingParams


def rows(n: int, seed: int | None = None, suppressed: frozenset[int] = frozenset(), **kw: object) -> list[SamplingRow]:
    out = []
    for _ in range(n):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out.append(SamplingRow(SamplingParams(seed=seed, **kw), gen, suppressed))  # type: ignore[arg-type]
    return out


def test_greedy_is_argmax() -> None:
    """temperature=0 picks the argmax of every row."""
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    assert Sampler().sample(logits.clone(), rows(8, temperature=0.0)).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("width", [4 * ARGMAX_CHUNK, 5000, 8191, 49152, 49153])
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "all -inf", "max at both ends", "nan in the tail"])
def test_row_argmax_matches_torch(width: int, kind: str) -> None:
    """The chunked argmax of wide CPU rows returns torch's index for every row: the first maximum
    (ties across and inside chunks), the first NaN, row 0 of an all -inf row, a tail past the last
    whole chunk, in batches of 2 and 64 (greedy rows of the real default-model vocabulary: 49152), and
    for a single row (torch's own argmax there)."""
    g = torch.Generator().manual_seed(width)
    for batch in (1, 2, 64):
        x = torch.randn(batch, width, generator=g)
        if kind == "ties":
            x = x.round()
        elif kind == "nan":
            x[:, 3::7] = float("nan")
        elif kind == "all -inf":
            x[:] = float("-inf")
        elif kind == "max at both ends":
            x[:, [0, width // 2, width - 1]] = 100.0
        elif kind == "nan in the tail":
            x[:, -3] = float("nan")
        assert torch.equal(row_argmax(x), x.argmax(dim=-1)), (batch, width, kind)


def test_row_argmax_takes_torch_for_narrow_or_strided_rows() -> None:
    """Rows narrower than four chunks and non-contiguous views go to torch's argmax (same result)."""
    x = torch.randn(6, 4 * ARGMAX_CHUNK + 10, generator=torch.Generator().manual_seed(3))
    for view in (x[:, :100], x[::2], x.t().contiguous().t()):
        assert torch.equal(row_argmax(view), view.argmax(dim=-1))


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6), dict(temperature=1.0, min_p=1.0)],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_filters_that_leave_one_token_match_greedy(kw: dict[str, float]) -> None:
    """A filter that keeps only the most likely token makes random sampling greedy."""
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2)) * 3
    assert Sampler(seed=5).sample(logits.clone(), rows(16, **kw)).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_samples_inside_the_top_k() -> None:
    """Every sampled token is among the k most likely."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    top = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(seed=0)
    picked = {sampler.sample(logits.clone(), rows(1, temperature=1.5, top_k=5)).token_ids[0] for _ in range(300)}
    assert picked <= top and len(picked) >= 3


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    """With probabilities .5/.3/.2 and top_p=0.7, only the first two tokens can be drawn."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(seed=0)
    picked = [sampler.sample(logits.clone(), rows(1, top_p=0.7)).token_ids[0] for _ in range(400)]
    assert set(picked) == {0, 1}
    assert 0.5 < picked.count(0) / 400 < 0.75  # renormalised: 0.625


def test_top_p_exact_when_the_cutoff_is_deep_in_the_vocabulary() -> None:
    """A flat distribution puts the top-p cut-off past the fast slice; the full sort handles it."""
    vocab = 5000
    logits = torch.zeros(1, vocab)
    sampler = Sampler(seed=0)
    picked = {sampler.sample(logits.clone(), rows(1, top_p=0.9)).token_ids[0] for _ in range(300)}
    assert max(picked) > 2000  # tokens far beyond the first 1024 are reachable


def test_sampled_frequencies_follow_the_softmax() -> None:
    """Plain temperature sampling draws each token with its softmax probability."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = (probs.log() * 2).unsqueeze(0)  # temperature 2 undoes the factor
    sampler = Sampler(seed=0)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n // 8):
        for t in sampler.sample(logits.repeat(8, 1), rows(8, temperature=2.0)).token_ids:
            counts[t] += 1
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    """A seeded request draws the same tokens alone and inside a batch of other requests."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))

    def run(batch: bool) -> list[int]:
        row = rows(1, seed=42, temperature=1.0)[0]
        sampler = Sampler(seed=7)
        got = []
        for _ in range(10):
            if batch:
                batch_rows = rows(2, temperature=0.9) + [row] + rows(3, temperature=0.0)
                got.append(sampler.sample(logits.clone(), batch_rows).token_ids[2])
            else:
                got.append(sampler.sample(logits[2:3].clone(), [row]).token_ids[0])
        return got

    assert run(batch=False) == run(batch=True)


def test_suppressed_tokens_are_never_sampled() -> None:
    """min_tokens masking: a suppressed token loses even when it is the argmax."""
    logits = torch.tensor([[0.0, 10.0, 0.0, 1.0]])
    assert Sampler().sample(logits.clone(), rows(1, temperature=0.0, suppressed=frozenset({1}))).token_ids == [3]
