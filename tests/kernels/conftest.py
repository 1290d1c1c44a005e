"""Kernel tests: without a CUDA device the Triton kernels run under the interpreter on CPU tensors.

`TRITON_INTERPRET` is read when `@triton.jit` decorates a function, i.e. when `troupe.kernels.cuda`
is first imported, so it is set here, when pytest loads this file during collection and before any
test module of this folder imports the kernels. Nothing else in troupe imports triton; the variable
only changes how triton kernels run. With a GPU it stays unset and the same tests run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the kernel tests launch on: the GPU if there is one, else the CPU (interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    from troupe.kernels.cuda import cache_write

    assert type(cache_write.reshape_and_cache_kernel).__name__ == "InterpretedFunction", (
        "troupe.kernels.cuda was imported before TRITON_INTERPRET=1 was set: the kernels cannot run on CPU"
    )
    return torch.device("cpu")
