"""Launcher checks shared by the Triton kernels: dtype, shape, stride and device validation.

Launchers validate only what the tensors' metadata says (dtype, shape, strides, device), never their
values: reading a value would sync the host with the device and break CUDA-graph capture. Index
tensors out of range (a slot past the pool, a block id past `num_blocks`) are the caller's contract.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A tensor handed to a kernel launcher has the wrong dtype, shape, strides or device."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise KernelArgumentError(message)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, f"{name}: dtype must be float16, bfloat16 or float32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int = 1) -> None:
    check(t.dtype in INDEX_DTYPES, f"{name}: dtype must be int32 or int64, got {t.dtype}")
    check(t.dim() == ndim, f"{name}: must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    check(t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, got strides {t.stride()}")


def check_rows(name: str, t: torch.Tensor, ndim: int) -> None:
    """`t` has `ndim` dimensions and a contiguous last one (rows may be strided views, e.g. of a fused qkv)."""
    check(t.dim() == ndim, f"{name}: must have {ndim} dimensions, got shape {tuple(t.shape)}")
    check(t.stride(-1) == 1, f"{name}: the last dimension must be contiguous, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors must be on one device, got {devices}")


def dot_in_float32(t: torch.Tensor) -> bool:
    """Whether `tl.dot` operands go to float32 (IEEE) for inputs like `t`.

    float32 inputs: always (no TF32, so float32 runs match a float32 reference). CPU tensors run under
    the Triton interpreter, whose bf16 `tl.dot` multiplies the raw bit patterns: everything is upcast
    there. On a GPU, 16-bit inputs keep 16-bit tensor-core dots with float32 accumulation."""
    return t.dtype == torch.float32 or t.device.type == "cpu"
