"""`WeightArena`: where the cpu set keeps the GGUF blocks it computes on.

A decode step streams every projection's blocks once (the default model: 96 MB in 121 calls), so the
memory they sit in matters: the arena copies them, in the order the model binds them, into anonymous
memory aligned to 2 MiB and advised for transparent huge pages (`MADV_HUGEPAGE`; this machine's THP mode
is "madvise", where nothing else gets huge pages). With 2 MiB pages the stream needs ~50 TLB entries
instead of ~24k 4 KiB page walks per step; the copy pays only with the advice (without it, in model order,
`python -m troupe.bench.kernels --model-order`, it is no faster than the loader's own buffers). Each weight starts on a 64-byte line.

`place(data)` moves a weight's bytes in place (`Tensor.set_`): every holder of that tensor object (the
model's `QuantizedTensor`, a tied embedding's lookup) sees the new storage, and the old buffer is freed
when nothing else holds it, so the resident weights are not doubled; glibc keeps freed heap pages
mapped, so the arena asks it to give them back (`malloc_trim`) after each move. Memory comes in chunks of
`CHUNK_BYTES` of address space; only the pages written are resident. A chunk lives as long as a weight
placed in it (or the arena's next placement) does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch

from troupe.kernels.base import anonymous_bytes

CHUNK_BYTES = 64 << 20  # address space per chunk (a larger weight gets a chunk of its own size)
ALIGN = 64


class WeightArena:
    """Bump allocation over huge-page-advised chunks; see the module docstring."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # (bytes,) uint8 over the current chunk
        self._used = 0
        self._spans: list[tuple[int, int]] = []  # [start, end) addresses of every chunk made

    def place(self, data: torch.Tensor) -> None:
        """Copy `data` (a contiguous uint8 tensor) into the arena and point `data` at the copy."""
        if not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"WeightArena.place takes contiguous uint8 blocks, got {data.dtype} {tuple(data.shape)}")
        n = data.numel()
        if n == 0 or self.holds(data):
            return
        if self._chunk is None or self._used + n > self._chunk.numel():
            self._chunk = anonymous_bytes(max(CHUNK_BYTES, n), huge_pages=True)
            self._used = 0
            start = self._chunk.data_ptr()
            self._spans.append((start, start + self._chunk.numel()))
        copy = self._chunk[self._used:self._used + n].view(data.shape)
        copy.copy_(data)
        data.set_(copy)  # type: ignore[call-overload]  # the tensor object now views the arena
        self._used += -(-n // ALIGN) * ALIGN
        if _malloc_trim is not None:
            _malloc_trim(0)  # the old buffer's pages, if it lived on the heap

    def holds(self, data: torch.Tensor) -> bool:
        """Whether `data` already lies in one of the arena's chunks."""
        p = data.data_ptr()
        return any(a <= p < b for a, b in self._spans)


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    except OSError:
        return None


_malloc_trim = _find_malloc_trim()
