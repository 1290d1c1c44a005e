"""Output-exact mode on the default model: troupe computing on the GGUF's Q4_1 / Q8_0 blocks with the
compiled kernels (quantization="gguf", kernels="cpu") gives transformers' greedy tokens on the same weights
(the GGUF expanded to float32, `ensure_default_model()`).

The 16 prompts of test_hf_equality (5..300 tokens) run together in one EngineCore (chunked prefill, mixed
steps), 32 new tokens each. At least 90% of the sequences must equal transformers' exactly, and every
divergence must be a near-tie: at the first differing position, transformers' logit for its own token
exceeds its logit for troupe's token by less than NEAR_TIE (troupe's pick is transformers' runner-up by a
hair, a float32 summation-order effect, not a wrong weight).
"""

from __future__ import annotations

import pytest
import torch
from test_hf_equality import LENGTHS, NEW_TOKENS, hf_oracle, make_prompts, run_troupe

from troupe.config import EngineConfig
from troupe.kernels.cpu import build
from troupe.models.default_model import ensure_default_model
from troupe.models.loader import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                       reason="no AVX2/FMA/F16C CPU or no C++ compiler here"),
]

NEAR_TIE = 0.1  # logits


def divergences(want: list[list[int]], got: list[list[int]], logits: list[torch.Tensor]) -> list[tuple[int, int, float]]:
    """(prompt, first differing position, transformers' logit gap between its token and troupe's)."""
    out = []
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w != g:
            k = next(j for j in range(NEW_TOKENS) if w[j] != g[j])
            out.append((i, k, float(logits[i][k, w[k]] - logits[i][k, g[k]])))
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(load_tokenizer(ensure_default_model()), LENGTHS)


def test_gguf_blocks_give_transformers_greedy_tokens(prompts: list[list[int]]) -> None:
    """quantization="gguf" on the compiled kernels: >= 90% of sequences equal, every divergence a near-tie."""
    oracle = hf_oracle(ensure_default_model(), prompts)  # shared with test_hf_equality (one HF run)
    want, logits = oracle.tokens, oracle.logits
    config = EngineConfig(kernels="cpu", quantization="gguf", max_model_len=2048, num_threads=2,
                          max_num_batched_tokens=512, block_size=16, num_kv_blocks=512)
    got, _, mixed = run_troupe(config, prompts)
    assert mixed > 0, "no step mixed prefill chunks with decode tokens"
    assert all(len(g) == NEW_TOKENS for g in got)
    found = divergences(want, got, logits)
    exact = len(prompts) - len(found)
    print(f"gguf mode: {exact}/{len(prompts)} sequences equal; divergences (prompt, position, gap): {found}")
    assert exact / len(prompts) >= 0.9, found
    assert all(gap < NEAR_TIE for _, _, gap in found), found

