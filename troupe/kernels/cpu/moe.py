"""The `cpu` set's mixture-of-experts op: a layer's routed experts in one compiled call (`csrc/moe.cpp`).

`fused_moe(gate_up, down, quantize_activations)` returns the op of `troupe.kernels.moe`

    moe(x (T, h), ids (T, k) int64, weights (T, k) float32) -> (T, h)

computed by `torch.ops.troupe_moe.moe` on the experts' GGUF blocks: the step's (token, slot) pairs grouped
by expert, experts with few tokens (decode) fused (gate and up rows with SiLU x up in one parallel pass
whose work items are (expert, chunk of rows), down rows in a second, so two active experts still spread
over every thread), experts with many tokens one projection call each (the projections' by-M choice), the
weighted sum written once, in expert order. `quantize_activations`: the "gguf-q8" mode, whose projections
take 8-bit activations where `troupe_qmm.linear_q8` would (csrc/moe.cpp has the rule); `bf16`: the "gguf-bf16"
mode, whose experts with many tokens take `linear_bf16` and whose fused K-quant experts the 16-bit rows path
(`csrc/rows_i16.h`: activations in int16, the blocks' integers exact).

Each expert's gate and up are two weights of (f, h) to the kernel: a GGUF's come as the parts
`[gate, up]`, views of the file's `ffn_gate_exps` / `ffn_up_exps` blocks; a whole (2f, h) one is split into
its two row halves (views). The experts' blocks are computed on where they are: unlike the dense
projections (`linear.py`), they are not moved into the set's `WeightArena`, so a GGUF's experts stay
mapped from the file (read-only, nothing copied: the model's memory is about the file's size,
docs/models.md "Memory"); a decode step reads only its top-k experts' blocks, a small part of the model.

Dense experts (float32 / float16 / bfloat16 tensors) compute as the kernels' F32 / F16 / BF16 "blocks"
(their own bytes, no copy for a contiguous tensor), values exact. `fused_moe` returns None where the op
does not apply (experts of mixed formats, rows that are not whole 32-value chunks): the kernel set then
keeps `grouped_experts`, which stays the reference path (`troupe.bench.moe` measures one against the other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from troupe.kernels.moe import ExpertGateUp, gate_up_parts
from troupe.kernels.quant import QType, QuantizedTensor, Weight

SOURCES = ("moe.cpp",)  # the troupe_moe extension
DENSE_QTYPES = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}


def as_blocks(weight: Weight) -> tuple[torch.Tensor, int] | None:
    """(rows of blocks (N, row_bytes) uint8, qtype) of `weight`, or None where the kernels cannot take it."""
    if isinstance(weight, QuantizedTensor):
        data = weight.data
        return (data, int(weight.qtype)) if weight.shape[1] % 32 == 0 and data.is_contiguous() else None
    if weight.dim() != 2 or weight.shape[1] % 32 != 0 or weight.dtype not in DENSE_QTYPES:
        return None
    w = weight.detach().contiguous()
    return w.view(torch.uint8).reshape(w.shape[0], -1), int(DENSE_QTYPES[w.dtype])


class FusedMoe:
    """The op (see the module docstring) over the experts' blocks, bound once."""

    __slots__ = ("gate", "up", "down", "qtype_gate_up", "qtype_down", "q8", "bf16", "fused_max_m", "min_blocks")

    def __init__(self, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor], qtype_gate_up: int,
                 qtype_down: int, q8: bool, bf16: bool = False) -> None:
        self.gate, self.up, self.down = gate, up, down  # [E] of (f, row_bytes) / (f, row_bytes) / (h, row_bytes) uint8
        self.qtype_gate_up, self.qtype_down = qtype_gate_up, qtype_down
        self.q8 = q8
        self.bf16 = bf16 and not q8
        self.fused_max_m = -1  # experts with up to this many tokens fused (-1: the kernel's own limit; 0: none)
        self.min_blocks = -1  # weight blocks per thread at least (-1: the kernel's own; tests set 1 to split tiny shapes)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (T, h)
        dtype = x.dtype
        y = torch.ops.troupe_moe.moe(x if dtype == torch.float32 else x.float(), ids, weights.float(), self.gate,
                                     self.up, self.down, self.qtype_gate_up, self.qtype_down, self.q8, self.bf16,
                                     self.fused_max_m, self.min_blocks)
        return y if dtype == torch.float32 else y.to(dtype)


def fused_moe(gate_up: Sequence[ExpertGateUp], down: Sequence[Weight], quantize_activations: bool,
              bf16: bool = False) -> FusedMoe | None:
    """The fused op over the experts (gate_up[e] (2f, h) or [gate (f, h), up (f, h)], down[e] (h, f)), or None
    where it does not apply."""
    halves = [gate_up_parts(w) for w in gate_up]
    if not halves or len(halves) != len(down) or any(p is None for p in halves):
        return None
    gate = [as_blocks(p[0]) for p in halves if p is not None]
    up = [as_blocks(p[1]) for p in halves if p is not None]
    dn = [as_blocks(w) for w in down]
    if any(b is None for b in (*gate, *up, *dn)):
        return None
    if len({b[1] for b in (*gate, *up) if b}) != 1 or len({b[1] for b in dn if b}) != 1:
        return None
    assert gate[0] is not None and dn[0] is not None
    return FusedMoe([b[0] for b in gate if b], [b[0] for b in up if b], [b[0] for b in dn if b], gate[0][1], dn[0][1],
                    quantize_activations, bf16)
