"""Fixtures of the benchmark CLIs' tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from troupe.kernels.quant import QType
    from troupe.models.tiny import make_tiny_gguf

    gguf, _ = make_tiny_gguf(tmp_path_factory.mktemp("m"), default_qtype=QType.Q4_1)
    return gguf
