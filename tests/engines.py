"""Headless engines for tests: `troupe engine` processes on loopback TCP, owned by a `with` block."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

INFRASTRUCTURE_PIDS: set[int] = set()  # processes a fixture owns for the whole session (not leaks)
POOL_PIDS: dict[str, list[int]] = {}  # address -> the pids of the headless engines serving it, by rank


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (for two ranks)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 1 >= 65536:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports on loopback")


@contextlib.contextmanager
def headless_engines(n: int, *extra: str, first_rank: int = 0) -> Iterator[str]:
    """`n` headless engines (ranks `first_rank` ..) serving successive frontends at a fresh
    loopback address; killed after."""
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    procs = [subprocess.Popen([sys.executable, "-m", "troupe.cli", "engine", "--connect", address, "--rank", str(first_rank + r),
                               "--num-threads", "1", "--serve-forever", *extra]) for r in range(n)]
    INFRASTRUCTURE_PIDS.update(p.pid for p in procs)
    POOL_PIDS[address] = [p.pid for p in procs]
    try:
        yield address
    finally:
        POOL_PIDS.pop(address, None)
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
            INFRASTRUCTURE_PIDS.discard(p.pid)


def child_pids(parent: int | None = None) -> list[int]:
    """Processes whose parent is `parent` (default: this process), zombies included (an exited
    child nobody reaped is a leak)."""
    me, found = os.getpid() if parent is None else parent, []
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


def engine_pid(server_pid: int) -> int:
    """A server's engine process: its child running multiprocessing's spawn."""
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError("no engine process under the server")
