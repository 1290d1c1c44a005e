"""A small Ray cluster for tests, and the checks that nothing troupe put on it is left.

The cluster (`ray.cluster_utils.Cluster`, a head node; tests may add nodes) runs in processes of
its own; this test process is not connected to it except while a frontend under test is, or
inside `connected()` for a check. Ray's footprint is kept small: 2 logical CPUs, a 100 MB object
store, no dashboard, no prestarted workers, no usage reports.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

OBJECT_STORE_BYTES = 100 * 2**20
HEAD_RESOURCES = {"troupe_engine": 2.0}
HEAD_CPUS = 2
SYSTEM_CONFIG = {"enable_worker_prestart": False}
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}  # no usage report leaves this machine


def node_args(num_cpus: int, resources: dict[str, float]) -> dict[str, Any]:
    return dict(num_cpus=num_cpus, resources=resources, object_store_memory=OBJECT_STORE_BYTES)


@contextlib.contextmanager
def local_cluster() -> Iterator[Any]:
    """A head node with `HEAD_CPUS` CPUs and `HEAD_RESOURCES`; shut down after, even on failure."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
        **node_args(HEAD_CPUS, HEAD_RESOURCES), include_dashboard=False, _system_config=SYSTEM_CONFIG))
    try:
        yield cluster
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def connected(address: str) -> Iterator[Any]:
    """The `ray` module connected to `address`: the frontend's connection if this process has one
    now, else one made (and closed) for the block."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(address=address, log_to_driver=False, logging_level="warning")
    try:
        yield ray
    finally:
        ray.shutdown()


def engine_actors(ray: Any, state: str = "ALIVE") -> list[dict[str, Any]]:
    """troupe's engine actors on the cluster in `state` (the actor table: no dashboard needed)."""
    return [a for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "EngineActor" and a["State"] == state]


def leftovers(ray: Any) -> list[str]:
    """What is still held on the cluster: live actors (any class), placement groups not removed,
    and resources not free again (a holder this list would miss)."""
    found = [f"actor {a['ActorClassName']} {a['State']}" for a in ray._private.state.actors().values()
             if a["State"] != "DEAD"]
    found += [f"placement group {pg['name']} {pg['state']}" for pg in ray.util.placement_group_table().values()
              if pg["state"] != "REMOVED"]
    total, free = ray.cluster_resources(), ray.available_resources()
    found += [f"{name}: {free.get(name, 0.0):g} of {amount:g} free" for name, amount in total.items()
              if name in ("CPU", "GPU") or name in HEAD_RESOURCES or name.startswith("node_")
              if free.get(name, 0.0) != amount]
    return found


def wait_clean(address: str, within_s: float = 20.0) -> None:
    """Until nothing is left on the cluster (Ray frees what a dead owner held asynchronously)."""
    deadline = time.monotonic() + within_s
    with connected(address) as ray:
        while (left := leftovers(ray)) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert left == []


def session_processes(session_dir: str) -> list[str]:
    """Processes of a Ray session still running: any whose command line or open files name its
    session dir (the cluster's servers and agents by their arguments, workers by their log files)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            targets = [os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if session_dir in cmdline or any(session_dir in t for t in targets):
            found.append(f"{name}: {cmdline[:120]}")
    return found


def wait_no_processes(session_dir: str, within_s: float = 20.0) -> None:
    """Until no process of the Ray session runs (a cluster's shutdown signals them; they exit soon after)."""
    deadline = time.monotonic() + within_s
    while (left := session_processes(session_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []
