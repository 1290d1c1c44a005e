"""How an engine process is launched: its address, its environment, and how its exit reads.

- `private_address`: ipc:// in a fresh private dir (mode 0700, `tempfile.mkdtemp`), removed on the
  way out; or `engine_address` as configured (tcp://; engine i of several gets PORT + i).
- `rank_address`: where a headless engine of rank r meets the frontend (`data_parallel_address`
  PORT + r).
- `connect_address`: where a local child connects to the bound endpoint (a wildcard host is this one).
- `bare_main` and `engine_environment`: the few milliseconds around `Process.start()`.
- `rank_gpu`: which GPU a local data-parallel rank's process gets (its `CUDA_VISIBLE_DEVICES`).
- `describe_exit`: an exit code in words ("was killed by SIGKILL").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import types
from collections.abc import Iterator

from troupe.config import EngineConfig
from troupe.errors import InvalidInputError

MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


@contextlib.contextmanager
def private_address(config: EngineConfig, engine_index: int) -> Iterator[tuple[str, str | None]]:
    """`engine_address` as given, or ipc:// in a fresh private dir that is removed on the way out."""
    if config.engine_address is not None:
        address = config.engine_address
        host, _, port = address.rpartition(":")
        if engine_index and port.isdigit():  # one port per engine: PORT + index
            address = f"{host}:{int(port) + engine_index}"
        yield address, None
        return
    ipc_dir = tempfile.mkdtemp(prefix="troupe-", dir=config.ipc_dir)
    try:
        path = os.path.join(ipc_dir, f"engine{engine_index}")
        if len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"ipc_dir: the socket path {path!r} is longer than {MAX_IPC_PATH} bytes; "
                             "choose a shorter ipc_dir")
        yield f"ipc://{path}", ipc_dir
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def rank_address(address: str, rank: int) -> str:
    """tcp://HOST:PORT -> tcp://HOST:(PORT + rank): where data-parallel rank `rank` meets the frontend."""
    if not address.startswith("tcp://") or ":" not in address.removeprefix("tcp://"):
        raise ValueError(f"address: must be tcp://HOST:PORT, got {address!r}")
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"address: the port must be a number, got {port!r} in {address!r}")
    if not 0 < int(port) + rank < 65536:
        raise ValueError(f"address: port {port} + rank {rank} is not a valid port")
    return f"{host}:{int(port) + rank}"


def connect_address(endpoint: str) -> str:
    """Where a local child connects to a bound endpoint (a wildcard host means this machine)."""
    for wildcard, local in (("//0.0.0.0:", "//127.0.0.1:"), ("//[::]:", "//[::1]:"), ("//*:", "//127.0.0.1:")):
        endpoint = endpoint.replace(wildcard, local)
    return endpoint


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
    """Start the child without re-running the program's `__main__`: spawn would import it again in
    the child (it needs nothing from it), so a script without an `if __name__ == "__main__":` guard
    would start an engine inside the engine. The swap lasts the few ms of `start()`."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


# libgomp spin iterations before an idle torch thread sleeps (GOMP_SPINCOUNT), for engine processes; one
# iteration is one `pause` instruction. Long enough to bridge the Python between one kernel's parallel
# region and the next even at one row per step (shorter, the torch threads sleep and are woken at almost
# every op: each wake-up costs more than the op on a VM), short enough to bound the waste when another busy
# process holds the core a waiting thread needs (libgomp's own default, 300,000, spins ~30x longer).
# Where other busy processes share the cores, OMP_WAIT_POLICY=PASSIVE or a lower GOMP_SPINCOUNT wins
# (docs/multiprocess.md).
ENGINE_SPIN_COUNT = "10000"


def engine_omp_settings() -> dict[str, str]:
    """OpenMP settings an engine process gets before it imports torch, unless the user chose their own
    (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` set: e.g. `OMP_WAIT_POLICY=PASSIVE` on a machine whose cores
    other busy processes share)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": ENGINE_SPIN_COUNT}


def rank_gpu(config: EngineConfig, engine_index: int) -> dict[str, str]:
    """The environment that gives local rank `engine_index` its own GPU: `CUDA_VISIBLE_DEVICES` naming the
    rank-th GPU this process may use (the rank-th entry of its own `CUDA_VISIBLE_DEVICES` where set), so that
    each spawned engine sees one device, as `cuda:0`. Empty where there is nothing to assign: one local
    engine, `device="cpu"`, or no GPU visible here (`device="auto"` then runs on the CPU; `"cuda"` fails in
    the engine with its own message). Raises `InvalidInputError` when there are fewer GPUs than local ranks:
    two ranks on one GPU would each size their KV pool from the same free memory."""
    ranks = config.num_local_engines
    if ranks <= 1 or config.device == "cpu":
        return {}
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return {}
    if count < ranks:
        local = "data_parallel_size_local" if config.data_parallel_size_local is not None else "data_parallel_size"
        raise InvalidInputError(local, f"{ranks} local engines on device={config.device!r} need one GPU each, and "
                                f"this process sees {count}: lower {local} to at most {count}, or use device='cpu'")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",")] if visible is not None else [str(i) for i in range(count)]
    return {"CUDA_VISIBLE_DEVICES": names[engine_index]}


@contextlib.contextmanager
def engine_environment(extra: dict[str, str] | None = None) -> Iterator[None]:
    """`engine_omp_settings()` and `extra` in the environment a spawned child inherits, while it starts; the
    parent's own values come back afterwards."""
    settings = {**engine_omp_settings(), **(extra or {})}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
