"""GGUF models: the architecture from a GGUF file's metadata, and its weights under HF names, kept in their
block formats (`troupe.kernels.quant.QuantizedTensor`) or expanded to float32.

1. `gguf_config(metadata, tensor_names)` turns llama.cpp's keys (`llama.block_count`, `qwen2.rope.freq_base`,
   ...) into the HF `config.json` dict the same model would have, so `ModelArch.from_hf_config` checks it
   like any folder's; Llama 3 files carry their rope scaling as a `rope_freqs` tensor of per-frequency
   divisors, which `gguf_arch` puts into the arch (`rope_scaling = {"rope_type": "factors", ...}`).
2. `GGUFWeights.get(hf_name, shape)` finds the GGUF tensor (`blk.3.attn_q.weight` for
   `model.layers.3.self_attn.q_proj.weight`), checks its shape and returns it: F32 as a float32 tensor,
   the formats in `QType` as a `QuantizedTensor` of the file's bytes (or, with `dequantize=True`, expanded
   to float32: the reference mode), any other GGML type expanded by the gguf package with one warning.
3. llama.cpp's converter permutes the rows of Llama's q and k projections (pairs interleaved per head, for
   its rotary); `get` undoes it, for a quantized weight by moving whole block rows (nothing is expanded).
   Qwen2 files are not permuted (llama.cpp rotates them in the HF layout).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from troupe.errors import ModelLoadError
from troupe.kernels.quant import QType, QuantizedTensor, Weight
from troupe.models.arch import ModelArch
from troupe.models.gguf_file import GGUFFile

log = structlog.get_logger("troupe.models")

KEPT_TYPES = frozenset(int(q) for q in QType)  # GGML types a weight stays in
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
PERMUTED_ARCHITECTURES = ("llama",)  # llama.cpp's converter interleaves their q/k rows

LAYER_NAMES = {  # GGUF block tensor -> HF module, under blk.N / model.layers.N
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
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; names outside the map pass through."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{LAYER_NAMES.get(part, part)}.{suffix}"
    return f"{GLOBAL_NAMES.get(base, base)}.{suffix}"


def gguf_config(meta: dict[str, Any], tensor_names: set[str], where: str = "GGUF") -> dict[str, Any]:
    """The HF config dict of a GGUF file's model (see the module docstring)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{where}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    architecture, model_type = GGUF_ARCHITECTURES[arch]
    p = f"{arch}."

    def need(key: str) -> Any:
        if p + key not in meta:
            raise ModelLoadError(f"{where}: metadata key {p + key!r} is missing")
        return meta[p + key]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
    rotary = int(meta.get(p + "rope.dimension_count") or head_dim)
    if rotary != head_dim:
        raise ModelLoadError(f"{where}: partial rotary ({rotary} of {head_dim} dims) is not supported")
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{where}: rope scaling {scaling!r} is not supported (none, linear)")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(p + "context_length") or 2048),
        # GGUF stores eps as float32 (9.9999997e-06): give back the decimal it came from
        "rms_norm_eps": float(f"{need('attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": ({"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
                         if scaling == "linear" else None),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": int(meta.get(p + "vocab_size") or len(tokens)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def gguf_arch(file: GGUFFile) -> tuple[dict[str, Any], ModelArch]:
    """(HF config dict, checked `ModelArch`) of an open GGUF file."""
    where = str(file.path)
    cfg = gguf_config(file.metadata, set(file.tensors), where)
    arch = ModelArch.from_hf_config(cfg, where=where)
    if "rope_freqs.weight" in file.tensors:  # Llama 3 rope scaling, precomputed by the converter
        factors = _dense(file, "rope_freqs.weight").double()
        if factors.numel() != arch.head_dim // 2:
            raise ModelLoadError(f"{where}: rope_freqs has {factors.numel()} values, expected {arch.head_dim // 2}")
        arch = dataclasses.replace(arch, rope_scaling={"rope_type": "factors", "factors": factors.tolist()})
    return cfg, arch


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end generation: the eos token, then llama.cpp's end-of-turn / end-of-message ones."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return list(dict.fromkeys(int(meta[k]) for k in keys if meta.get(k) is not None))


class GGUFWeights:
    """HF name -> the file's tensor (see the module docstring); `dequantize=True` expands every one."""

    def __init__(self, file: GGUFFile, arch: ModelArch, dequantize: bool = False) -> None:
        self.file = file
        self.arch = arch
        self.dequantize = dequantize
        self.permuted = file.metadata.get("general.architecture") in PERMUTED_ARCHITECTURES
        self._names = {hf_name(n): n for n in file.tensors}
        self._warned: set[int] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        if name not in self._names:
            raise ModelLoadError(f"{self.file.path}: tensor for {name!r} is missing")
        gname = self._names[name]
        info = self.file.tensors[gname]
        if info.shape != tuple(shape):
            raise ModelLoadError(f"{self.file.path}: tensor {gname!r} has shape {list(info.shape)}, "
                                 f"the model's metadata implies {list(shape)}")
        w = self._read(gname)
        if self.permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = self.arch.num_heads if ".q_proj." in name else self.arch.num_kv_heads
            order = unpermute_order(shape[0], heads)
            w = w.permute_rows(order) if isinstance(w, QuantizedTensor) else w[order].contiguous()
        return w

    def _read(self, gname: str) -> Weight:
        info = self.file.tensors[gname]
        if len(info.shape) != 2 or info.ggml_type == QType.F32 or self.dequantize:
            return _dense(self.file, gname)
        if info.ggml_type not in KEPT_TYPES:
            return _dense(self.file, gname, self._warned)
        qtype = QType(info.ggml_type)
        # (N, row_bytes); shaped before it becomes a tensor: a view would keep this buffer alive through its
        # base after a kernel set moves the view's storage elsewhere (troupe.kernels.cpu.arena)
        data = torch.from_numpy(self.file.raw(gname).copy().reshape(info.shape[0], -1))
        return QuantizedTensor(qtype, data, (info.shape[0], info.shape[1]))


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's per-head interleaving of rotary pairs: row `h*R + j*R/2 + i` of
    the HF layout is row `h*R + 2i + j` of the file (R = rows / heads)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _dense(file: GGUFFile, gname: str, warned: set[int] | None = None) -> torch.Tensor:
    """Tensor `gname` expanded to float32, torch shape."""
    info = file.tensors[gname]
    raw = file.raw(gname)
    if info.ggml_type in KEPT_TYPES:
        qtype = QType(info.ggml_type)
        cols = info.shape[-1]
        rows = raw.size // qtype.row_bytes(cols)
        data = torch.from_numpy(raw.copy()).reshape(rows, -1)
        from troupe.kernels.quant import dequantize

        return dequantize(data, qtype, cols).reshape(info.shape)
    import gguf

    if warned is not None and info.ggml_type not in warned:
        warned.add(info.ggml_type)
        log.warning("GGUF tensor format not kept: expanded to float32 at load", path=str(file.path),
                    tensor=gname, ggml_type=gguf.GGMLQuantizationType(info.ggml_type).name)
    try:
        values = gguf.quants.dequantize(raw.reshape(-1, raw.size // max(1, int(np.prod(info.shape[:-1])))),
                                        gguf.GGMLQuantizationType(info.ggml_type))
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{file.path}: tensor {gname!r} is in a format troupe cannot read ({e})") from e
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)
