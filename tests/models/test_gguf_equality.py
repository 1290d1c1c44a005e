"""The default configuration on the default model (issue 13 item 4): troupe as shipped — kernels "auto"
(the compiled cpu set here), quantization "auto" (the GGUF's Q4_1 / Q8_0 blocks kept: the output-exact
`gguf`, or `gguf-bf16` on a CPU with AMX, issue 41), the set's default float16 KV pool — gives
transformers' greedy tokens on the same weights (the GGUF expanded to float32, `ensure_default_model()`).
test_hf_equality holds the `gguf` mode itself to the same bar on more configurations.

The 16 prompts of test_hf_equality (5..300 tokens) run together, 32 new tokens each: once in one EngineCore
(chunked prefill, mixed steps, the configuration checked on its runner), once through `LLM` (the engine in
its own process). At least 90% of the sequences must equal transformers' exactly, and every divergence
must be a near-tie: at the first differing position, transformers' logit for its own token exceeds its
logit for troupe's token by less than NEAR_TIE (troupe's pick is transformers' runner-up by a hair, a
float32 summation-order effect, not a wrong weight).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from factories import CORES
from test_hf_equality import LENGTHS, NEW_TOKENS, Oracle, hf_oracle, make_prompts, run_troupe

from troupe.config import EngineConfig
from troupe.kernels.cpu import build
from troupe.kernels.quant import QuantizedTensor
from troupe.models.default_model import ensure_default_model
from troupe.models.loader import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # transformers and the engine on the default model
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


def check(want: list[list[int]], got: list[list[int]], logits: list[torch.Tensor], where: str) -> None:
    """>= 90% of sequences equal, every divergence a near-tie; prints the figure."""
    assert all(len(g) == NEW_TOKENS for g in got)
    found = divergences(want, got, logits)
    exact = len(got) - len(found)
    print(f"{where}: {exact}/{len(got)} sequences equal transformers' over {NEW_TOKENS} tokens; "
          f"divergences (prompt, position, logit gap): {found}")
    assert exact / len(got) >= 0.9, found
    assert all(gap < NEAR_TIE for _, _, gap in found), found


BOUNDS: dict[str, Any] = dict(max_model_len=2048, num_threads=CORES, max_num_batched_tokens=512, num_kv_blocks=512)


@pytest.fixture(scope="module")
def oracle(prompts: list[list[int]]) -> Oracle:
    return hf_oracle(ensure_default_model(), prompts)  # shared with test_hf_equality (one HF run)


def test_gguf_blocks_give_transformers_greedy_tokens(prompts: list[list[int]], oracle: Oracle) -> None:
    """In one EngineCore with mixed steps, the default configuration computes on the blocks with the cpu
    set and a float16 pool, and gives transformers' greedy tokens (>= 90% equal, divergences near-ties)."""
    got, core, mixed = run_troupe(EngineConfig(**BOUNDS), prompts)
    runner = core.runner
    assert runner.kernels.name == "cpu" and runner.kv_caches[0][0].dtype == torch.float16
    assert runner.model is not None and isinstance(runner.model.layers[0].qkv_w, QuantizedTensor)
    assert mixed > 0, "no step mixed prefill chunks with decode tokens"
    check(oracle.tokens, got, oracle.logits, "EngineCore, defaults")


def test_llm_defaults_give_transformers_greedy_tokens(prompts: list[list[int]], oracle: Oracle) -> None:
    """The same through `LLM()` with its defaults (the engine in its own process)."""
    from troupe import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(**BOUNDS) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check(oracle.tokens, [list(o.outputs[0].token_ids) for o in outs], oracle.logits, "LLM, defaults")
