"""Tiny random-weight model folders for tests and `troupe.bench.offline --random-model`: `make_tiny_model`.

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

from troupe.models.default_model import find_default_gguf
from troupe.models.gguf_tokenizer import MARKER, TOKENIZER_FILES, tokenizer_folder

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
    src = tokenizer_folder(find_default_gguf())
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    vocab = json.loads((src / MARKER).read_text())["vocab_size"]
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


_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def make_tiny_gguf(
    path: str | Path, arch: str = "llama", qtypes: dict[str, Any] | None = None, default_qtype: Any = None,
    seed: int = 0, **model_options: Any,
) -> tuple[Path, Path]:
    """A tiny random model as a GGUF file `path/model.gguf` and the matching HF folder `path/hf` with the
    exact (dequantized) weights of the file, for comparing troupe on the GGUF with transformers on the folder.

    Written as llama.cpp's converter would: GGUF names, `{arch}.*` metadata, the default model's tokenizer
    metadata, and for Llama the q/k rows interleaved per head (troupe must undo it). Each 2-D tensor takes
    `qtypes[gguf part]` (e.g. "attn_v", "token_embd"), else `default_qtype` (Q8_0); the gguf package
    quantizes what it can; formats it cannot (the K-quants) get random valid blocks, whose values the HF
    folder then holds. K-quants need widths that are multiples of 256 (pass e.g. hidden=256).
    """
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from troupe.kernels.quant import QType, QuantizedTensor, random_quantized

    out = Path(path)
    hf = make_tiny_model(out / "hf", arch=arch, seed=seed, **model_options)
    cfg = json.loads((hf / "config.json").read_text())
    weights = load_file(hf / "model.safetensors")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out / "model.gguf", arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    meta = add_default_tokenizer(writer)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # llama.cpp writes Llama 3 scaling as per-frequency divisors
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg["head_dim"], cfg["rope_theta"], scaling))
    g = torch.Generator().manual_seed(seed + 1)
    exact: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            layer, part = base[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{_PARTS[part]}"
        else:
            gname = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[base]
        permute = arch == "llama" and gname.endswith(("attn_q", "attn_k"))
        n_head = heads if gname.endswith("attn_q") else kv_heads
        if permute:  # llama.cpp's convert_hf_to_gguf `permute`
            w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if w.dim() == 1:
            writer.add_tensor(f"{gname}.{suffix}", w.float().numpy())
            values = w.float()
        else:
            qtype = QType((qtypes or {}).get(gname.split(".")[-1], default_qtype or QType.Q8_0))
            if qtype == QType.F32:
                raw, values = w.float().numpy(), w.float()
            elif qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K):
                q = random_quantized(qtype, w.shape[0], w.shape[1], g, scale=float(w.std()) / 4)
                assert isinstance(q, QuantizedTensor)
                raw, values = q.data.numpy(), q.dequantize()
            else:
                raw = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(int(qtype)))
                data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(w.shape[0], -1)
                values = QuantizedTensor(qtype, data, (w.shape[0], w.shape[1])).dequantize()
            writer.add_tensor(f"{gname}.{suffix}", raw, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        if permute:  # the HF folder holds the file's values in HF's row order
            values = values.reshape(n_head, values.shape[0] // n_head // 2, 2, *values.shape[1:]).swapaxes(1, 2)
            values = values.reshape(w.shape)
        exact[name] = values.contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(exact, hf / "model.safetensors", metadata={"format": "pt"})
    return out / "model.gguf", hf


def add_default_tokenizer(writer: Any) -> dict[str, Any]:
    """Write the default model's GGUF tokenizer (model, pre-tokenizer, tokens, merges, types) into a
    `gguf.GGUFWriter`: the tiny GGUFs share its vocabulary. Returns that GGUF's metadata."""
    from troupe.models.gguf_file import GGUFFile

    with GGUFFile(find_default_gguf()) as src:
        meta = src.metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    return dict(meta)


def _llama3_rope_factors(head_dim: int, theta: float, sc: dict[str, Any]) -> Any:
    """convert_hf_to_gguf's `rope_freqs` for Llama 3 scaling: 1 for high frequencies, `factor` for low
    ones, the smooth blend in between (float32, head_dim / 2)."""
    import math

    import numpy as np

    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def make_transformers_model(path: str | Path, config_class: str, seed: int = 1, **config: Any) -> Path:
    """A tiny random-weight model of any family transformers knows, as an HF folder at `path` with the
    default model's tokenizer files: `config_class` (e.g. "Qwen3Config") built with `config`, every weight
    drawn from N(0, 0.1) with `seed` (norms around their neutral value: 1, or 0 for Gemma's (1 + w)), saved
    by transformers itself. Imports transformers (seconds); `make_tiny_model` does not."""
    import torch
    import transformers

    cfg = getattr(transformers, config_class)(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    neutral = 0.0 if "gemma" in config_class.lower() else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(neutral + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    out = Path(path)
    model.save_pretrained(out)
    src = tokenizer_folder(find_default_gguf())
    for fname in TOKENIZER_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, out / fname)
    return out

