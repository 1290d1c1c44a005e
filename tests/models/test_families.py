"""Every model family against transformers: tiny random-weight models built here from transformers configs
(no download), saved as HF folders with the default model's tokenizer, generate transformers' greedy
tokens in float32 for several prompts in one engine batch, on the eager and the compiled cpu kernel sets
(its KV pool in float32, so the comparison is exact).

Weights are drawn with a fixed seed, wider than transformers' init (std 0.1; norms around their neutral
value) so that different inputs give clearly different logits and every norm is loaded for real. Prompts
of 5 to 70 tokens, and windows of 16, so several prompts are longer than the sliding windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from factories import engine_greedy, transformers_greedy

from troupe.config import EngineConfig
from troupe.models.tiny import make_transformers_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 8
def prompts(*lengths: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % 4000 + 10 for i in range(n)] for n in lengths]


PROMPTS = prompts(5, 17, 40, 70)
# longrope: troupe rotates positions below original_max_position_embeddings (32 here) with the short
# factors and the rest with the long ones; transformers' Phi-3 rotates a sequence longer than that with the
# long factors throughout (recomputing its cache when a sequence grows past it): equal while sequences stay
# within it, as these do (prompt + 8 new tokens <= 32); test_long_positions_rotate_with_the_long_factors
PROMPTS_OF = {"phi3-partial-longrope": prompts(5, 12, 17, 24)}
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)

# name: (transformers config class, its arguments over SMALL); dynamic NTK scales the base once, from
# max_model_len (as vLLM): the engine runs it at 512, where transformers does not scale either
ENGINE = {"llama-dynamic": {"max_model_len": 512}}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                      logits_scaling=2.5)),
    "phi3": ("Phi3Config", {}),
    "phi3-partial-longrope": ("Phi3Config", dict(
        partial_rotary_factor=0.5, max_position_embeddings=256, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": 32,
                         "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    "mistral-window": ("MistralConfig", dict(sliding_window=16)),
    "qwen2-window": ("Qwen2Config", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1)),
    "qwen3-window": ("Qwen3Config", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1)),
    "phi3-window": ("Phi3Config", dict(sliding_window=16)),
    "gemma2": ("Gemma2Config", dict(sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=5.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=16, query_pre_attn_scalar=24, sliding_window_pattern=2,
                                        tie_word_embeddings=True, rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0}})),
    # mixtures of experts: 8 experts, top-2 (Qwen2-MoE with its gated shared expert; Qwen3-MoE's second layer dense)
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    "llama-yarn": ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 128})),
    "llama-dynamic": ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "factor": 2.0})),
}


def build(name: str, folder: Path) -> Path:
    """The tiny `name` model as an HF folder (weights drawn with a fixed seed; see the module docstring)."""
    cls, extra = FAMILIES[name]
    return make_transformers_model(folder, cls, **{**SMALL, **extra})


def hf_greedy(folder: Path, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return transformers_greedy(model, batch, NEW_TOKENS)


def troupe_greedy(folder: Path, kernels: str, batch: list[list[int]], **options: Any) -> list[list[int]]:
    """All prompts in one engine, chunked prefill (32-token budget) mixing prefills with decodes."""
    kv = "float32" if kernels == "cpu" else "auto"
    return engine_greedy(EngineConfig(model=str(folder), dtype="float32", kernels=kernels, kv_cache_dtype=kv,
                                      num_kv_blocks=128, block_size=4, max_num_batched_tokens=32, num_threads=1,
                                      **options), batch, NEW_TOKENS)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[list[int]]]:
    """(name, folder, transformers' greedy tokens) of one family, built once per module."""
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, hf_greedy(folder, PROMPTS_OF.get(request.param, PROMPTS))


@pytest.mark.parametrize("kernels", ["eager", "cpu"])
def test_greedy_equals_transformers(family: tuple[str, Path, list[list[int]]], kernels: str) -> None:
    name, folder, want = family
    assert troupe_greedy(folder, kernels, PROMPTS_OF.get(name, PROMPTS), **ENGINE.get(name, {})) == want


def test_long_positions_rotate_with_the_long_factors(tmp_path: Path) -> None:
    """Past original_max_position_embeddings troupe's longrope table is transformers' long-factor rotation
    (cos and sin, attention factor included); below it, the short one; partial rotary dims pass unturned."""
    import json

    from transformers import AutoModelForCausalLM

    from troupe.models.arch import ModelArch
    from troupe.models.rope import rope_table

    folder = build("phi3-partial-longrope", tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.rotary_emb
    arch = ModelArch.from_hf_config(json.loads((folder / "config.json").read_text()))
    table = rope_table(arch.rope, arch.head_dim, 256, arch.max_position_embeddings)  # (256, 16): cos | sin
    for pos in (0, 31, 32, 100, 255):
        cos, sin = hf(torch.zeros(1, 1, arch.head_dim), torch.tensor([[pos]]))  # (1, 1, 8): rotary dims only
        torch.testing.assert_close(table[pos, :4], cos[0, 0, :4])
        torch.testing.assert_close(table[pos, 8:12], sin[0, 0, :4])
        assert table[pos, 4:8].eq(1).all() and table[pos, 12:].eq(0).all()
