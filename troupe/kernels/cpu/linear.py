"""The `cpu` set's projections and embedding lookup: compiled kernels on GGUF blocks (`csrc/qmatmul*.cpp`).

- `linear(weight, bias)`: a `QuantizedTensor` (any `QType`) computes on its blocks with
  `torch.ops.troupe_qmm.linear` (float32 activations: the output-exact mode, `quantization="gguf"`) or
  `linear_q8` (8-bit activations, `"gguf-q8"`: a tiled integer GEMM for batches; decode steps of a few
  rows on the exact float path, or on an integer rows kernel where that is the faster (AVX2 builds on AMD
  CPUs); formats without an integer GEMM take the float path for large batches; csrc/qmatmul_q8.cpp), or
  `linear_bf16` (`"gguf-bf16"`, CPUs with avx512_bf16: batches of more than 8 rows with AMX, 12 without,
  in bfloat16 with float32 sums, on AMX tiles where the CPU has them; fewer rows on the exact float path;
  csrc/qmatmul_bf16.cpp; `bf16_unsupported` says why a CPU cannot). Dense weights (Hugging Face folders,
  F32 GGUF tensors, `"dequantize"`) keep the eager set's oneDNN-packed float32 projection, which the compiled float kernels only match (docs/kernels.md).
- The blocks a projection computes on are moved into the set's `WeightArena` (`arena.py`: huge-page
  memory, in binding order) when the projection is made; a tied embedding follows its head there.
- `embedding(table)`: a quantized table expands only the looked-up rows (`troupe_qmm.embedding`), with the
  reference's values bit for bit.

Activations in another dtype than float32 are cast to float32 for the kernel and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from troupe.kernels.base import EmbeddingOp, LinearOp
from troupe.kernels.cpu.arena import WeightArena
from troupe.kernels.eager.linear import Linear
from troupe.kernels.quant import QType, QuantizedTensor, Weight, dense

SOURCES = ("qmatmul.cpp", "qmatmul_q8.cpp", "qmatmul_bf16.cpp")  # the troupe_qmm extension


def computes_on_blocks(weight: Weight) -> bool:
    """Whether the kernels take `weight` as it is (every QType whose rows are whole 32-value chunks)."""
    return isinstance(weight, QuantizedTensor) and weight.shape[1] % 32 == 0


class QuantizedLinear:
    """`x (M, K) -> x @ W.T + bias (M, N)` on the blocks of `weight` (see the module docstring)."""

    __slots__ = ("data", "qtype", "bias", "q8", "bf16")

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None, quantize_activations: bool,
                 arena: WeightArena | None = None, bf16: bool = False) -> None:
        if arena is not None:
            arena.place(weight.data)  # in place: the weight's other holders follow
        self.data = weight.data  # (N, row_bytes) uint8
        self.qtype = int(weight.qtype)
        self.bias = bias.detach().float().contiguous() if bias is not None else None  # (N,)
        self.q8 = quantize_activations and weight.qtype not in (QType.F32, QType.F16, QType.BF16)
        self.bf16 = bf16 and not quantize_activations

    @property
    def mode(self) -> int:
        """The activation mode as the decoder stack takes it: 0 float32, 1 8-bit, 2 bfloat16."""
        return 1 if self.q8 else 2 if self.bf16 else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        dtype = x.dtype
        ops = torch.ops.troupe_qmm
        op = ops.linear_q8 if self.q8 else ops.linear_bf16 if self.bf16 else ops.linear
        y = op(x if dtype == torch.float32 else x.float(), self.data, self.qtype, self.bias, -1)
        return y if dtype == torch.float32 else y.to(dtype)


def bf16_unsupported() -> str | None:
    """Why `linear_bf16` cannot run here (None: it can): the CPU lacks avx512_bf16, or the kernels are built
    for the AVX2 baseline (`TROUPE_CPU_ISA=avx2`)."""
    from troupe.kernels.cpu.build import cpu_flags, isa

    if "avx512_bf16" not in cpu_flags():
        return "this CPU lacks avx512_bf16 (the vdpbf16ps instructions; /proc/cpuinfo flags)"
    if isa() != "native":
        return f"the kernels are built for the {isa()} baseline (TROUPE_CPU_ISA={isa()}), without avx512_bf16"
    return None


def linear(weight: Weight, bias: torch.Tensor | None, quantize_activations: bool,
           arena: WeightArena | None = None, bf16: bool = False) -> LinearOp:
    """The projection of `weight` for the cpu set (see the module docstring); `arena`: where its blocks
    are moved (None: they stay where they are); `bf16`: the "gguf-bf16" mode."""
    if computes_on_blocks(weight):
        assert isinstance(weight, QuantizedTensor)
        return QuantizedLinear(weight, bias, quantize_activations, arena, bf16)
    lin = Linear(dense(weight), bias)
    lin.pack()
    return lin


def embedding(table: Weight) -> EmbeddingOp:
    """The lookup `ids (T,) int64 -> (T, hidden) float32` over `table`."""
    if computes_on_blocks(table):
        assert isinstance(table, QuantizedTensor)
        data, qtype, k = table.data, int(table.qtype), table.shape[1]
        return lambda ids: torch.ops.troupe_qmm.embedding(data, qtype, k, ids)
    dense_table = dense(table)
    return lambda ids: F.embedding(ids, dense_table)
