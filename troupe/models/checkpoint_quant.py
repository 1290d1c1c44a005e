"""Quantized HF checkpoints: which format a folder's `quantization_config` names, and its weights turned into
what troupe computes with.

1. `read_quant_scheme(folder, cfg)` reads config.json's `quantization_config` (else an AutoGPTQ
   `quantize_config.json`): `None` (plain weights), an `Fp8Scheme`, a `GptqScheme` or an `AwqScheme`. Any
   other `quant_method`, or a variant of these three troupe does not compute exactly, is a `ModelLoadError`
   naming `quant_method` and what is supported (`SUPPORTED`).
2. `fp8` (vLLM's / llm-compressor's "fp8" format, what vLLM's `Fp8LinearMethod` reads): a linear weight
   `X.weight` (out, in) is float8 (e4m3fn) with `X.weight_scale`, one float32 per tensor (shape () or (1,)) or
   per output channel ((out,) or (out, 1)); with `weight_block_size: [bo, bi]` the scale is
   `X.weight_scale_inv` (ceil(out/bo), ceil(in/bi)), one per block (DeepSeek-style; despite its name it is
   multiplied too). `dequantize_fp8` gives `weight * scale` in float32 at load (the model dtype follows), so
   troupe computes on the weights the checkpoint means; nothing stays in fp8. `input_scale` (a static
   activation scale, `activation_scheme: "static"`) is not used: troupe does not quantize activations, its
   results are those of the dequantized weights with activations in the model dtype (vLLM's fp8 GEMMs also
   round the activations to fp8). Layers left unquantized (`ignored_layers`) are plain tensors and load as such,
   and so does a folder whose weights are not float8 at all (vLLM would quantize those online; troupe keeps
   the original weights).
3. GPTQ (AutoGPTQ / GPTQModel, what vLLM's gptq.py reads; `bits` 4 or 8, `sym: true`, any `group_size`,
   `desc_act` either way): `X.qweight` int32 (in / p, out) holds p = 32 / bits values per word along the
   input dim, value i of a word at bits [bits*i, bits*(i+1)); `X.qzeros` int32 (groups, out / p) the zero
   points packed the same way along the output dim, stored minus one (`checkpoint_format` "gptq"; "gptq_v2"
   stores them as they are); `X.scales` (groups, out) float16; `X.g_idx` int32 (in,) the group of each input
   row (absent: row // group_size). `W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`, g = g_idx[i].
   `gptq_weight` repacks a weight into the kernels' GGUF blocks where they hold it exactly (`keep_blocks`;
   groups of consecutive rows in multiples of 32, every zero at the symmetric midpoint): 4 bits -> Q4_0
   (`d * (nibble - 8)`, d the group's float16 scale), 8 bits -> Q8_0 (`d * (q - 128)`); otherwise it
   dequantizes to float32.
4. AWQ (AutoAWQ's GEMM layout, what vLLM's awq.py reads; `bits` 4, `zero_point: true`, any `group_size`):
   `X.qweight` int32 (in, out / 8) packs 8 output columns per word, column 8j + k in nibble
   `AWQ_NIBBLE[k]` (AutoAWQ's order 0 2 4 6 1 3 5 7, reversed); `X.qzeros` int32 (groups, out / 8) the
   zero points packed the same way; `X.scales` (groups, out) float16; `W[o, i] = scales[g, o] * (q[i, o] -
   zero[g, o])`, g = i // group_size. Its zero points are asymmetric, which no kept block format holds
   exactly (Q4_1's `m` would round `-zero * scale` to float16), so `awq_weight` dequantizes to float32.
5. compressed-tensors (llm-compressor) in its `float-quantized` format: the fp8 weights of point 2 under
   `X.weight` / `X.weight_scale` with a per-tensor, per-channel ((out, 1)) or per-block
   (`block_structure`) scale, read into an `Fp8Scheme`; `input_scale` likewise unused. Its integer formats
   (`pack-quantized`, `int-quantized`, ...) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from troupe.errors import ModelLoadError
from troupe.kernels.quant import QType, QuantizedTensor, Weight

SUPPORTED = ("fp8 (per-tensor, per-channel or block-wise weight scales)",
             "gptq (4 or 8 bits, symmetric, any group size, desc_act true or false)",
             "awq (4 bits, zero_point true, GEMM layout, any group size)",
             "compressed-tensors (format float-quantized: fp8 weights per tensor, channel or block)")
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of a word holding output column 8j + k
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero point


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    block: tuple[int, int] | None  # weight_block_size (out, in), or None: per-tensor / per-channel scales
    activation_scheme: str  # "dynamic" or "static" (static: `input_scale` tensors, unused; module docstring)
    scale_suffix: str = "weight_scale"  # "weight_scale_inv" for vLLM fp8's block scales

    @property
    def describe(self) -> str:
        return f"fp8 with weight_block_size {list(self.block)}" if self.block else "fp8"


@dataclass(frozen=True, slots=True)
class GptqScheme:
    bits: int  # 4 or 8
    group_size: int  # input rows per scale; -1: one group for the whole input dim
    desc_act: bool  # act-order: groups follow `g_idx`, not consecutive rows
    zero_offset: int  # added to a stored zero point (1 for checkpoint_format "gptq", 0 for "gptq_v2")

    @property
    def pack(self) -> int:
        return 32 // self.bits


@dataclass(frozen=True, slots=True)
class AwqScheme:
    group_size: int  # input rows per scale and zero point; -1: one group
    pack: int = 8  # 4-bit values per int32 word


QuantScheme = Fp8Scheme | GptqScheme | AwqScheme | None


def read_quant_scheme(folder: Path, cfg: dict[str, Any]) -> QuantScheme:
    """The folder's quantization (module docstring, point 1); `cfg` is its config.json."""
    qc = cfg.get("quantization_config")
    where = f"{folder / 'config.json'}: quantization_config"
    if qc is None and (folder / "quantize_config.json").is_file():  # AutoGPTQ's own file, no quant_method
        where = str(folder / "quantize_config.json")
        try:
            qc = {"quant_method": "gptq", **json.loads((folder / "quantize_config.json").read_text())}
        except ValueError as e:
            raise ModelLoadError(f"{where}: not valid JSON ({e})") from e
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: expected a JSON object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method == "gptq":
        return _gptq_scheme(qc, where)
    if method == "awq":
        return _awq_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_fp8_scheme(qc, where)
    raise ModelLoadError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported; supported: "
                         f"{'; '.join(SUPPORTED)}")


def _fp8_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    act = str(qc.get("activation_scheme", "dynamic")).lower()
    if act not in ("dynamic", "static"):
        raise ModelLoadError(f"{where}: quant_method 'fp8' with activation_scheme {act!r} is not supported "
                             "(dynamic, static)")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(None, act)
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: quant_method 'fp8' weight_block_size must be two positive integers, "
                             f"got {block!r}")
    return Fp8Scheme((int(block[0]), int(block[1])), act, "weight_scale_inv")


def _compressed_fp8_scheme(qc: dict[str, Any], where: str) -> Fp8Scheme:
    """llm-compressor's fp8 checkpoints (`format: "float-quantized"`): every config group's weights 8-bit
    float, symmetric, static, per tensor, channel or block; the same tensors as vLLM's fp8 (module
    docstring, point 5). Its other formats (int4 / int8 packing, sparsity, transforms) are refused."""
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quant_method 'compressed-tensors' with {what} is not supported; "
                              f"supported: {SUPPORTED[3]}")

    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise refuse(f"format {fmt!r}")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise refuse(f"a {key}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse("no config_groups")
    blocks: set[tuple[int, int] | None] = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        strategy = w.get("strategy")
        if (w.get("type"), w.get("num_bits"), w.get("symmetric", True), bool(w.get("dynamic"))) != ("float", 8, True,
                                                                                                     False):
            raise refuse(f"config group {name!r} weights {w!r} (not static symmetric 8-bit float)")
        if strategy not in ("tensor", "channel", "block"):
            raise refuse(f"config group {name!r} weight strategy {strategy!r} (tensor, channel, block)")
        shape = w.get("block_structure")
        blocks.add((int(shape[0]), int(shape[1])) if strategy == "block" and shape else None)
        if strategy == "block" and not shape:
            raise refuse(f"config group {name!r}: strategy 'block' without a block_structure")
    if len(blocks) != 1:
        raise refuse("config groups of different block structures")
    return Fp8Scheme(blocks.pop(), "dynamic")


def _gptq_scheme(qc: dict[str, Any], where: str) -> GptqScheme:
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quant_method 'gptq' with {what} is not supported; supported: {SUPPORTED[1]}")

    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (4, 8):
        raise refuse(f"bits {bits!r}")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise refuse(f"group_size {group!r}")
    if qc.get("sym", True) is not True:
        raise refuse("sym false (asymmetric zero points)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in _GPTQ_FORMATS:
        raise refuse(f"checkpoint_format {fmt!r} (gptq, gptq_v2)")
    if qc.get("dynamic"):
        raise refuse("per-module 'dynamic' overrides")
    return GptqScheme(int(bits), group, bool(qc.get("desc_act", False)), _GPTQ_FORMATS[fmt])


def _awq_scheme(qc: dict[str, Any], where: str) -> AwqScheme:
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quant_method 'awq' with {what} is not supported; supported: {SUPPORTED[2]}")

    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", -1))
    if bits != 4:
        raise refuse(f"bits {bits!r}")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise refuse(f"group_size {group!r}")
    if qc.get("zero_point", True) is not True:
        raise refuse("zero_point false")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"version {version!r} (only the GEMM layout)")
    return AwqScheme(group)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.element_size() == 1


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   where: str) -> torch.Tensor:
    """(out, in) float8 weight times its scale -> float32 (module docstring, point 2); `where` names the tensor."""
    out, inp = weight.shape
    w = weight.float()  # (out, in)
    s = scale.float()
    if block is not None:
        bo, bi = block
        grid = (-(-out // bo), -(-inp // bi))
        if tuple(s.shape) != grid:
            raise ModelLoadError(f"{where}: block scale has shape {list(s.shape)}; weight_block_size {list(block)} "
                                 f"over a weight of {[out, inp]} needs {list(grid)}")
        s = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]  # (out, in)
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    if tuple(s.shape) in ((out,), (out, 1)):
        return w * s.reshape(out, 1)
    raise ModelLoadError(f"{where}: scale has shape {list(s.shape)}; expected one value (per tensor) or "
                         f"{[out, 1]} (per output channel) for a weight of {[out, inp]}")


def packed_shapes(scheme: GptqScheme | AwqScheme, out: int, inp: int) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors that hold a GPTQ or AWQ weight of (out, in)."""
    groups = 1 if scheme.group_size == -1 else -(-inp // scheme.group_size)
    if isinstance(scheme, AwqScheme):
        return {"qweight": (inp, out // 8), "qzeros": (groups, out // 8), "scales": (groups, out)}
    return {"qweight": (inp // scheme.pack, out), "qzeros": (groups, out // scheme.pack),
            "scales": (groups, out), "g_idx": (inp,)}


def gptq_weight(t: dict[str, torch.Tensor], scheme: GptqScheme, keep_blocks: bool, where: str) -> Weight:
    """One GPTQ weight from its tensors `t` (qweight, qzeros, scales and, if stored, g_idx), shapes already
    checked: GGUF blocks where they hold it exactly and `keep_blocks`, else (out, in) float32."""
    inp = t["qweight"].shape[0] * scheme.pack
    group = inp if scheme.group_size == -1 else scheme.group_size
    q = _unpack(t["qweight"], scheme.bits, dim=0)  # (in, out) ints in [0, 2**bits)
    zeros = _unpack(t["qzeros"], scheme.bits, dim=1) + scheme.zero_offset  # (groups, out)
    scales = t["scales"]  # (groups, out)
    rows = torch.arange(inp, dtype=torch.int64)  # (in,)
    g_idx = t["g_idx"].long() if "g_idx" in t else rows // group  # (in,)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
        raise ModelLoadError(f"{where}: g_idx holds groups outside [0, {scales.shape[0]})")
    mid = 1 << (scheme.bits - 1)
    exact = scales.dtype == torch.float16 and group % 32 == 0 and inp % 32 == 0  # blocks of 32, f16 scales
    if keep_blocks and exact and torch.equal(g_idx, rows // group) and bool((zeros == mid).all()):
        return _repack(q, scales, group, scheme.bits)
    return ((q - zeros[g_idx]).float() * scales[g_idx].float()).t().contiguous()  # (out, in)


def awq_weight(t: dict[str, torch.Tensor], scheme: AwqScheme) -> torch.Tensor:
    """One AWQ weight from its tensors `t` (qweight, qzeros, scales), shapes already checked: (out, in) float32."""
    inp = t["qweight"].shape[0]
    group = inp if scheme.group_size == -1 else scheme.group_size
    order = torch.tensor(AWQ_NIBBLE).argsort()  # value j of a word (nibble j) -> which column of 8 it holds

    def columns(packed: torch.Tensor) -> torch.Tensor:  # (R, C) words -> (R, 8 C) values in column order
        vals = _unpack(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)  # (R, C, 8) by nibble
        out = torch.empty_like(vals)
        out[:, :, order] = vals
        return out.reshape(packed.shape[0], -1)

    g = torch.arange(inp) // group  # (in,)
    q, zeros = columns(t["qweight"]), columns(t["qzeros"])  # (in, out), (groups, out)
    return ((q - zeros[g]).float() * t["scales"][g].float()).t().contiguous()  # (out, in)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> the `32 / bits` values each holds, lowest bits first, spread along `dim`: int32 (the mask
    drops what an arithmetic shift of a negative word brings in)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (p,)
    words = packed.to(torch.int32)
    if dim == 0:  # (R, C) -> (R, p, C) -> (R * p, C)
        vals = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return vals.reshape(-1, packed.shape[1])
    vals = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)  # (R, C, p)
    return vals.reshape(packed.shape[0], -1)


def _repack(q: torch.Tensor, scales: torch.Tensor, group: int, bits: int) -> QuantizedTensor:
    """(in, out) values with symmetric zeros and consecutive groups -> Q4_0 (4 bits) / Q8_0 (8 bits) rows."""
    inp, out = q.shape
    nb = inp // 32
    d = scales.to(torch.float16)[torch.arange(nb) * 32 // group].t().contiguous()  # (out, nb): each block's group
    d_bytes = d.view(torch.uint8).reshape(out, nb, 2)  # little-endian float16
    qt = q.t().reshape(out, nb, 32)  # (out, nb, 32)
    if bits == 4:
        values = (qt[:, :, :16] | (qt[:, :, 16:] << 4)).to(torch.uint8)  # (out, nb, 16): j low, 16 + j high
        qtype = QType.Q4_0
    else:
        values = (qt - 128).to(torch.int8).view(torch.uint8)  # (out, nb, 32)
        qtype = QType.Q8_0
    data = torch.cat([d_bytes, values], dim=2).reshape(out, nb * qtype.type_size)
    return QuantizedTensor(qtype, data.contiguous(), (out, inp))
