"""Kernel tests: without a CUDA device the Triton kernels run under the interpreter on CPU tensors.

`TRITON_INTERPRET=1` is set by the top-level tests/conftest.py (before any test module imports the
kernels); the `device` fixture checks that it took effect. With a GPU it stays unset and the same tests
run compiled.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the kernel tests launch on: the GPU if there is one, else the CPU (interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    from troupe.kernels.cuda.kernel_set import interpreter_active

    assert interpreter_active(), (
        "troupe.kernels.cuda was imported before TRITON_INTERPRET=1 was set: the kernels cannot run on CPU"
    )
    return torch.device("cpu")
