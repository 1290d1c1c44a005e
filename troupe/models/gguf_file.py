"""`GGUFFile`: a fast reader of a GGUF file's metadata and tensor table, with the tensor bytes memory-mapped.

The format (version 2 and 3, little-endian): the magic `GGUF`, u32 version, u64 tensor count, u64
metadata count; each metadata entry is a string key, a u32 value type and the value (arrays: u32 element
type, u64 count, elements; strings: u64 length, UTF-8 bytes); each tensor entry is its name, u32 number
of dims, u64 dims (innermost first), u32 GGML type and the u64 offset of its bytes from the start of the
data section, which begins at the next multiple of `general.alignment` (default 32) after the table.

Why not `gguf.GGUFReader`: it builds a numpy view per field, seconds on the default model's 49k-token
vocabulary; this reader decodes the same dozens of times faster (numeric arrays with one `frombuffer`).
Everything wrong with the file is a `ModelLoadError` naming it.

Two ways to a tensor's bytes: `raw(name)`, a numpy view over the file's one mapping, for what is read once
and expanded or copied at load (that mapping is closed with the file); `mapped(name)`, a read-only uint8
tensor over a mapping of that tensor's pages alone, which stays mapped exactly as long as the tensor (or a
view of it) lives, whatever happens to the file object: what the model computes on in place (the GGUF's
blocks, nothing copied; the pages are the page cache's, shared, and only those touched are resident).
Such a mapping is `PROT_READ`: a write into it is a crash, never a change to the file.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from troupe.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int  # GGML type id (troupe.kernels.quant.QType for the ones troupe keeps)
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores the dims innermost first)
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """The parsed header of `path`; `raw(name)` gives a tensor's bytes. Use as a context manager (or
    `close()`) to release the mapping; arrays from `raw` must not be used after that."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: cannot read the GGUF file ({e})") from e
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            self._map.close()
            raise ModelLoadError(f"{self.path}: not a valid GGUF file ({e})") from e

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._map.close()

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` as a read-only uint8 array over the mapping."""
        t = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def mapped(self, name: str, shape: tuple[int, ...] = (-1,)) -> torch.Tensor:
        """The bytes of tensor `name` as a uint8 tensor of `shape` (e.g. (rows, row_bytes)) over a read-only
        mapping of their own pages (see the module docstring): nothing is read or copied; unmapped when the
        last tensor on it goes. Shaped before it becomes a tensor: a torch view of a flat one would keep
        the mapping alive through its base after a kernel set moves the view's storage elsewhere
        (troupe.kernels.cpu.arena)."""
        import torch  # here: the tokenizer's readers of this module need no torch

        t = self.tensors[name]
        if t.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8).reshape(shape)
        start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        try:
            with open(self.path, "rb") as f:
                pages = mmap.mmap(f.fileno(), t.offset + t.nbytes - start, access=mmap.ACCESS_READ, offset=start)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: cannot map tensor {name!r} ({e})") from e
        array = np.frombuffer(pages, dtype=np.uint8, count=t.nbytes, offset=t.offset - start).reshape(shape)
        with warnings.catch_warnings():  # torch warns that it has no read-only tensors: this one is never written
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            return torch.from_numpy(array)

    # ------------------------------------------------------------------ parsing

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3; a big-endian file reads as a huge one)")
        self._pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            metadata[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (ndims,) = self._unpack("<I")
            dims = self._unpack(f"<{ndims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, ggml_type, tuple(reversed(dims)), offset))
        align = int(metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        tensors = {}
        for name, ggml_type, shape, offset in infos:
            nbytes = _tensor_bytes(ggml_type, shape, name)
            if start + offset + nbytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors[name] = TensorInfo(name, ggml_type, shape, start + offset, nbytes)
        return metadata, tensors

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = self._map[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, count = self._unpack("<IQ")
        if elem in _SCALARS:
            dtype = np.dtype(_SCALARS[elem])
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        return [self._value(elem) for _ in range(count)]


# bytes per block and values per block of every GGML type a file may hold (ggml.c's type traits)
_TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


def _tensor_bytes(ggml_type: int, shape: tuple[int, ...], name: str) -> int:
    if ggml_type not in _TYPE_SIZES:
        raise ValueError(f"tensor {name!r} has an unknown GGML type {ggml_type}")
    block, size = _TYPE_SIZES[ggml_type]
    cols = shape[-1] if shape else 1
    if cols % block:
        raise ValueError(f"tensor {name!r}: rows of {cols} values are not whole blocks of {block}")
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * (cols // block) * size
