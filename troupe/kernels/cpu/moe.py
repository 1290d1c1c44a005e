"""The `cpu` set's mixture-of-experts op: a layer's routed experts in one compiled call (`csrc/moe.cpp`).

`fused_moe(gate_up, down, quantize_activations, arena)` returns the op of `troupe.kernels.moe`

    moe(x (T, h), ids (T, k) int64, weights (T, k) float32) -> (T, h)

computed by `torch.ops.troupe_moe.moe` on the experts' GGUF blocks: the step's (token, slot) pairs grouped
by expert, experts with few tokens (decode) fused (gate and up rows with SiLU x up in one parallel pass
whose work items are (expert, chunk of rows), down rows in a second, so two active experts still spread
over every thread), experts with many tokens one projection call each (the projections' by-M choice), the
weighted sum written once, in expert order. `quantize_activations`: the "gguf-q8" mode, whose projections
take 8-bit activations where `troupe_qmm.linear_q8` would (csrc/moe.cpp has the rule).

Dense experts (float32 / float16 / bfloat16 tensors) compute as the kernels' F32 / F16 / BF16 "blocks"
(their own bytes, no copy for a contiguous tensor), values exact. `fused_moe` returns None where the op
does not apply (experts of mixed formats, rows that are not whole 32-value chunks): the kernel set then
keeps `grouped_experts`, which stays the reference path (`troupe.bench.moe` measures one against the other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from troupe.kernels.cpu.arena import WeightArena
from troupe.kernels.quant import QType, QuantizedTensor, Weight

SOURCES = ("moe.cpp",)  # the troupe_moe extension
DENSE_QTYPES = {torch.float32: QType.F32, torch.float16: QType.F16, torch.bfloat16: QType.BF16}


def as_blocks(weight: Weight) -> tuple[torch.Tensor, int] | None:
    """(rows of blocks (N, row_bytes) uint8, qtype) of `weight`, or None where the kernels cannot take it."""
    if isinstance(weight, QuantizedTensor):
        return (weight.data, int(weight.qtype)) if weight.shape[1] % 32 == 0 else None
    if weight.dim() != 2 or weight.shape[1] % 32 != 0 or weight.dtype not in DENSE_QTYPES:
        return None
    w = weight.detach().contiguous()
    return w.view(torch.uint8).reshape(w.shape[0], -1), int(DENSE_QTYPES[w.dtype])


class FusedMoe:
    """The op (see the module docstring) over the experts' blocks, bound once."""

    __slots__ = ("gate_up", "down", "qtype_gate_up", "qtype_down", "q8", "fused_max_m", "min_blocks")

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], qtype_gate_up: int, qtype_down: int,
                 q8: bool) -> None:
        self.gate_up, self.down = gate_up, down  # [E] of (2f, row_bytes) / (h, row_bytes) uint8
        self.qtype_gate_up, self.qtype_down = qtype_gate_up, qtype_down
        self.q8 = q8
        self.fused_max_m = -1  # experts with up to this many tokens fused (-1: the kernel's own limit; 0: none)
        self.min_blocks = -1  # weight blocks per thread at least (-1: the kernel's own; tests set 1 to split tiny shapes)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (T, h)
        dtype = x.dtype
        y = torch.ops.troupe_moe.moe(x if dtype == torch.float32 else x.float(), ids, weights.float(), self.gate_up,
                                     self.down, self.qtype_gate_up, self.qtype_down, self.q8, self.fused_max_m,
                                     self.min_blocks)
        return y if dtype == torch.float32 else y.to(dtype)


def fused_moe(gate_up: Sequence[Weight], down: Sequence[Weight], quantize_activations: bool,
              arena: WeightArena | None = None) -> FusedMoe | None:
    """The fused op over the experts (gate_up[e] (2f, h), down[e] (h, f)), or None where it does not apply;
    `arena`: where quantized blocks are moved (`arena.py`, as `linear` does)."""
    if arena is not None:
        for w in (*gate_up, *down):
            if isinstance(w, QuantizedTensor) and w.shape[1] % 32 == 0:
                arena.place(w.data)  # in place: the weight's other holders follow
    gu = [as_blocks(w) for w in gate_up]
    dn = [as_blocks(w) for w in down]
    if not gu or len(gu) != len(dn):
        return None
    if any(b is None for b in (*gu, *dn)) or len({b[1] for b in gu if b}) != 1 or len({b[1] for b in dn if b}) != 1:
        return None
    gu_data = [b[0] for b in gu if b is not None]
    dn_data = [b[0] for b in dn if b is not None]
    assert gu[0] is not None and dn[0] is not None
    return FusedMoe(gu_data, dn_data, gu[0][1], dn[0][1], quantize_activations)
