"""Model families on the `cuda` kernel set under the Triton interpreter (`kernels="cuda", device="cpu"`):
a tiny Gemma 2 (sliding window on one layer, attention and final soft-capping, sandwich norms, GELU-tanh)
a tiny Qwen3 (q/k head norms) and a tiny Qwen2-MoE (8 experts, top-2, a gated shared expert) generate the eager set's greedy tokens, which tests/models/test_families.py
checks against transformers. Kept small: the interpreter runs each program in Python."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import engine_greedy

from troupe.config import EngineConfig
from troupe.models.tiny import make_transformers_model

SMALL = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
MODELS = {
    "gemma2": ("Gemma2Config", dict(sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=5.0)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64)),
}
PROMPTS = [[(5 * i + n) % 3000 + 10 for i in range(n)] for n in (4, 11)]  # the second runs past the window of 6


def greedy(folder: Path, kernels: str) -> list[list[int]]:
    return engine_greedy(EngineConfig(model=str(folder), dtype="float32", kernels=kernels, device="cpu", block_size=4,
                                      num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=8, num_threads=1,
                                      enforce_eager=True), PROMPTS, 3)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_family_on_the_cuda_set_generates_the_eager_tokens(name: str, tmp_path: Path, device: torch.device) -> None:
    cls, extra = MODELS[name]
    folder = make_transformers_model(tmp_path / name, cls, **{**SMALL, **extra})
    want = greedy(folder, "eager")
    assert greedy(folder, "cuda") == want and all(len(t) == 3 for t in want)
