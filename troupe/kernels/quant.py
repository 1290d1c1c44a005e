"""Quantized weights: `QuantizedTensor` (a 2-D weight kept in its GGUF block format) and the plain-torch
reference dequantization of every format troupe computes on.

A GGUF row of K values is K / block_size blocks of type_size bytes; a weight (N, K) is N such rows, kept
as `data (N, K / block_size * type_size) uint8` exactly as the file stores them. The formats (llama.cpp's
`ggml-common.h` layouts; `f16` is an IEEE half, every scale is one):

- F16, BF16: one 2-byte value per element (block of 1).
- Q8_0 (32 values, 34 bytes): `d: f16, q: int8[32]`; `w = d * q`.
- Q4_0 (32, 18): `d: f16, q: u8[16]`; element j < 16 is the low nibble of q[j], element 16 + j the high
  one; `w = d * (nibble - 8)`.
- Q4_1 (32, 20): `d: f16, m: f16, q: u8[16]` (nibbles as Q4_0); `w = d * nibble + m`.
- Q4_K (256, 144): `d, dmin: f16, scales: u8[12], q: u8[128]`: 8 sub-blocks of 32 with 6-bit scale sc and
  min mn each (`k_scale_min`); sub-block 2c / 2c+1 are the low / high nibbles of q[32c : 32c+32];
  `w = (d * sc) * nibble - dmin * mn`.
- Q5_K (256, 176): Q4_K plus `qh: u8[32]` (after the scales): bit s of qh[l] is the fifth bit of element
  l of sub-block s.
- Q6_K (256, 210): `ql: u8[128], qh: u8[64], scales: int8[16], d: f16`; 16 sub-blocks of 16 values; in each
  half h of 128 values, element l + 32i (l < 32, i < 4) has low 4 bits from ql[64h + l + 32(i % 2)]
  (nibble i // 2) and high 2 bits from qh[32h + l] (bits 2i, 2i+1); `w = (d * scale) * (q - 32)`.

The reference computes each value with the same float32 operations in the same order as the gguf
package's numpy dequantizer (`gguf.quants.dequantize`), so the two agree bit for bit (tests check it),
and the compiled kernels reproduce them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class QType(enum.IntEnum):
    """The GGML type ids of the formats troupe keeps (the numbers GGUF files store)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30

    @property
    def block_size(self) -> int:
        return _BLOCKS[self][0]

    @property
    def type_size(self) -> int:
        return _BLOCKS[self][1]

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` values (`k` a multiple of the block size)."""
        if k % self.block_size:
            raise ValueError(f"{self.name} rows hold a multiple of {self.block_size} values, got {k}")
        return k // self.block_size * self.type_size


_BLOCKS = {
    QType.F32: (1, 4), QType.F16: (1, 2), QType.BF16: (1, 2), QType.Q8_0: (32, 34), QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20), QType.Q4_K: (256, 144), QType.Q5_K: (256, 176), QType.Q6_K: (256, 210),
}


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedTensor:
    """A weight (N, K) in a GGUF block format: `data` holds its N rows of raw blocks, (N, row_bytes) uint8.

    Kernel sets compute on it directly (`troupe.kernels.cpu.linear`) or expand it once with `dequantize`
    (the eager set); `dequantize_rows` expands only the rows an embedding lookup needs.
    """

    qtype: QType
    data: torch.Tensor  # (N, row_bytes) uint8
    shape: tuple[int, int]  # (N, K)

    def __post_init__(self) -> None:
        n, k = self.shape
        want = (n, self.qtype.row_bytes(k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.qtype.name} {list(self.shape)} needs data {list(want)} uint8, "
                             f"got {list(self.data.shape)} {self.data.dtype}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) in `dtype`: every value expanded (float32 math, see the module docstring)."""
        return dequantize(self.data, self.qtype, self.shape[1]).to(dtype)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), K) float32: the rows `rows` (int64) only."""
        return dequantize(self.data[rows], self.qtype, self.shape[1])

    def permute_rows(self, order: torch.Tensor) -> QuantizedTensor:
        """Row `i` of the result is row `order[i]` of this one (whole block rows move; nothing is expanded)."""
        return QuantizedTensor(self.qtype, self.data[order].contiguous(), self.shape)

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The parts' rows one after the other (all of one format and width)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one format and width can be stacked")
        data = torch.cat([p.data for p in parts])
        return QuantizedTensor(first.qtype, data, (data.shape[0], first.shape[1]))


Weight = torch.Tensor | QuantizedTensor  # what a kernel set's `linear` / `embedding` accept


def dense(weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A plain tensor of `weight` (a quantized one expanded; `dtype` None: float32 / the tensor's own)."""
    if isinstance(weight, QuantizedTensor):
        return weight.dequantize(dtype or torch.float32)
    return weight if dtype is None else weight.to(dtype)


# ---------------------------------------------------------------------------------------- reference


def dequantize(data: torch.Tensor, qtype: QType, k: int) -> torch.Tensor:
    """(rows, row_bytes) uint8 blocks -> (rows, k) float32 (see the module docstring for the layouts)."""
    rows = data.shape[0]
    if qtype == QType.F32:
        return data.contiguous().view(torch.float32).reshape(rows, k).clone()
    if qtype == QType.F16:
        return data.contiguous().view(torch.float16).reshape(rows, k).float()
    if qtype == QType.BF16:
        return data.contiguous().view(torch.bfloat16).reshape(rows, k).float()
    blocks = data.reshape(-1, qtype.type_size)  # (rows * k / block, type_size)
    out = _DEQUANT[qtype](blocks)  # (blocks, block_size)
    return out.reshape(rows, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(nb, 2) bytes -> (nb, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(nb, n) bytes -> (nb, 2n) uint8: the n low nibbles, then the n high ones."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (nb, 12) packed bytes -> the 6-bit (scale, min) of the 8 sub-blocks, (nb, 8) each.
    Sub-block j < 4: scale = s[j] & 63, min = s[j+4] & 63; j >= 4: scale = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
    min = (s[j+4] >> 4) | (s[j] >> 6) << 4."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: (d * sc) * q - dmin * mn per sub-block of 32; q (nb, 8, 32) float32."""
    sc, mn = k_scale_min(b[:, 4:16])
    ds = (_f16(b[:, 0:2]) * sc.float()).unsqueeze(-1)  # (nb, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    return (ds * q - dm).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # (nb, chunk, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)  # sub-block 2c: low, 2c+1: high
    return _k_affine(b, q.float())


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].reshape(-1, 1, 32)  # (nb, 1, 32)
    qs = b[:, 48:176].reshape(-1, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)
    bits = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = ((qh >> bits) & 1) << 4  # (nb, 8, 32)
    return _k_affine(b, (low | high).float())


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)  # (nb, half, 1, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # (nb, half, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # (nb, 16)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)  # element l + 32i of each half
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3) << 4  # (nb, 2, 4, 32)
    q = ((low | high).to(torch.int8) - 32).float().reshape(-1, 16, 16)  # (nb, sub-block, 16)
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)  # (nb, 16, 1)
    return (d * q).reshape(-1, 256)


_DEQUANT = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k,
            QType.Q6_K: _q6_k}


_F16_FIELDS = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
               QType.Q6_K: (208,)}


def random_quantized(qtype: QType, n: int, k: int, generator: torch.Generator | None = None,
                     scale: float = 0.05) -> QuantizedTensor | torch.Tensor:
    """A random valid (N, K) weight in `qtype` (a float32 tensor for F32): random quant bits and finite f16
    scales / mins, sized so that the values are of magnitude ~`4 * scale` in every format. For tests and
    microbenchmarks, where a format's quantizer is not at hand (the gguf package cannot quantize the
    K-quants)."""
    g = generator or torch.Generator().manual_seed(0)
    if qtype == QType.F32:
        return torch.randn(n, k, generator=g) * 4 * scale
    if qtype in (QType.F16, QType.BF16):
        values = (torch.randn(n, k, generator=g) * 4 * scale).to(torch.float16 if qtype == QType.F16 else torch.bfloat16)
        return QuantizedTensor(qtype, values.view(torch.uint8).reshape(n, -1).clone(), (n, k))
    blocks = torch.randint(0, 256, (n * k // qtype.block_size, qtype.type_size), dtype=torch.uint8, generator=g)
    for offset in _F16_FIELDS[qtype]:
        values = (torch.randn(blocks.shape[0], 1, generator=g) * scale).to(torch.float16)
        if qtype == QType.Q8_0:  # quants reach 127: keep |w| ~ 4 * scale, as the other formats
            values = values / 16
        elif qtype in (QType.Q4_K, QType.Q5_K):  # sub-block scales reach 63
            values = values / 32
        elif qtype == QType.Q6_K:  # int8 scales reach 127
            values = values / 64
        blocks[:, offset:offset + 2] = values.view(torch.uint8)
    return QuantizedTensor(qtype, blocks.reshape(n, -1), (n, k))
