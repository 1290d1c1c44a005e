"""`EngineProcess`: the frontend's side of an EngineCore that runs in a spawned child process.

Inbox:    `EngineInput` from the graph (adds, aborts, utility calls), straight into the bridge.
Outbox:   `EngineOutput` to the graph: what the engine sends, put there by the bridge's own receive
          pump (`_receive`: no relay task between the socket and the graph), plus `EngineDead` when
          the process exits without being asked to.
Owns:     the child process, the frontend `Bridge` (a ROUTER) with the private ipc dir, and the
          process monitor task.
Shutdown: on cancellation (graph shutdown), shielded and bounded: `EngineShutdown` if the engine
          listens, wait up to `engine_shutdown_timeout_s`; SIGTERM, wait 2 s; SIGKILL. Then the
          bridge closes its socket and the ipc dir is removed. Idempotent by construction: it runs
          once, in `run`'s `finally`.

Start-up, `await tg.start(engine.run)`:
1. make a private dir (mode 0700) for the ipc socket and bind the ROUTER there (or at `engine_address`);
2. spawn the child from the event-loop thread (the child's PR_SET_PDEATHSIG follows the thread that
   forked it, so never from a short-lived worker thread), with the OpenMP settings of `launch.engine_omp_settings`,
   its own GPU when several local ranks run on CUDA (`launch.rank_gpu`: `CUDA_VISIBLE_DEVICES`, one device
   per rank) and without re-importing the program's `__main__` in it (`launch.bare_main`);
3. on `EngineHello` the child is connected: remove the ipc dir at once (the connection does not
   need the file, so even a parent SIGKILLed later leaves nothing behind);
4. `EngineReady` -> `task_status.started()`; `EngineStartupFailed`, the child's exit or
   `engine_ready_timeout_s` -> `EngineStartupError` (raised after the child was stopped).

Death: the monitor waits on the process sentinel, an fd that becomes readable when the child exits
(no thread, no polling: noticed at once); an exit nobody asked for becomes `EngineDead` in the outbox.

Remote (`remote=True`, a data-parallel rank started elsewhere with `troupe engine --connect`): no
child. The ROUTER binds at `data_parallel_address` PORT + rank and waits (up to
`engine_ready_timeout_s`) for the engine's hello, then sends it the configuration (`EngineStart`).
The death signal is the connection dropping (a ZMQ socket monitor; TCP heartbeats catch a host that
vanished); shutdown is `EngineShutdown` and a bounded wait for the connection to close — the engine's
owner is whoever started it. With a `launcher` (an `EngineLauncher`: Ray, troupe.engine_side.ray_engine)
the ROUTER binds where the launcher says, the launcher starts the engine once it listens, and its
word that the engine is gone is a death signal too: a dropped connection waits up to
`LAUNCHER_CAUSE_GRACE_S` for it, so the reported death carries the launcher's cause.

Log lines the engine forwards (`EngineLog`) are written here through the frontend's logging.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import traceback
from multiprocessing.process import BaseProcess
from typing import NamedTuple, Protocol, assert_never

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.build import MakeCore
from troupe.engine.child import run_engine_process
from troupe.errors import EngineStartupError, first_startup_error
from troupe.handoff import hand_over
from troupe.log import trace_enabled
from troupe.messages import EngineCoreOutputs, EngineDead, EngineInput, EngineOutput, UtilityResult
from troupe.process.bridge import Bridge, engine_identity
from troupe.process.codec import FrameDecoder, reject_output
from troupe.process.launch import (
    bare_main,
    connect_address,
    describe_exit,
    engine_environment,
    private_address,
    rank_address,
    rank_gpu,
)
from troupe.process.logs import EngineLog, reemit
from troupe.process.protocol import (
    EngineHello,
    EngineReady,
    EngineShutdown,
    EngineStart,
    EngineStartupFailed,
    FromEngine,
    ToEngine,
)

log = structlog.get_logger("troupe.engine_process")

STREAM_BUFFER = 64
TERM_WAIT_S = 2.0  # after SIGTERM, before SIGKILL
KILL_WAIT_S = 5.0
LAUNCHER_CAUSE_GRACE_S = 2.0  # a dropped connection waits this long for the launcher's cause


class EngineLauncher(Protocol):
    """Starts a remote rank's headless engine and watches it (troupe.engine_side.ray_engine). Whoever
    made the launcher owns what it starts; `EngineProcess` only calls these three."""

    @property
    def bind_address(self) -> str:
        """Where the frontend's ROUTER binds: tcp://HOST:PORT (PORT may be "*": any free port)."""
        ...

    async def launch(self, endpoint: str) -> None:
        """Start the engine, connecting to the bound `endpoint`; returns without waiting for it."""
        ...

    async def wait_gone(self) -> str:
        """Return once the engine is gone (exited, killed, its host lost), with the cause in words."""
        ...


class EngineProcessStats(NamedTuple):
    pid: int | None
    exitcode: int | None
    sent: int
    received: int
    bad_frames: int


class EngineProcess:
    def __init__(self, config: EngineConfig, inbox: MemoryObjectReceiveStream[EngineInput],
                 outbox: MemoryObjectSendStream[EngineOutput], *, make_core: MakeCore | None = None,
                 engine_index: int = 0, remote: bool = False, launcher: EngineLauncher | None = None) -> None:
        assert launcher is None or remote, "a launcher starts remote engines only"
        if make_core is not None:
            try:
                if getattr(make_core, "__module__", None) == "__main__":
                    raise TypeError("it is defined in __main__, which the engine process does not import")
                pickle.dumps(make_core)
            except Exception as exc:
                raise ValueError(f"make_core: {make_core!r} cannot be sent to the engine process ({exc}); "
                                 "pass a function defined at the top of an importable module, or "
                                 "multiprocess=False") from exc
        self.config = config
        self.engine_index = engine_index
        self.remote = remote
        self._inbox = inbox
        self._outbox = outbox
        self._make_core = make_core
        self._launcher = launcher
        self._launcher_done: anyio.Event | None = None  # set once the launcher reported the engine gone
        self._lost = False  # a loss was reported (once: the launcher and the connection may both see it)
        self._pid: int | None = None
        self._exitcode: int | None = None
        self._bridge: Bridge[ToEngine, FromEngine] | None = None
        self._ready: EngineReady | None = None
        self._listens = False  # the child waits for EngineShutdown (it sent Ready or StartupFailed)
        self._handshake_inbox: MemoryObjectSendStream[FromEngine] | None = None  # until EngineReady
        self._stopping = False

    @property
    def ready(self) -> EngineReady:
        assert self._ready is not None, "the engine has not started"
        return self._ready

    @property
    def pids(self) -> list[int]:
        """The engine process's id while it runs (and we are not stopping it)."""
        running = self._pid is not None and self._exitcode is None and not self._stopping
        return [self._pid] if running and self._pid is not None else []

    def statistics(self) -> EngineProcessStats:
        b = self._bridge.statistics() if self._bridge is not None else None
        return EngineProcessStats(self._pid, self._exitcode, b.sent if b else 0, b.received if b else 0,
                                  b.bad_frames if b else 0)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="remote_engine" if self.remote else "engine_process",
                                               engine=self.engine_index)
        try:
            try:
                await self._run(task_status)
            except* EngineStartupError as group:  # it crossed task groups on its way out
                raise first_startup_error(group) from None
        except Exception as exc:  # before ready, whatever failed (a bind, a spawn) failed the start-up
            if self._ready is not None or isinstance(exc, EngineStartupError):
                raise
            raise EngineStartupError.from_cause(exc, traceback.format_exc()) from exc

    async def _run(self, task_status: TaskStatus[None]) -> None:
        handshake_send, handshake_recv = anyio.create_memory_object_stream[FromEngine](STREAM_BUFFER)
        self._launcher_done = anyio.Event()
        self._handshake_inbox = handshake_send
        async with self._outbox, handshake_send, handshake_recv:
            with self._address() as (address, ipc_dir):
                self._bridge = Bridge(address, bind=True, identity=engine_identity(self.engine_index),
                                      inbox=self._inbox, deliver=self._receive,
                                      decoder=FrameDecoder(FromEngine), on_bad_frame=reject_output,
                                      watch_connection=self.remote)
                async with self._bridge as bridge:
                    proc = None if self.remote else self._spawn(connect_address(bridge.endpoint))
                    if self.remote:
                        log.info("waiting for a headless engine", address=bridge.endpoint)
                    try:
                        async with anyio.create_task_group() as tg:
                            if proc is not None:
                                self._pid = proc.pid
                                tg.start_soon(self._monitor, proc)
                            else:
                                tg.start_soon(self._watch_connection, bridge)
                            if self._launcher is not None:
                                await self._launcher.launch(bridge.endpoint)
                                tg.start_soon(self._watch_launcher, self._launcher)
                            self._ready = await self._handshake(handshake_recv, ipc_dir, bridge)
                            task_status.started()
                            await anyio.sleep_forever()  # what the engine sends reaches the graph in _receive
                    finally:
                        with anyio.CancelScope(shield=True):
                            if proc is not None:
                                await self._stop(proc, bridge)
                            else:
                                await self._stop_remote(bridge)

    def _address(self) -> contextlib.AbstractContextManager[tuple[str, str | None]]:
        if self._launcher is not None:
            return contextlib.nullcontext((self._launcher.bind_address, None))
        if self.remote:
            assert self.config.data_parallel_address is not None
            return contextlib.nullcontext((rank_address(self.config.data_parallel_address, self.engine_index), None))
        return private_address(self.config, self.engine_index)

    # ------------------------------------------------------------------ start-up

    def _spawn(self, address: str) -> BaseProcess:
        gpu = rank_gpu(self.config, self.engine_index)  # raises before anything starts: too few GPUs
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, name=f"troupe-engine-{self.engine_index}", daemon=True,
            kwargs=dict(config=self.config, address=address, engine_index=self.engine_index,
                        parent_pid=os.getpid(), make_core=self._make_core,
                        log_level="trace" if trace_enabled() else None))
        with engine_environment(gpu), bare_main():
            proc.start()
        log.info("engine process started", pid=proc.pid, address=address, **gpu)
        return proc

    async def _handshake(self, messages: MemoryObjectReceiveStream[FromEngine], ipc_dir: str | None,
                         bridge: Bridge[ToEngine, FromEngine]) -> EngineReady:
        timeout = self.config.engine_ready_timeout_s
        with anyio.move_on_after(timeout) as deadline:
            async for msg in messages:
                match msg:
                    case EngineHello():
                        if ipc_dir is not None:  # connected: the socket file has done its job
                            shutil.rmtree(ipc_dir, ignore_errors=True)
                        if self.remote:
                            log.info("headless engine connected", pid=msg.pid)
                            self._listens = True
                            await bridge.send(EngineStart(self.config))
                    case EngineLog():
                        reemit(msg)
                    case EngineReady():
                        self._listens = True
                        log.info("engine ready", pid=msg.pid, kv_blocks=msg.num_blocks)
                        return msg
                    case EngineStartupFailed():
                        self._listens = bool(msg.traceback)  # a synthetic one (process exit) has none
                        raise EngineStartupError(f"EngineCore failed to start: {msg.error_type}: {msg.message}",
                                                 cause_type=msg.error_type, cause_message=msg.message,
                                                 engine_traceback=msg.traceback)
                    case _:
                        raise EngineStartupError(f"EngineCore sent {type(msg).__name__} before it was ready")
        if deadline.cancelled_caught:
            raise EngineStartupError(f"EngineCore was not ready after engine_ready_timeout_s={timeout:g} s; "
                                     "its process was stopped")
        raise EngineStartupError("the engine's channel closed before it was ready")

    # ------------------------------------------------------------------ running

    async def _receive(self, msg: FromEngine) -> None:
        """Every message from the engine (the bridge's pump awaits this for each one, in order) and the
        watchers' word of its loss: to the handshake until `EngineReady` went there, then to the graph
        from here, with no relay task between the socket and the graph."""
        if (handshake := self._handshake_inbox) is not None:
            if isinstance(msg, EngineReady):
                self._handshake_inbox = None  # what comes after it is the graph's
            await handshake.send(msg)
            return
        match msg:
            case EngineCoreOutputs() | UtilityResult() | EngineDead():
                await hand_over(self._outbox, msg)
            case EngineStartupFailed():  # a watcher's word for an exit it saw before ready was read
                await self._outbox.send(EngineDead(reason=msg.message, engine_index=self.engine_index))
            case EngineLog():
                reemit(msg)
            case EngineHello() | EngineReady():
                raise RuntimeError(f"EngineCore sent {type(msg).__name__} after it was ready")
            case _:
                assert_never(msg)

    async def _monitor(self, proc: BaseProcess) -> None:
        await anyio.wait_readable(proc.sentinel)
        await anyio.to_thread.run_sync(proc.join, KILL_WAIT_S)  # reaps it: microseconds after EOF
        self._exitcode = proc.exitcode
        await self._report_loss("EngineProcessExited", f"engine process {proc.pid} {describe_exit(proc.exitcode)}",
                                pid=proc.pid, exitcode=proc.exitcode)

    async def _watch_connection(self, bridge: Bridge[ToEngine, FromEngine]) -> None:
        await bridge.disconnected.wait()
        what = f"the connection to headless engine {self.engine_index} dropped"
        if self._launcher is not None:
            assert self._launcher_done is not None
            with anyio.move_on_after(LAUNCHER_CAUSE_GRACE_S):
                await self._launcher_done.wait()
            if self._launcher_done.is_set():
                return  # the launcher reported it, with its cause
            what += f" (its launcher gave no cause within {LAUNCHER_CAUSE_GRACE_S:g} s)"
        await self._report_loss("EngineDisconnected", what)

    async def _watch_launcher(self, launcher: EngineLauncher) -> None:
        assert self._launcher_done is not None
        cause = await launcher.wait_gone()
        await self._report_loss("EngineLost", cause)
        self._launcher_done.set()

    async def _report_loss(self, error_type: str, what: str, **fields: object) -> None:
        """The engine went away without being asked: a failed start-up before ready, else EngineDead."""
        if self._stopping or self._lost:
            return
        self._lost = True
        if self._ready is None:
            await self._receive(EngineStartupFailed(self.engine_index, error_type, what, ""))
        else:
            log.error("engine lost", reason=what, **fields)
            await self._receive(EngineDead(reason=what, engine_index=self.engine_index))

    # ------------------------------------------------------------------ shutdown

    async def _stop_remote(self, bridge: Bridge[ToEngine, FromEngine]) -> None:
        self._stopping = True
        if self._listens and not bridge.disconnected.is_set():
            with anyio.move_on_after(1.0), contextlib.suppress(anyio.ClosedResourceError):
                await bridge.send(EngineShutdown())
            with anyio.move_on_after(self.config.engine_shutdown_timeout_s):
                await bridge.wait_disconnected()
            log.info("headless engine stopped" if bridge.disconnected.is_set()
                     else "headless engine did not close its connection in time")

    async def _stop(self, proc: BaseProcess, bridge: Bridge[ToEngine, FromEngine]) -> None:
        self._stopping = True
        try:
            if proc.is_alive() and self._listens:
                with anyio.move_on_after(1.0), contextlib.suppress(anyio.ClosedResourceError):
                    await bridge.send(EngineShutdown())
                if await _wait_exit(proc, self.config.engine_shutdown_timeout_s):
                    return
                log.warning("engine process did not stop in time: SIGTERM", pid=proc.pid)
            if proc.is_alive():
                proc.terminate()
                if await _wait_exit(proc, TERM_WAIT_S):
                    return
                log.warning("engine process ignored SIGTERM: SIGKILL", pid=proc.pid)
                proc.kill()
                await _wait_exit(proc, KILL_WAIT_S)
        finally:
            self._exitcode = proc.exitcode
            if proc.exitcode is not None:
                log.info("engine process stopped", pid=proc.pid, exitcode=proc.exitcode)
                proc.close()


async def _wait_exit(proc: BaseProcess, within_s: float) -> bool:
    with anyio.move_on_after(within_s):
        await anyio.wait_readable(proc.sentinel)
        await anyio.to_thread.run_sync(proc.join, KILL_WAIT_S)
    return proc.exitcode is not None
