"""Logprobs, prompt logprobs and the penalties through the real engine, against transformers.

For the tiny random model and the default model (float32, the same weights in transformers), one batch
mixes plain requests with requests asking for logprobs / prompt logprobs, with chunked prefill (a
32-token budget), a shared prefix (the prefix cache) and a small KV pool (preemption). Transformers then
runs each prompt + its output once (teacher forcing), and:

- each output token's logprob, and its top-k, equal `log_softmax` of transformers' logits at that
  position (raw logprobs: before temperature / top-k / top-p, the default `logprobs_mode`);
- the prompt logprobs equal it at every prompt position (the first is None);
- with `logprobs_mode="processed_logprobs"` and temperature 1, a request's logprobs are those of its
  penalized distribution: transformers' logits with vLLM's formulas applied over the request's own
  prompt and earlier output tokens (repetition: positive logits / r, negative * r, for tokens in the
  prompt or output; frequency: - f * count in output; presence: - p if in output), plus `logit_bias`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import CORES

from troupe import LLM, RequestOutput, SamplingParams
from troupe.models.default_model import ensure_default_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the default model, transformers as the oracle

ATOL = 2e-3  # float32 troupe vs float32 transformers, different summation orders
ENGINE: dict[str, Any] = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=512, max_num_batched_tokens=32, num_threads=CORES)
PREFIX = "Here is a list of the numbers one, two, three, four, five, six, seven, eight, nine and ten. "


@pytest.fixture(scope="module", params=["tiny", "default"])
def model_dir(request: pytest.FixtureRequest, tiny_llama: Path) -> Path:
    """The tiny model, or the default model's converted folder: transformers and troupe read the same
    (dequantized) weights from it."""
    return tiny_llama if request.param == "tiny" else ensure_default_model()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(CORES)
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32: transformers' logits after each token."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def check_row(got: dict[int, Any], chosen: int, want: torch.Tensor, k: int) -> None:
    """One position's logprob dict against the log-probabilities `want` (V,): every value, the chosen
    token's rank, and k more entries that are the top-k (up to near-ties)."""
    assert chosen in got
    for t, lp in got.items():
        assert abs(lp.logprob - float(want[t])) < ATOL, (t, lp, float(want[t]))
    v = float(want[chosen])
    assert int((want > v + ATOL).sum()) + 1 <= got[chosen].rank <= int((want >= v - ATOL).sum())
    assert k <= len(got) <= k + 1
    if k:
        kth = float(want.topk(k).values[-1])
        assert all(float(want[t]) >= kth - ATOL for t in got if t != chosen)


def check_logprobs(hf: Any, out: RequestOutput, k: int, prompt_k: int | None) -> None:
    prompt = out.prompt_token_ids
    assert prompt is not None
    comp = out.outputs[0]
    logits = hf_logits(hf, prompt + comp.token_ids[:-1]).log_softmax(dim=-1)  # (P + n - 1, V)
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    for t, (tok, row) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        check_row(row, tok, logits[len(prompt) - 1 + t], k)
    assert comp.cumulative_logprob == pytest.approx(sum(r[t].logprob for t, r in zip(comp.token_ids, comp.logprobs,
                                                                                     strict=True)))
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        row = out.prompt_logprobs[j]
        assert row is not None
        check_row(row, prompt[j], logits[j - 1], prompt_k)


@pytest.fixture(scope="module")
def raw_llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), max_logprobs=-1, **ENGINE) as llm:
        yield llm


def test_logprobs_and_prompt_logprobs_equal_transformers(raw_llm: LLM, hf: Any) -> None:
    """A mixed batch (plain greedy, seeded sampling with top-k/top-p, logprobs 0/1/5, prompt logprobs),
    under chunked prefill, after a request that cached the shared prefix: every logprob and prompt logprob
    equals transformers' log-softmax on the same tokens; requests with prompt logprobs do not read the
    prefix cache (every position is computed), the plain one with the same prefix does."""
    prompts = [PREFIX + "Count on:", PREFIX + "Then the letters:", "The capital of France is",
               "Write a haiku about the sea.", PREFIX + "And back down:", "1, 2, 3,"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True,
                             logprobs=1),
              SamplingParams(temperature=1.0, seed=6, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=5, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    warm = raw_llm.generate([PREFIX + "warm"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert warm[0].finished
    outs = raw_llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        assert len(out.outputs[0].token_ids) == p.max_tokens
        if p.logprobs is None:
            assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
            assert out.prompt_logprobs is None
        else:
            check_logprobs(hf, out, p.logprobs, p.prompt_logprobs)
    assert outs[0].num_cached_tokens == 0 and outs[4].num_cached_tokens == 0
    assert outs[1].num_cached_tokens >= 16


def test_logprobs_minus_one_is_the_whole_vocabulary(raw_llm: LLM, hf: Any) -> None:
    """logprobs=-1 (allowed by max_logprobs=-1) returns the whole vocabulary, equal to transformers'."""
    out = raw_llm.generate(["The sky is"], SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1),
                           use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None
    want = hf_logits(hf, out.prompt_token_ids + comp.token_ids[:1]).log_softmax(dim=-1)
    for t, row in enumerate(comp.logprobs):
        assert len(row) == want.shape[1]
        got = torch.tensor([row[i].logprob for i in range(want.shape[1])])
        torch.testing.assert_close(got, want[len(out.prompt_token_ids) - 1 + t], atol=ATOL, rtol=0)


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties and logit_bias applied to one position's logits (V,), from scratch."""
    z = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        z[t] += b
    counts = torch.zeros_like(z)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[prompt] = True
    r = p.repetition_penalty
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    return z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.6),
    "negative": dict(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.7),
    "all_and_bias": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                         logit_bias={260: 3.0, 28: -2.0}),
}


def test_penalties_follow_their_formulas(model_dir: Path, hf: Any) -> None:
    """Each penalty (and all of them with a logit bias), sampled (temperature 1, seeded) and greedy, in one
    batch with a plain request and under preemption: the processed logprobs equal transformers' logits with
    the formula applied, and differ from the unpenalized distribution (the penalty did something)."""
    prompt = "one two three one two three one two three one two"
    cases = [(name, SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True, logprobs=4, **kw))
             for i, (name, kw) in enumerate(PENALTIES.items())]
    cases += [("greedy_" + name, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4, **kw))
              for name, kw in PENALTIES.items()]
    cases.append(("plain", SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True, logprobs=4)))
    with LLM(str(model_dir), logprobs_mode="processed_logprobs", num_kv_blocks=6, block_size=8, **ENGINE) as llm:
        outs = llm.generate([prompt] * len(cases), [p for _, p in cases], use_tqdm=False)
    for (name, p), out in zip(cases, outs, strict=True):
        comp = out.outputs[0]
        ids = out.prompt_token_ids
        assert comp.logprobs is not None and len(comp.token_ids) == 10, name
        raw = hf_logits(hf, ids + comp.token_ids[:-1])
        moved = 0.0
        for t, (tok, row) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            z = raw[len(ids) - 1 + t]
            want = penalized(z, ids, comp.token_ids[:t], p).log_softmax(dim=-1)
            check_row(row, tok, want, 4)
            moved = max(moved, float((want - z.log_softmax(dim=-1)).abs().max()))
        assert (moved > 0.1) == (name != "plain"), (name, moved)
    assert any(o.metrics is not None and o.metrics.num_preemptions > 0 for o in outs)
