"""Peak memory of a whole process tree, sampled from /proc: `TreeSampler`.

An engine is several processes (troupe: frontend + engine process; vLLM: API server or `LLM` + its
EngineCore process), so the peak of one process says little. `TreeSampler` polls, on its own thread,
every process that descends from a root pid or shares its process group (the benchmark starts each
engine in a new session, so a grandchild re-parented to init still counts), and keeps the peak of the
sum of their RSS (`/proc/PID/statm`) and of their PSS (`/proc/PID/smaps_rollup`: shared pages split
between the processes that map them, so the torch libraries every process of a tree maps are not
counted once per process; read less often, see `TreeSampler`). A sum of samples can miss a spike
shorter than the interval; it never counts memory twice in time. Linux only: elsewhere the figures stay None.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class TreePeak:
    rss_bytes: int | None = None  # the largest sum of RSS over the tree seen in one sample
    pss_bytes: int | None = None  # the largest sum of PSS (None where smaps_rollup is unreadable)
    max_processes: int = 0
    samples: int = 0


def _parents_and_groups(running: bool = False) -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgrp) of every process visible in /proc (`running`: zombies left out)."""
    table: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(b")") + 2:].split()  # after "(comm)": state ppid pgrp ...
        if not (running and fields[0] in (b"Z", b"X")):
            table[int(name)] = (int(fields[1]), int(fields[2]))
    return table


def group_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that still run (not zombies)."""
    return sorted(pid for pid, (_, pgrp) in _parents_and_groups(running=True).items() if pgrp == pgid)


def tree_pids(root: int, group: int | None = None) -> list[int]:
    """`root`, its descendants, and every process in process group `group` (if given)."""
    table = _parents_and_groups()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {root} if root in table else set()
    if group is not None:
        found |= {pid for pid, (_, pgrp) in table.items() if pgrp == group}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def sample_tree(root: int, group: int | None = None) -> tuple[int, int | None, int]:
    """One full sample: (sum of RSS, sum of PSS or None, number of processes) of the tree."""
    pids = tree_pids(root, group)
    rss = _sum(_rss, pids)
    return rss[0], _sum(_pss, pids)[0] if rss[1] else None, rss[1]


def _sum(read: Any, pids: list[int]) -> tuple[int, int]:
    """(sum of `read(pid)` over the pids that could be read, how many could)."""
    values = [v for v in map(read, pids) if v is not None]
    return sum(values), len(values)


class TreeSampler:
    """`with TreeSampler(pid, group=pgid) as s: ...` then `s.peak`; samples on a thread (the `with` stops
    and joins it). Without /proc it samples nothing and `peak` keeps None figures.

    Cost, which is taken from the engine being measured on a small machine: the RSS of the known tree
    every `interval` s (a few statm reads), the process table scanned for new members every
    `scan_every` s, and PSS (smaps_rollup walks every mapping: ~0.1-0.3 s for a tree of several GB)
    only when the RSS sum is within 3% of its peak, at most every `pss_every` s; so `pss_bytes` is the
    largest PSS seen around the RSS peaks, not a sample of every instant."""

    def __init__(self, root: int, group: int | None = None, interval: float = 0.2, scan_every: float = 1.0,
                 pss_every: float = 2.0) -> None:
        self.root, self.group = root, group
        self.interval, self.scan_every, self.pss_every = interval, scan_every, pss_every
        self.peak = TreePeak()
        self._pids: list[int] = []
        self._scanned = self._pss_at = -float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{root}", daemon=True)

    def __enter__(self) -> TreeSampler:
        if os.path.isdir("/proc/self"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            self.take()
            if self._stop.wait(self.interval):
                return

    def take(self, full: bool = False) -> None:
        """Take one sample now (`full`: rescan the tree and read PSS regardless of the schedule) and fold
        it into `peak`."""
        now = time.monotonic()
        if full or now - self._scanned >= self.scan_every:
            self._pids, self._scanned = tree_pids(self.root, self.group), now
        rss, count = _sum(_rss, self._pids)
        if count == 0:
            return
        p = self.peak
        p.samples += 1
        p.max_processes = max(p.max_processes, count)
        p.rss_bytes = max(p.rss_bytes or 0, rss)
        if full or (rss >= 0.97 * p.rss_bytes and now - self._pss_at >= self.pss_every):
            self._pss_at = now
            pss, readable = _sum(_pss, self._pids)
            if readable == count:
                p.pss_bytes = max(p.pss_bytes or 0, pss)
