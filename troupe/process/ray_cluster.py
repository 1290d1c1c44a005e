"""The Ray cluster as `data_parallel_backend="ray"` sees it: the connection, and where ranks go.

- `import_ray()`: `import ray`, lazily (troupe imports Ray only here and in troupe.process.ray_engines),
  or an error saying how to install it.
- `ray_session(config)`: this process's connection to the cluster, shared and counted. Ray allows
  one connection per process, so every rank (and every `AsyncLLM` of the process) uses the same:
  the first to enter connects — `ray_address`, else `RAY_ADDRESS`, else a local cluster started
  here (small object store, no dashboard, no prestarted workers: troupe moves no data through Ray;
  at least as many logical CPUs as the ranks ask for) — and the last to leave disconnects, which stops a local cluster it started. A connection the
  program made itself (`ray.init` before troupe) is used and left as it is.
- `rank_bundle`, `default_rank_cpus`: one rank's placement group bundle and its default CPU count.
- `unplaced_reason`: why a bundle is not placed, naming the missing resources.
- `frontend_host`: the address the actors reach the frontend at (loopback on a one-node cluster
  whose node is this one, else this node's IP).
- `describe_ray_error`: a Ray exception as one line, for `EngineDeadError` / `EngineStartupError`.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from troupe.config import RAY_INSTALL_HINT, EngineConfig
from troupe.errors import EngineStartupError

log = structlog.get_logger("troupe.ray")

LOCAL_OBJECT_STORE_BYTES = 200 * 2**20  # a local cluster's object store: Ray carries no tensors here
MAX_CAUSE_CHARS = 1200
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_lock = threading.Lock()
_users = 0  # ranks (of any AsyncLLM of this process) inside `ray_session`
_owned = False  # whether `ray_session` connected (so its last user disconnects)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineStartupError(f"data_parallel_backend='ray' needs Ray, which is not installed: "
                                 f"{RAY_INSTALL_HINT}") from exc
    return ray


@asynccontextmanager
async def ray_session(config: EngineConfig) -> AsyncIterator[Any]:
    """The `ray` module, connected, for as long as the block runs (see the module docstring). The
    connect is shielded, so that a cancelled start-up still counts, and leaves, its share."""
    with anyio.CancelScope(shield=True):
        ray = await anyio.to_thread.run_sync(_acquire, config)
    try:
        yield ray
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_release, ray)


def _acquire(config: EngineConfig) -> Any:
    global _users, _owned
    ray = import_ray()
    with _lock:
        if _users == 0:
            owned = not ray.is_initialized()
            if owned:
                _connect(ray, config)
            _owned = owned
        _users += 1
    return ray


def _connect(ray: Any, config: EngineConfig) -> None:
    address = config.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    local = address == "local"
    options: dict[str, Any] = {}
    if local:  # logical CPUs: at least what the ranks ask for, so that they fit (as spawned processes would)
        cpus = max(os.cpu_count() or 1, config.data_parallel_size * (config.num_threads or 1))
        options = dict(num_cpus=cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                       _system_config={"enable_worker_prestart": False})
    log.info("starting a local Ray cluster" if local else "connecting to the Ray cluster", address=address)
    try:
        ray.init(address=address, **options)
    except Exception as exc:
        where = "start a local Ray cluster" if local else f"connect to the Ray cluster at {address!r}"
        raise EngineStartupError(f"could not {where}: {type(exc).__name__}: {exc}", cause_type=type(exc).__name__,
                                 cause_message=str(exc)) from exc


def _release(ray: Any) -> None:
    global _users, _owned
    with _lock:
        _users -= 1
        if _users == 0 and _owned:
            _owned = False
            log.info("disconnecting from the Ray cluster (a local one stops)")
            ray.shutdown()


def rank_bundle(num_cpus: int, device: str = "cpu", extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """One rank's bundle: its CPU threads, a GPU on `device="cuda"`, and the extra (custom) resources."""
    bundle = {"CPU": float(num_cpus), **{name: float(amount) for name, amount in (extra or {}).items()}}
    if device == "cuda":
        bundle["GPU"] = 1.0
    return bundle


def rank_resources(config: EngineConfig, rank: int) -> dict[str, float]:
    """`ray_resources` for `rank`: the one dict for every rank, or its own from the list."""
    resources = config.ray_resources
    if isinstance(resources, list):
        return dict(resources[rank])
    return dict(resources or {})


def default_rank_cpus(node_cpus: Sequence[float], num_ranks: int) -> int:
    """CPUs per rank when `num_threads` is unset: the cluster's CPUs shared by the ranks, but no more
    than one node has (a rank runs on one node), at least 1."""
    if not node_cpus:
        return 1
    return max(1, int(min(max(node_cpus), sum(node_cpus) // max(1, num_ranks))))


def unplaced_reason(bundle: Mapping[str, float], node_totals: Sequence[Mapping[str, float]],
                    available: Mapping[str, float]) -> str:
    """Why `bundle` is not placed, in words: the resources no alive node has enough of (with the most
    one has), or that the nodes that could hold it are busy (with what the cluster has free)."""
    def fits(node: Mapping[str, float]) -> bool:
        return all(node.get(name, 0.0) >= amount for name, amount in bundle.items())

    if not any(fits(node) for node in node_totals):
        short = []
        for name, amount in bundle.items():
            most = max((node.get(name, 0.0) for node in node_totals), default=0.0)
            if most < amount:
                short.append(f"{name}={amount:g} (the most a node has: {most:g})")
        if short:
            return f"no node of the cluster has {', '.join(short)}"
        return f"no single node has all of {_show(bundle)} at once"
    free = {name: available.get(name, 0.0) for name in bundle}
    return (f"nodes with {_show(bundle)} exist but are busy (free in the whole cluster: {_show(free)}); "
            "other ranks or jobs hold them")


def _show(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def frontend_host(nodes: Sequence[Mapping[str, Any]], own_node_id: str, own_ip: str) -> str:
    """Where the actors reach this frontend: loopback when every alive node is this one's node, else
    this node's IP (never loopback on a cluster of several nodes)."""
    alive = [node for node in nodes if node.get("Alive", False)]
    if alive and all(node.get("NodeID") == own_node_id for node in alive):
        return "127.0.0.1"
    return own_ip


def describe_ray_error(exc: BaseException) -> str:
    """A Ray exception as one line: its type and text, colours and traceback carets dropped."""
    text = _ANSI.sub("", str(exc))
    lines = [line.strip() for line in text.splitlines()]
    kept = " ".join(line for line in lines if line and set(line) - set("^~ "))
    kept = re.sub(r"\s+", " ", kept)
    if len(kept) > MAX_CAUSE_CHARS:
        kept = kept[:MAX_CAUSE_CHARS] + "..."
    return f"{type(exc).__name__}: {kept}"
