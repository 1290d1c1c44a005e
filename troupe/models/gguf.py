"""GGUF models: the architecture from a GGUF file's metadata, and its weights under HF names, kept in their
block formats (`troupe.kernels.quant.QuantizedTensor`) or expanded to float32.

1. `gguf_config(metadata, tensor_names)` (`troupe.models.gguf_config`) turns llama.cpp's keys into the HF
   `config.json` dict the same model would have, so `ModelArch.from_hf_config` checks it like any folder's
   (GGUF architectures `llama`, `qwen2`, `qwen3`, `phi3`, `gemma2`, `gemma3`, `qwen2moe`, `qwen3moe`,
   `olmo2`, `granite`).
2. `gguf_arch(file)` adds what only the tensors say: Llama 3's rope scaling as a `rope_freqs` tensor of
   per-frequency divisors (`rope_scaling = {"rope_type": "factors", ...}`), Phi-3's longrope factors
   (`rope_factors_long` / `rope_factors_short`); and two facts of llama.cpp's layout: Gemma's norm weights
   already hold the `1 +` of Gemma's RMSNorm (the converter adds it), so the arch's `norm_offset` is 0;
   Phi-3's fused projections are served split (`fused_checkpoint` off, below).
3. `GGUFWeights.get(hf_name, shape)` finds the GGUF tensor (`blk.3.attn_q.weight` for
   `model.layers.3.self_attn.q_proj.weight`; the names per architecture in `layer_names`), checks its shape
   and returns it: F32 as a float32 tensor, the formats in `QType` as a `QuantizedTensor` of the file's bytes
   (or, with `dequantize=True`, expanded to float32: the reference mode), any other GGML type expanded by
   the gguf package with one warning. A fused `attn_qkv` (Phi-3) is served as q/k/v and a fused `ffn_up`
   without an `ffn_gate` as gate/up (its first and second half), row slices of the blocks. A mixture of
   experts' `ffn_*_exps` tensor (E, rows, cols) is served per expert (`model.layers.N.mlp.experts.e.*`).
   Kept blocks are not read at load: they are views of the file's pages (`GGUFFile.mapped`, read-only),
   each expert's rows contiguous in the file; a kernel set that wants them elsewhere (the cpu set's arena,
   a GPU) copies them when the model binds, and the experts stay mapped on the cpu set (docs/models.md,
   "Memory").
4. llama.cpp's converter permutes the rows of Llama's (and Granite's) q and k projections (pairs interleaved per head, for
   its rotary); `get` undoes it, for a quantized weight by moving whole block rows (nothing is expanded).
   The other architectures are not permuted (llama.cpp rotates them in the HF layout). A partial rotary
   embedding (Phi-4-mini) gets q and k expanded to float32: the model reorders their rows per head.
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
from troupe.models.gguf_config import (
    GEMMA_ARCHITECTURES,
    PERMUTED_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    gguf_config,
)
from troupe.models.gguf_file import GGUFFile

log = structlog.get_logger("troupe.models")

KEPT_TYPES = frozenset(int(q) for q in QType)  # GGML types a weight stays in
ARCH_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # read into the arch

LAYER_NAMES = {  # GGUF block tensor -> HF module, under blk.N / model.layers.N
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
POST_LAYER_NAMES = {  # Gemma's sandwich / OLMo 2's post norms: llama.cpp's ffn_norm is the norm before the MLP
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def layer_names(arch: str) -> dict[str, str]:
    """GGUF block tensor -> HF module of GGUF architecture `arch`."""
    return POST_LAYER_NAMES if arch in POST_NORM_ARCHITECTURES else LAYER_NAMES


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; names outside the map pass through."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{layer_names(arch).get(part, part)}.{suffix}"
    return f"{GLOBAL_NAMES.get(base, base)}.{suffix}"


def gguf_arch(file: GGUFFile) -> tuple[dict[str, Any], ModelArch]:
    """(HF config dict, checked `ModelArch`) of an open GGUF file (see the module docstring, 2)."""
    where = str(file.path)
    cfg = gguf_config(file.metadata, set(file.tensors), where)
    if "rope_factors_long.weight" in file.tensors:  # longrope (Phi-3; gguf_config checked the pair)
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _dense(file, "rope_factors_long.weight").double().tolist(),
            "short_factor": _dense(file, "rope_factors_short.weight").double().tolist(),
            "original_max_position_embeddings": cfg["original_max_position_embeddings"],
        }
        attn_factor = file.metadata.get(f"{file.metadata['general.architecture']}.rope.scaling.attn_factor")
        if attn_factor is not None:
            cfg["rope_scaling"]["attention_factor"] = float(attn_factor)
    arch = ModelArch.from_hf_config(cfg, where=where)
    if file.metadata.get("general.architecture") in GEMMA_ARCHITECTURES:  # the file's norms hold 1 + w
        arch = dataclasses.replace(arch, norm_offset=0.0)
    if arch.fused_checkpoint:  # GGUFWeights serves the fused tensors' parts
        arch = dataclasses.replace(arch, fused_checkpoint=False)
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Source:
    """Where an HF tensor lives: GGUF tensor `gname`, or its rows `part` of the fused tensor split `split`,
    or expert `expert` of a tensor of all the layer's experts (E, rows, cols)."""

    gname: str
    split: tuple[str, ...] = ()  # the fused tensor's parts, in row order ("q", "k", "v" / "gate", "up")
    part: int = 0
    expert: int = -1


EXPERT_TENSORS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                  "ffn_down_exps": ("down_proj", "w2")}  # GGUF -> HF (Qwen MoE, Mixtral) expert projection
MOE_TENSORS = {"ffn_gate_inp": "gate", "ffn_gate_inp_shexp": "shared_expert_gate",
               "ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
               "ffn_down_shexp": "shared_expert.down_proj"}  # GGUF -> HF module under the layer's MLP block


def _moe_sources(name: str, block: str, part: str, suffix: str, arch: ModelArch) -> dict[str, _Source]:
    """The HF names a mixture-of-experts tensor of layer `block` (`blk.N`) serves: one per expert of an
    `ffn_*_exps` tensor, one for the router and the shared expert's tensors; {} for any other tensor."""
    mixtral = arch.expert_naming == "mixtral"
    layer = f"model.layers.{block[4:]}." + ("block_sparse_moe." if mixtral else "mlp.")
    if part in EXPERT_TENSORS:
        proj = EXPERT_TENSORS[part][1 if mixtral else 0]
        return {f"{layer}experts.{e}.{proj}.{suffix}": _Source(name, expert=e) for e in range(arch.num_experts)}
    if part in MOE_TENSORS:
        return {f"{layer}{MOE_TENSORS[part]}.{suffix}": _Source(name)}
    return {}


class GGUFWeights:
    """HF name -> the file's tensor (see the module docstring); `dequantize=True` expands every one."""

    def __init__(self, file: GGUFFile, arch: ModelArch, dequantize: bool = False) -> None:
        self.file = file
        self.arch = arch
        self.dequantize = dequantize
        gguf_arch = str(file.metadata.get("general.architecture"))
        self.permuted = gguf_arch in PERMUTED_ARCHITECTURES
        self.dense_qk = arch.rotary_dim not in (0, arch.head_dim)  # the model reorders q/k rows per head
        self._sources: dict[str, _Source] = {}
        for n in file.tensors:
            base, _, suffix = n.rpartition(".")
            block, _, part = base.rpartition(".")
            moe = _moe_sources(n, block, part, suffix, arch) if arch.num_experts and block.startswith("blk.") else {}
            if moe:
                self._sources.update(moe)
            elif block.startswith("blk.") and part == "attn_qkv":
                layer = f"model.layers.{block[4:]}.self_attn."
                for i, proj in enumerate(("q", "k", "v")):
                    self._sources[f"{layer}{proj}_proj.{suffix}"] = _Source(n, ("q", "k", "v"), i)
            elif block.startswith("blk.") and part == "ffn_up" and f"{block}.ffn_gate.{suffix}" not in file.tensors:
                layer = f"model.layers.{block[4:]}.mlp."
                for i, proj in enumerate(("gate", "up")):
                    self._sources[f"{layer}{proj}_proj.{suffix}"] = _Source(n, ("gate", "up"), i)
            else:
                self._sources[hf_name(n, gguf_arch)] = _Source(n)
        self._fused: tuple[str, Weight] | None = None  # the last fused tensor read, for its next parts
        self._experts: dict[str, torch.Tensor] = {}  # expert tensors mapped so far, (E, rows, row_bytes) each
        self._warned: set[int] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        if name not in self._sources:
            raise ModelLoadError(f"{self.file.path}: tensor for {name!r} is missing")
        src = self._sources[name]
        if src.expert >= 0:
            w = self._expert(src, shape)
        else:
            w = self._part(src, shape) if src.split else self._whole(src.gname, shape)
        is_qk = name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"))
        if self.permuted and is_qk:
            heads = self.arch.num_heads if ".q_proj." in name else self.arch.num_kv_heads
            order = unpermute_order(shape[0], heads)
            w = w.permute_rows(order) if isinstance(w, QuantizedTensor) else w[order].contiguous()
        if self.dense_qk and is_qk and isinstance(w, QuantizedTensor):
            w = w.dequantize()
        return w

    def unused(self, requested: set[str]) -> list[str]:
        """The file's tensors that no name in `requested` was read from (those read into the arch aside)."""
        used = {src.gname for name, src in self._sources.items() if name in requested}
        return sorted(n for n in self.file.tensors if n not in used and n not in ARCH_TENSORS)

    def _whole(self, gname: str, shape: tuple[int, ...]) -> Weight:
        info = self.file.tensors[gname]
        if info.shape != tuple(shape):
            raise ModelLoadError(f"{self.file.path}: tensor {gname!r} has shape {list(info.shape)}, "
                                 f"the model's metadata implies {list(shape)}")
        return self._read(gname)

    def _part(self, src: _Source, shape: tuple[int, ...]) -> Weight:
        """Rows of a fused tensor: q | k | v (q_size, kv_size, kv_size) or gate | up (f, f)."""
        a = self.arch
        sizes = [a.q_size, a.kv_size, a.kv_size] if src.split[0] == "q" else [a.intermediate_size] * 2
        fused = self._fused[1] if self._fused is not None and self._fused[0] == src.gname else None
        if fused is None:
            fused = self._whole(src.gname, (sum(sizes), *shape[1:]))
            self._fused = (src.gname, fused)
        start = sum(sizes[:src.part])
        stop = start + sizes[src.part]
        if isinstance(fused, QuantizedTensor):
            return QuantizedTensor(fused.qtype, fused.data[start:stop].contiguous(), (stop - start, fused.shape[1]))
        return fused[start:stop].contiguous()

    def _expert(self, src: _Source, shape: tuple[int, ...]) -> Weight:
        """Expert `src.expert`'s (rows, cols) of a (E, rows, cols) tensor: its blocks mapped from the file (a
        view, nothing copied); F32 and the formats troupe does not keep expanded once for all the experts."""
        info = self.file.tensors[src.gname]
        if info.shape != (self.arch.num_experts, *shape):
            raise ModelLoadError(f"{self.file.path}: tensor {src.gname!r} has shape {list(info.shape)}, the model's "
                                 f"metadata implies {[self.arch.num_experts, *shape]}")
        rows, cols = shape
        if info.ggml_type in KEPT_TYPES and info.ggml_type != QType.F32 and not self.dequantize:
            if src.gname not in self._experts:  # one mapping for all its experts
                self._experts[src.gname] = self.file.mapped(src.gname, (self.arch.num_experts, rows, -1))
            data = self._experts[src.gname][src.expert]  # (rows, row_bytes): the file's pages, contiguous per expert
            return QuantizedTensor(QType(info.ggml_type), data, (rows, cols))
        if self._fused is None or self._fused[0] != src.gname:  # expanded once for all its experts
            self._fused = (src.gname, _dense(self.file, src.gname, self._warned))
        whole = self._fused[1]
        assert isinstance(whole, torch.Tensor)
        return whole[src.expert].clone()

    def _read(self, gname: str) -> Weight:
        info = self.file.tensors[gname]
        if len(info.shape) != 2 or info.ggml_type == QType.F32 or self.dequantize:
            return _dense(self.file, gname)
        if info.ggml_type not in KEPT_TYPES:
            return _dense(self.file, gname, self._warned)
        qtype = QType(info.ggml_type)
        data = self.file.mapped(gname, (info.shape[0], -1))  # (N, row_bytes): the file's pages, not a copy
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
