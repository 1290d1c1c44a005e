"""This process's connection to a Ray cluster, for `data_parallel_backend="ray"`.

- `import_ray()`: `import ray`, lazily (troupe imports Ray only in troupe.process.ray_*), or an
  error saying how to install it.
- `ray_session(config)`: the connection, shared and counted. Ray allows one per process, so every
  rank (and every `AsyncLLM` of the process) uses the same: the first to enter connects —
  `ray_address`, else `RAY_ADDRESS`, else a local cluster started here (no dashboard, a small object
  store since troupe moves no data through Ray, no prestarted workers, at least as many logical
  CPUs as the ranks ask for) — and the last to leave disconnects, which stops a local cluster it
  started. A connection the program made itself (`ray.init` before troupe) is used and left open.

One thread (`_SessionThread`) runs `ray.init`, and `ray.shutdown` when the last user leaves: the
processes of a local cluster die with the thread that started them (PR_SET_PDEATHSIG), so that
thread must live as long as the connection, not be one of anyio's short-lived worker threads.

Bounded both ways: `ray.init` retries an address that does not answer for many minutes, so a
host:port is first probed with a plain TCP connection (refused: an error at once), and the whole
connect is bounded by `engine_ready_timeout_s` (the connecting thread is then abandoned and gives
its share back if it ever succeeds); leaving is bounded too (a cluster that no longer answers must
not hold the frontend's shutdown).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from troupe.config import RAY_INSTALL_HINT, EngineConfig
from troupe.errors import EngineStartupError

log = structlog.get_logger("troupe.ray")

LOCAL_OBJECT_STORE_BYTES = 200 * 2**20
PROBE_TIMEOUT_S = 5.0
DISCONNECT_WAIT_S = 30.0  # ray.shutdown of a local cluster stops its processes: seconds
_lock = threading.Lock()
_users = 0  # ranks (of any AsyncLLM of this process) inside `ray_session`
_session: _SessionThread | None = None  # the connection `ray_session` made (its last user closes it)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineStartupError(f"data_parallel_backend='ray' needs Ray, which is not installed: "
                                 f"{RAY_INSTALL_HINT}") from exc
    return ray


def cluster_address(config: EngineConfig) -> str:
    """`ray_address`, else `RAY_ADDRESS`, else "local" (a cluster started here)."""
    return config.ray_address or os.environ.get("RAY_ADDRESS") or "local"


class _Join:
    """One `ray_session` entry's handshake with its connecting thread: whoever learns last that the
    other side gave up gives the share back (exactly once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joined = False
        self.abandoned = False


@asynccontextmanager
async def ray_session(config: EngineConfig) -> AsyncIterator[Any]:
    """The `ray` module, connected, for as long as the block runs (see the module docstring)."""
    join = _Join()
    timeout = config.engine_ready_timeout_s
    try:
        with anyio.fail_after(timeout):
            ray = await anyio.to_thread.run_sync(_acquire, config, join, abandon_on_cancel=True)
    except BaseException as exc:  # a failure, the deadline, or a cancellation: the thread may still run
        with join.lock:
            join.abandoned = True
            give_back = join.joined
        if give_back:  # it joined, but its result was dropped
            await _leave(import_ray())
        if isinstance(exc, TimeoutError):
            raise EngineStartupError(f"could not connect to the Ray cluster at {cluster_address(config)!r} "
                                     f"within engine_ready_timeout_s={timeout:g} s") from None
        raise
    try:
        yield ray
    finally:
        await _leave(ray)


async def _leave(ray: Any) -> None:
    with anyio.move_on_after(DISCONNECT_WAIT_S, shield=True) as leaving:
        await anyio.to_thread.run_sync(_release, ray, abandon_on_cancel=True)
    if leaving.cancelled_caught:
        log.warning("leaving the Ray session timed out; it goes on in the background", within_s=DISCONNECT_WAIT_S)


def _acquire(config: EngineConfig, join: _Join) -> Any:
    global _users, _session
    ray = import_ray()
    with _lock:
        if _users == 0 and not ray.is_initialized():
            session = _SessionThread(ray, config)
            session.start()  # until connected, or raises
            _session = session
        _users += 1
    with join.lock:
        join.joined = True
        abandoned = join.abandoned
    if abandoned:  # the caller gave up waiting meanwhile
        _release(ray)
    return ray


class _SessionThread:
    """The thread that connects (`ray.init`), waits, and disconnects (`ray.shutdown`).

    A local cluster's processes are started with PR_SET_PDEATHSIG, which follows the *thread* that
    started them: had a short-lived worker thread run `ray.init`, its exit (anyio reaps idle worker
    threads after seconds) would SIGKILL the cluster's GCS and raylet under the running engines. So
    one thread lives exactly as long as the connection; the process dying still takes it along."""

    def __init__(self, ray: Any, config: EngineConfig) -> None:
        self._ray = ray
        self._config = config
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="troupe-ray-session", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._connected.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            _connect(self._ray, self._config)
        except BaseException as exc:  # handed to `start`, which raises it in the caller's thread
            self._error = exc
            return
        finally:
            self._connected.set()
        self._stop.wait()
        log.info("disconnecting from the Ray cluster (a local one stops)")
        self._ray.shutdown()


def _connect(ray: Any, config: EngineConfig) -> None:
    address = cluster_address(config)
    local = address == "local"
    if address.startswith("ray://"):
        raise EngineStartupError(f"Ray Client addresses ({address!r}) are not supported: run troupe on a node of "
                                 "the cluster (the engines connect back to it) and give the GCS address, host:port")
    options: dict[str, Any] = {}
    if local:  # logical CPUs: at least what the ranks ask for, so that they fit (as spawned processes would)
        cpus = max(os.cpu_count() or 1, config.data_parallel_size * (config.num_threads or 1))
        options = dict(num_cpus=cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                       _system_config={"enable_worker_prestart": False})
    else:
        _probe(address)
    log.info("starting a local Ray cluster" if local else "connecting to the Ray cluster", address=address)
    try:
        ray.init(address=address, **options)
    except Exception as exc:
        where = "start a local Ray cluster" if local else f"connect to the Ray cluster at {address!r}"
        raise EngineStartupError(f"could not {where}: {type(exc).__name__}: {exc}", cause_type=type(exc).__name__,
                                 cause_message=str(exc)) from exc


def _probe(address: str) -> None:
    """A host:port address must accept a TCP connection (`auto` and the like are Ray's to resolve)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise EngineStartupError(f"could not connect to the Ray cluster at {address!r}: {exc} (is it running? "
                                 "`ray status` on its head node shows it)", cause_type=type(exc).__name__,
                                 cause_message=str(exc)) from exc


def _release(ray: Any) -> None:
    global _users, _session
    with _lock:
        _users -= 1
        if _users == 0 and _session is not None:
            session, _session = _session, None
            session.stop()
