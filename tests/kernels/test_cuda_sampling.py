"""troupe's one batched sampler on the kernel tests' device (the GPU when there is one, else the CPU)
against plain per-row references written here: the filtered distributions, the logits processors
(grammar bitmask, allowed_token_ids, bad words, min_tokens, logit_bias, the three penalties), the
logprobs and their ranks; seeded draws that do not depend on the batch or the device; inputs untouched."""

from __future__ import annotations

import pytest
import torch

from troupe.core.sampler import NoTokenAllowedError, Sampler, SamplingRow
from troupe.sampling_params import SamplingParams

VOCAB = 3000  # above the CPU sampler's 1024-token top-p slice, so its full-sort fallback is exercised too


def logits_for(S: int, seed: int, flat_rows: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.randn(S, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    for r in flat_rows:  # nearly flat: the top-p cut-off lies deep in the vocabulary
        x[r] = x[r] * 0.01
    return x


def make_rows(params: list[SamplingParams], **extra: dict[int, object]) -> list[SamplingRow]:
    """Rows with fresh per-request generators (seeded params only); `extra[name][i]` sets row i's field."""
    rows = [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
            for p in params]
    for name, per_row in extra.items():
        for i, value in per_row.items():
            setattr(rows[i], name, value)
    return rows


def reference_probs(p: SamplingParams, row: torch.Tensor) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p on one row (V,), the plain way: one full sort."""
    x = row.double() / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    order = x.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else len(x)
    sorted_p = x[order][:k].softmax(-1)
    mass = 0.0
    for j in range(min(k, len(x))):
        if mass > p.top_p:
            break
        keep[order[j]] = True
        mass += float(sorted_p[j])
    x[~keep] = float("-inf")
    return x.softmax(-1).float()


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
def test_filtered_distributions_match_a_per_row_reference(name: str, device: torch.device) -> None:
    """After temperature / min-p / top-k / top-p the probabilities equal the per-row reference (each row
    with its own parameters; flat rows put the top-p cut-off past the CPU's fast slice)."""
    params = FILTERS[name]
    logits = logits_for(len(params), seed=1, flat_rows=(1, 3))
    ours = Sampler._probs(params, logits.clone().to(device), VOCAB).cpu()
    theirs = torch.stack([reference_probs(p, logits[i]) for i, p in enumerate(params)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens survive


def reference_processed(row: SamplingRow, z: torch.Tensor) -> torch.Tensor:
    """The logits processors on one row (V,), from their definitions."""
    p, x = row.params, z.clone()
    if row.bitmask is not None:
        for t in range(len(x)):
            if not (int(row.bitmask[t // 32]) >> (t % 32)) & 1:
                x[t] = float("-inf")
    if p.allowed_token_ids is not None:
        x[[t for t in range(len(x)) if t not in p.allowed_token_ids]] = float("-inf")
    for word in row.bad_words:
        if len(word) == 1 or list(row.output_token_ids[-(len(word) - 1):]) == list(word[:-1]):
            x[word[-1]] = float("-inf")
    for t in row.suppressed:
        x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        x[t] -= p.frequency_penalty * row.output_token_ids.count(t) + p.presence_penalty
    return x


def test_processors_match_a_per_row_reference(device: torch.device) -> None:
    """Greedy rows with every processor, alone and together, in one batch: the processed logits (the
    whole vocabulary, `processed_logits`) and the argmax equal the per-row reference."""
    allow_bits = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    for t in range(0, VOCAB, 3):  # the grammar allows every third token
        allow_bits[t // 32] |= 1 << (t % 32)
    prompt, output = [5, 6, 7, 5], [7, 8, 8, 9]
    g = dict(temperature=0.0, logprobs=-1)
    params = [SamplingParams(**g), SamplingParams(presence_penalty=1.5, **g), SamplingParams(frequency_penalty=-0.7, **g),
              SamplingParams(repetition_penalty=1.8, **g), SamplingParams(logit_bias={3: 9.0, 8: -4.0}, **g),
              SamplingParams(allowed_token_ids=[1, 8, 100, 2999], **g), SamplingParams(**g), SamplingParams(**g),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=0.6,
                             logit_bias={9: 2.0}, allowed_token_ids=list(range(0, 600)), **g)]
    rows = make_rows(params, prompt_token_ids={i: prompt for i in range(len(params))},
                     output_token_ids={i: output for i in range(len(params))},
                     bad_words={6: [[9, 44], [8, 9, 45], [46], [1, 47]]}, bitmask={7: allow_bits, 8: allow_bits},
                     suppressed={8: frozenset({10, 12})})
    logits = logits_for(len(params), seed=3)
    out = Sampler(logprobs_mode="processed_logits").sample(logits.to(device), rows)
    for i, row in enumerate(rows):
        want = reference_processed(row, logits[i])
        lp = out.logprobs[i]
        assert lp is not None and len(lp[0]) == VOCAB + 1
        got = torch.full((VOCAB,), float("nan"))
        got[torch.tensor(lp[0][1:])] = torch.tensor(lp[1][1:])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert out.token_ids[i] == int(want.argmax()) and lp[2] == 1


def test_raw_logprobs_and_ranks(device: torch.device) -> None:
    """Raw logprobs are the log-softmax of the unprocessed logits, for the sampled token (with its rank)
    and the top-k, whatever the row's temperature, filters and bias."""
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 50.0}),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.8, seed=4, logprobs=5, presence_penalty=1.0),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=9, logprobs=0)]
    logits = logits_for(len(params), seed=6)
    rows = make_rows(params, output_token_ids={1: [1, 2]})
    out = Sampler().sample(logits.to(device), rows)
    ref = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        ids, values, rank = lp
        k = params[i].logprobs or 0
        assert ids[0] == out.token_ids[i] and len(ids) == k + 1
        assert ids[1:] == ref[i].topk(k).indices.tolist()
        torch.testing.assert_close(torch.tensor(values), ref[i, ids], atol=1e-5, rtol=1e-5)
        assert rank == int((ref[i] >= ref[i, ids[0]]).sum())
    assert out.token_ids[0] == 0  # the bias chose it; its raw logprob is still the model's
    assert out.logprobs[0] is not None and out.logprobs[0][2] > 1


def test_seeded_draws_do_not_depend_on_the_batch_or_the_device(device: torch.device) -> None:
    """A seeded request draws the same tokens alone on the CPU and among other requests on the device, over
    steps with penalties, bias and allowed tokens active (the uniforms come from its own generator)."""
    seeded = SamplingParams(temperature=1.0, seed=7, top_p=0.95, frequency_penalty=0.4, logit_bias={3: 1.0},
                            allowed_token_ids=list(range(0, VOCAB, 2)))
    alone = make_rows([seeded])
    crowded = make_rows([SamplingParams(temperature=1.0), seeded, SamplingParams(presence_penalty=1.0)])
    a_sampler, c_sampler = Sampler(seed=0), Sampler(seed=1)
    history: list[int] = []
    for step in range(8):
        logits = logits_for(1, seed=200 + step)
        batch = torch.cat([logits_for(1, seed=300 + step), logits, logits_for(1, seed=400 + step)]).to(device)
        alone[0].output_token_ids = crowded[1].output_token_ids = list(history)
        token = a_sampler.sample(logits, alone).token_ids[0]
        assert token == c_sampler.sample(batch, crowded).token_ids[1]
        assert token % 2 == 0
        history.append(token)


def test_sample_keeps_inputs_and_reports_rows_left_with_nothing(device: torch.device) -> None:
    """The logits are left untouched (float32 and bf16 inputs, every processor on); a row whose masks
    leave no token raises NoTokenAllowedError naming its request."""
    params = [SamplingParams(temperature=0.5, top_k=10, min_p=0.1, repetition_penalty=1.3, logit_bias={4: 3.0},
                             logprobs=2), SamplingParams(temperature=0.0, allowed_token_ids=[1, 2])]
    for dtype in (torch.float32, torch.bfloat16):
        logits = logits_for(2, seed=5).to(dtype).to(device)
        before = logits.clone()
        out = Sampler().sample(logits, make_rows(params, suppressed={0: frozenset({1, 2})},
                                                 output_token_ids={0: [3, 4]}))
        assert torch.equal(logits, before)
        assert out.token_ids[1] in (1, 2) and out.token_ids[0] in logits[0].float().topk(10).indices.tolist()
    rows = make_rows(params, suppressed={1: frozenset({1, 2})})
    rows[1].request_id = "stuck"
    with pytest.raises(NoTokenAllowedError, match="stuck"):
        Sampler().sample(logits_for(2, seed=5).to(device), rows)
