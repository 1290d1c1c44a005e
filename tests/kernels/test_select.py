"""`select_kernels`: "auto" takes the compiled cpu set where it builds, the eager set otherwise."""

from __future__ import annotations

import pytest
import torch

import troupe.kernels.cpu as cpu
from troupe.config import EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels import select_kernels
from troupe.kernels.cpu import build


@pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                    reason="no AVX2/FMA/F16C CPU or no C++ compiler here")
def test_auto_is_the_cpu_set_where_it_builds():
    """With a compiler and AVX2/FMA/F16C, "auto" (the default) and "cpu" give the compiled set, with its
    float16 pool by default."""
    for name in ("auto", "cpu"):
        ops = select_kernels(EngineConfig(kernels=name))
        assert ops.name == "cpu" and ops.kv_cache_dtype(torch.float32) == torch.float16


def test_auto_falls_back_to_eager(monkeypatch):
    """Where the compiled kernels cannot be built (`available()` is False; it logs the reason once),
    "auto" gives the eager set, and "cpu" is an error naming the option."""
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert select_kernels(EngineConfig(kernels="auto")).name == "eager"
    assert select_kernels(EngineConfig(kernels="eager")).name == "eager"
    with pytest.raises(InvalidInputError, match="kernels.*'cpu' cannot run here"):
        select_kernels(EngineConfig(kernels="cpu"))
