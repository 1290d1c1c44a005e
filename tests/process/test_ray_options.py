"""`data_parallel_backend` and the `ray_*` options at the edge (no Ray cluster needed), Ray missing
(its import blocked), and the pure placement helpers of troupe.engine_side.ray_placement."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from troupe import AsyncLLM
from troupe.config import EngineConfig
from troupe.engine_side.ray_placement import (
    default_rank_cpus,
    describe_ray_error,
    fits_a_node,
    frontend_host,
    rank_bundle,
    rank_device,
    rank_resources,
    unplaced_reason,
)
from troupe.errors import EngineStartupError, InvalidInputError


@pytest.mark.parametrize(("options", "field", "message"), [
    ({"data_parallel_backend": "slurm"}, "data_parallel_backend", "must be 'mp' or 'ray'"),
    ({"ray_address": "auto"}, "ray_address", "only used with data_parallel_backend='ray'"),
    ({"ray_resources": {"x": 1}}, "ray_resources", "only used with data_parallel_backend='ray'"),
    ({"data_parallel_backend": "ray", "data_parallel_size": 2, "data_parallel_size_local": 1},
     "data_parallel_size_local", "must be unset"),
    ({"data_parallel_backend": "ray", "data_parallel_address": "ipc:///x"}, "data_parallel_address", "tcp://"),
    ({"data_parallel_backend": "ray", "data_parallel_size": 2, "ray_resources": [{"a": 1}]}, "ray_resources",
     "one dict per rank"),
    ({"data_parallel_backend": "ray", "ray_resources": {"CPU": 2}}, "ray_resources", "CPU and GPU come from"),
    ({"data_parallel_backend": "ray", "ray_resources": {"a": 0}}, "ray_resources", "numbers > 0"),
    ({"data_parallel_backend": "ray", "ray_resources": {"a": "lots"}}, "ray_resources", "numbers > 0"),
    ({"data_parallel_backend": "ray", "ray_address": "ray://head:10001"}, "ray_address", "Ray Client"),
])
def test_backend_options_are_validated(options: dict[str, Any], field: str, message: str) -> None:
    """Each bad combination is refused when the config is made, naming the field and what is allowed."""
    if options.get("data_parallel_backend") == "ray":
        pytest.importorskip("ray")  # with Ray missing, a "ray" backend is refused for that first
    with pytest.raises(InvalidInputError, match=message) as info:
        EngineConfig(**options)
    assert info.value.field == field


def test_ray_backend_has_no_local_engines_and_needs_no_address() -> None:
    """With Ray every rank joins from elsewhere (none is spawned here), without a data_parallel_address."""
    pytest.importorskip("ray")
    config = EngineConfig(data_parallel_backend="ray", data_parallel_size=3)
    assert (config.num_local_engines, config.num_remote_engines) == (0, 3)


def test_without_ray_the_ray_backend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import ray` blocked: AsyncLLM(data_parallel_backend="ray") raises at once with the install
    command; the default backend is untouched."""
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(InvalidInputError, match=r"data_parallel_backend: 'ray' needs Ray.*pip install -e '\.\[ray\]'"):
        AsyncLLM(data_parallel_backend="ray", data_parallel_size=2)
    assert EngineConfig(data_parallel_size=2).num_local_engines == 2


@pytest.mark.slow
def test_the_cli_without_ray_exits_2_naming_the_install_command() -> None:
    """`troupe serve --data-parallel-backend ray` with Ray's import blocked: exit 2 and the message,
    before any server or engine starts."""
    code = ("import sys; sys.modules['ray'] = None; from troupe.cli import main; "
            "raise SystemExit(main(['serve', '--data-parallel-size', '2', '--data-parallel-backend', 'ray']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "troupe: error: data_parallel_backend: 'ray' needs Ray" in proc.stderr
    assert "pip install -e '.[ray]'" in proc.stderr
    assert "troupe serve: http" not in proc.stdout


def test_cli_ray_options_reach_the_config() -> None:
    """--data-parallel-backend, --ray-address and --ray-resources (an object, or a list per rank)."""
    from troupe.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                                      "--ray-address", "auto", "--ray-resources", '[{"a": 1}, {"b": 2}]'])
    options = engine_options(args)
    assert (options["data_parallel_backend"], options["ray_address"], options["ray_resources"]) == \
        ("ray", "auto", [{"a": 1}, {"b": 2}])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ray-resources", "[1"])


def test_rank_bundle_is_ready_for_a_gpu() -> None:
    """A rank's bundle: its CPUs and extra resources; a GPU on cuda."""
    assert rank_bundle(4, "cpu", {"troupe_engine": 1}) == {"CPU": 4.0, "troupe_engine": 1.0}
    assert rank_bundle(1, "cuda") == {"CPU": 1.0, "GPU": 1.0}


def test_rank_device_auto_follows_the_clusters_gpus() -> None:
    """"auto" asks for a GPU only where the cluster has one; an explicit device is kept."""
    cpu_nodes, gpu_nodes = [{"CPU": 8.0}], [{"CPU": 8.0}, {"CPU": 8.0, "GPU": 4.0}]
    assert [rank_device("auto", cpu_nodes), rank_device("auto", gpu_nodes)] == ["cpu", "cuda"]
    assert [rank_device("cpu", gpu_nodes), rank_device("cuda", cpu_nodes)] == ["cpu", "cuda"]


def test_rank_resources_per_rank_or_shared() -> None:
    pytest.importorskip("ray")
    shared = EngineConfig(data_parallel_backend="ray", data_parallel_size=2, ray_resources={"a": 1})
    per_rank = EngineConfig(data_parallel_backend="ray", data_parallel_size=2, ray_resources=[{"a": 1}, {"b": 2}])
    assert [rank_resources(shared, r) for r in (0, 1)] == [{"a": 1}, {"a": 1}]
    assert [rank_resources(per_rank, r) for r in (0, 1)] == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize(("node_cpus", "ranks", "expected"), [
    ([2], 2, 1),          # this machine, two ranks
    ([64, 64], 2, 64),    # a node each
    ([64, 64], 4, 32),
    ([8, 64, 64], 2, 64),  # never more than one node has
    ([1], 4, 1),          # at least one
    ([], 2, 1),
])
def test_default_rank_cpus(node_cpus: list[float], ranks: int, expected: int) -> None:
    assert default_rank_cpus(node_cpus, ranks) == expected


def test_unplaced_reason_names_what_is_missing() -> None:
    """Missing everywhere: the resource and the most a node has; on no one node together; or busy."""
    nodes = [{"CPU": 2.0, "a": 1.0}, {"CPU": 8.0}]
    assert unplaced_reason({"CPU": 1.0, "gpu_x": 1.0}, nodes, {}) == \
        "no node of the cluster has gpu_x=1 (the most a node has: 0)"
    assert unplaced_reason({"CPU": 4.0, "a": 1.0}, nodes, {}) == "no single node has all of {CPU: 4, a: 1} at once"
    assert not fits_a_node({"CPU": 4.0, "a": 1.0}, nodes) and fits_a_node({"CPU": 2.0, "a": 1.0}, nodes)
    busy = unplaced_reason({"CPU": 2.0, "a": 1.0}, nodes, {"CPU": 6.0})
    assert busy.startswith("nodes with {CPU: 2, a: 1} exist but are busy (free in the whole cluster: {CPU: 6, a: 0})")


def test_frontend_host_is_loopback_only_on_a_cluster_of_this_node() -> None:
    me = {"NodeID": "n1", "Alive": True}
    assert frontend_host([me], "n1", "10.0.0.5") == "127.0.0.1"
    assert frontend_host([me, {"NodeID": "n0", "Alive": False}], "n1", "10.0.0.5") == "127.0.0.1"
    assert frontend_host([me, {"NodeID": "n2", "Alive": True}], "n1", "10.0.0.5") == "10.0.0.5"


def test_describe_ray_error_is_one_clean_line() -> None:
    """Colours and traceback carets dropped, lines joined, the type first."""
    exc = RuntimeError("The actor died because of an error raised in its creation task, \x1b[36mray::A.__init__()"
                       "\x1b[39m (pid=1)\n           ^^^^^^^^^^^\n  File \"x.py\", line 3\nRuntimeError: boom")
    assert describe_ray_error(exc) == ("RuntimeError: The actor died because of an error raised in its creation "
                                       "task, ray::A.__init__() (pid=1) File \"x.py\", line 3 RuntimeError: boom")


@pytest.mark.slow
async def test_a_cluster_address_nobody_answers_fails_the_start_at_once(tiny_llama: Path) -> None:
    """`ray_address` on a port nothing listens on: EngineStartupError naming the address within
    seconds (ray.init alone would retry for minutes), and no connection is left open."""
    ray = pytest.importorskip("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match=f"could not connect to the Ray cluster at '127.0.0.1:{port}'"):
        async with AsyncLLM(str(tiny_llama), data_parallel_backend="ray", ray_address=f"127.0.0.1:{port}",
                            num_threads=1):
            pass
    assert time.monotonic() - started < 15
    assert not ray.is_initialized()
