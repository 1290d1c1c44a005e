"""Tiny random-weight model folders for tests (everyone's): `make_tiny_model`.

The folder is a real HF folder (config.json, model.safetensors with HF weight names, generation_config.json)
with the default model's tokenizer files copied in (vocab 49152, chat template, real text), so anything
that loads a model folder can be tested in well under a second without the 135M weights. It is written
without importing transformers (several seconds to import here); tests/models/test_models.py checks that
transformers reads these folders as the same model. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from troupe.models.default_model import ensure_default_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    eos_token_id: int | list[int] = 2,
    init_std: float = 0.1,
    dtype: str = "float32",
    device: str = "cpu",
    **config_overrides: Any,
) -> Path:
    """Write a random-weight `arch` model folder at `path` (created) and return it.

    `init_std` is larger than HF's usual 0.02 so that different inputs give clearly different logits;
    norms are drawn around 1 and biases (Qwen2) around 0, so loading them is tested too. `dtype`
    ("float32" or "bfloat16") is what the weights are stored in (bfloat16 halves a large model's file);
    `device` is where they are drawn (a GPU draws a large model's in moments; other numbers than the
    CPU's for the same seed). Extra keyword arguments go into config.json as they are.
    """
    import torch
    from safetensors.torch import save_file

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    src = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    head_dim = hidden // heads
    config: dict[str, Any] = {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": eos_token_id,
        "pad_token_id": 2,
        "torch_dtype": dtype,
        **({"sliding_window": None} if arch in ("mistral", "qwen2") else {}),
        **config_overrides,
    }
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, device=device) * init_std + mean
        return x.to(getattr(torch, dtype)).cpu()

    q, kv = heads * head_dim, kv_heads * head_dim
    w = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden, mean=1.0)}
    if not tie:
        w["lm_head.weight"] = rand(vocab, hidden)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": rand(hidden, mean=1.0),
            p + "post_attention_layernorm.weight": rand(hidden, mean=1.0),
            p + "self_attn.q_proj.weight": rand(q, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
        }
        if arch == "qwen2":
            w |= {p + f"self_attn.{n}_proj.bias": rand(size) for n, size in (("q", q), ("k", kv), ("v", kv))}
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": eos_token_id, "pad_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
