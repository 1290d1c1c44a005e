"""Where the ranks of `data_parallel_backend="ray"` go, in pure functions (no Ray call here).

- `rank_bundle`, `rank_device`, `rank_resources`, `default_rank_cpus`: one rank's placement group
  bundle, whether it holds a GPU, its extra resources and its default CPU count.
- `fits_a_node`, `unplaced_reason`: whether a bundle can ever be placed; why it is not, naming the
  missing resources.
- `frontend_host`: the address the actors reach the frontend at (loopback on a one-node cluster
  whose node is this one, else this node's IP).
- `describe_ray_error`: a Ray exception as one line, for `EngineDeadError` / `EngineStartupError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from troupe.config import EngineConfig

MAX_CAUSE_CHARS = 1200
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def rank_bundle(num_cpus: int, device: str = "cpu", extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """One rank's bundle: its CPU threads, a GPU on `device="cuda"`, and the extra (custom) resources."""
    bundle = {"CPU": float(num_cpus), **{name: float(amount) for name, amount in (extra or {}).items()}}
    if device == "cuda":
        bundle["GPU"] = 1.0
    return bundle


def rank_device(device: str, node_totals: Sequence[Mapping[str, float]]) -> str:
    """The device a rank's bundle is for: "cuda" asks for a GPU, "cpu" for none, and "auto" for one
    when some alive node has a GPU (the engine's own "auto" then finds it: Ray hides every GPU from
    an actor that asked for none)."""
    if device == "auto":
        return "cuda" if any(node.get("GPU", 0.0) >= 1 for node in node_totals) else "cpu"
    return device


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


def fits_a_node(bundle: Mapping[str, float], node_totals: Sequence[Mapping[str, float]]) -> bool:
    """Whether some node has (in total, busy or not) every resource of `bundle`."""
    return any(all(node.get(name, 0.0) >= amount for name, amount in bundle.items()) for node in node_totals)


def unplaced_reason(bundle: Mapping[str, float], node_totals: Sequence[Mapping[str, float]],
                    available: Mapping[str, float]) -> str:
    """Why `bundle` is not placed, in words: the resources no alive node has enough of (with the most
    one has), or that the nodes that could hold it are busy (with what the cluster has free)."""
    if not fits_a_node(bundle, node_totals):
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
