"""The engine process: `run_engine_process` is the multiprocessing ("spawn") target.

Owns:     the `EngineCoreActor`, the engine-side `Bridge` (a DEALER connected to the frontend's
          ROUTER, under the engine's identity) and a parent watchdog thread.
Shutdown: `EngineShutdown` from the frontend (the step in flight finishes, exit 0); SIGTERM /
          SIGKILL from it; or the parent's death (below). SIGINT is ignored: Ctrl-C in a terminal
          reaches the whole process group, and it is the frontend that decides when to stop.

1. Die with the parent: PR_SET_PDEATHSIG=SIGKILL (Linux; the kernel kills us when the thread that
   spawned us ends) and a watchdog thread that exits when `os.getppid()` changes (any OS; it also
   covers a parent that died before the prctl).
2. Connect and send `EngineHello`, before torch is imported.
3. Build the EngineCore on the engine's step thread (`core_actor.step_thread`; torch threads:
   `num_threads`, else all cores); send `EngineReady`, or `EngineStartupFailed` with the traceback and
   wait for `EngineShutdown`. What is alive once it is built is frozen out of the cyclic collector
   while it serves (`startup_heap_frozen`).
4. Serve: the actor reads the bridge's stream directly while it steps on that same thread, so socket
   I/O and decoding overlap the model step and aborts never wait for a step; `EngineShutdown` is one
   more case of its inbox. After the actor reported `EngineDead`, inputs are dropped and the process
   waits for `EngineShutdown` (exit 1).

Log lines go to the frontend over the same socket (troupe.process.logs), which writes them.

`run_headless_engine` is the same engine started by hand (`troupe engine --connect`), possibly on
another host: no parent to watch, so it exits when the frontend's connection drops; and it has no
configuration of its own: the frontend sends it (`EngineStart`) after the hello. A Ray actor runs
it too (`serve_headless`, troupe.engine_side.ray_engine).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.build import MakeCore, build_core, ready_info
from troupe.engine.core_actor import EngineCoreActor, StepThread, run_on, step_thread
from troupe.errors import EngineStartupError
from troupe.handoff import hand_over
from troupe.process.bridge import Bridge, engine_identity
from troupe.process.codec import FrameDecoder, reject_input
from troupe.process.launch import engine_omp_settings, rank_address
from troupe.process.logs import ForwardToFrontend, configure_child_logging, log_channel, pump
from troupe.process.protocol import (
    EngineHello,
    EngineShutdown,
    EngineStart,
    EngineStartupFailed,
    FromEngine,
    ToEngine,
)

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore

log = structlog.get_logger("troupe.engine_child")

STREAM_BUFFER = 64
EXIT_OK, EXIT_FAILED, EXIT_PARENT_GONE = 0, 1, 3
EXIT_LOOPED = -1  # internal: a headless engine's socket connected to itself; it connects again
WATCHDOG_PERIOD_S = 0.5
SHUTDOWN_WAIT_S = 60.0  # after a failure: how long to wait for the frontend's EngineShutdown
PR_SET_PDEATHSIG = 1


def run_engine_process(*, config: EngineConfig, address: str, engine_index: int, parent_pid: int,
                       make_core: MakeCore | None = None, log_level: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    os.environ.update(engine_omp_settings())  # the frontend set them; in case torch is not loaded yet
    forward = configure_child_logging(log_level)
    structlog.contextvars.bind_contextvars(engine=engine_index, pid=os.getpid())
    code = anyio.run(_serve, config, address, engine_index, make_core, forward, backend="asyncio")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to clean up; interpreter teardown with torch loaded is slow


def run_headless_engine(address: str, rank: int, *, num_threads: int | None = None,
                        log_level: str | None = None, start_timeout_s: float | None = None,
                        serve_forever: bool = False) -> int:
    """`troupe engine --connect tcp://HOST:PORT --rank R`: an engine that joins a frontend.

    Connects to PORT + R on HOST (the frontend listens on one port per rank from
    `data_parallel_address`), says hello, waits for the frontend's configuration (`EngineStart`;
    `num_threads` here overrides its thread count), then serves it like a spawned engine. Returns
    the exit code: 0 after the frontend's `EngineShutdown`, 1 if the engine failed, 3 if the
    frontend went away (its connection dropped) or sent nothing within `start_timeout_s`.

    `serve_forever`: after a frontend leaves (shutdown, failure or a dropped connection), wait for
    the next one, with a fresh EngineCore (its configuration may differ); only a signal stops it.
    """
    target = rank_address(address, rank)  # a bad address fails before anything is set up
    return serve_headless(target, rank, num_threads=num_threads, log_level=log_level,
                          start_timeout_s=start_timeout_s, serve_forever=serve_forever)


def serve_headless(target: str, rank: int, *, num_threads: int | None = None, log_level: str | None = None,
                   start_timeout_s: float | None = None, serve_forever: bool = False) -> int:
    """`run_headless_engine` at exactly `target`, the frontend's endpoint for this rank (a launcher
    that was told it: troupe.engine_side.ray_engine)."""
    os.environ.update(engine_omp_settings())  # effective if torch is not loaded yet (the CLI defers it)
    forward = configure_child_logging(log_level)
    structlog.contextvars.bind_contextvars(engine=rank, pid=os.getpid())
    headless = _Headless(num_threads, start_timeout_s, serve_forever)
    while True:
        log.info("headless engine connecting", address=target)
        code = anyio.run(_serve, None, target, rank, None, forward, headless, backend="asyncio")
        if code == EXIT_LOOPED:  # it reached itself, not a frontend: nothing happened, connect again
            continue
        if not serve_forever:
            return code
        log.info("frontend session over: waiting for the next one", exit_code=code)


class _Headless(NamedTuple):
    num_threads: int | None
    start_timeout_s: float | None
    serve_forever: bool = False


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(EXIT_PARENT_GONE)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="troupe-parent-watchdog",
                     daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    tick = threading.Event()
    while os.getppid() == parent_pid:
        tick.wait(WATCHDOG_PERIOD_S)
    os._exit(EXIT_PARENT_GONE)


def default_threads(config: EngineConfig) -> int:
    """Torch threads of one engine when `num_threads` is not set: this host's cores shared by the
    engines it runs (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, config.num_local_engines))


def _build(config: EngineConfig, make_core: MakeCore | None, engine_index: int) -> EngineCore:
    import torch

    torch.set_num_threads(config.num_threads or default_threads(config))
    return build_core(config, make_core, engine_index)


async def _serve(config: EngineConfig | None, address: str, engine_index: int, make_core: MakeCore | None,
                 forward: ForwardToFrontend, headless: _Headless | None = None) -> int:
    to_wire_send, to_wire_recv = anyio.create_memory_object_stream[FromEngine](STREAM_BUFFER)
    from_wire_send, from_wire_recv = anyio.create_memory_object_stream[ToEngine](STREAM_BUFFER)
    bridge = Bridge(address, bind=False, identity=engine_identity(engine_index), inbox=to_wire_recv,
                    deliver=functools.partial(hand_over, from_wire_send), decoder=FrameDecoder(ToEngine),
                    on_bad_frame=reject_input,
                    watch_connection=headless is not None)
    log_send, log_recv = log_channel()
    watch, loop_watch = anyio.CancelScope(), anyio.CancelScope()
    looped = False

    async def start_over_when_looped() -> None:
        nonlocal looped
        with loop_watch:
            await bridge.looped.wait()  # our hello went to ourselves: this session can never start
            looped = True
            tg.cancel_scope.cancel()

    async with bridge, to_wire_send, from_wire_send, from_wire_recv, anyio.create_task_group() as tg:
        tg.start_soon(pump, log_recv, to_wire_send.clone().send)
        forward.attach(log_send)
        try:
            await to_wire_send.send(EngineHello(engine_index, os.getpid()))
            if headless is not None:
                tg.start_soon(start_over_when_looped)
                tg.start_soon(_exit_when_frontend_leaves, bridge, watch,
                              tg.cancel_scope if headless.serve_forever else None)
                config = await _await_config(from_wire_recv, headless)
                if config is None:
                    return EXIT_PARENT_GONE
            assert config is not None
            return await _build_and_run(config, engine_index, make_core, to_wire_send, from_wire_recv)
        finally:
            watch.cancel()  # leaving by design from here on
            loop_watch.cancel()
            forward.detach()
            log_send.close()  # the pump sends what is queued, then ends
    # reached only when the session was cancelled: it connected to itself, or the frontend went away
    return EXIT_LOOPED if looped else EXIT_PARENT_GONE


async def _build_and_run(config: EngineConfig, engine_index: int, make_core: MakeCore | None,
                         to_wire_send: MemoryObjectSendStream[FromEngine],
                         from_wire_recv: MemoryObjectReceiveStream[ToEngine]) -> int:
    with step_thread(engine_index) as pool:  # builds the core and steps it: one OpenMP team (core_actor)
        try:
            core = await run_on(pool, _build, config, make_core, engine_index)
        except EngineStartupError as exc:
            log.error("engine start-up failed", error=f"{exc.cause_type}: {exc.cause_message}")
            await to_wire_send.send(EngineStartupFailed(engine_index, exc.cause_type, exc.cause_message,
                                                        exc.engine_traceback))
            with anyio.move_on_after(SHUTDOWN_WAIT_S):
                await _until_shutdown(from_wire_recv)
            return EXIT_FAILED
        await to_wire_send.send(ready_info(core, engine_index))
        with startup_heap_frozen():
            return await _run_engine(core, engine_index, to_wire_send, from_wire_recv, pool)


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Move every object alive now (imported modules, the model, the pool, the graphs) into the cyclic
    collector's permanent generation until the block ends, after collecting what is garbage already.

    They live as long as the engine, yet each full collection would scan them all (over a hundred
    thousand objects in the default model's engine process): a stall of a whole step every time the step
    loop's own survivors trigger one. Frozen, a full collection scans only what the loop made. Unfrozen on the
    way out, so that a headless engine's next session can collect this one's garbage."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _await_config(inbox: MemoryObjectReceiveStream[ToEngine], headless: _Headless) -> EngineConfig | None:
    with anyio.move_on_after(headless.start_timeout_s):
        async for msg in inbox:
            match msg:
                case EngineStart():
                    config = msg.config
                    if headless.num_threads is not None:
                        config = msgspec.structs.replace(config, num_threads=headless.num_threads)
                    elif config.num_threads is None:  # alone on its host: all its cores
                        config = msgspec.structs.replace(config, num_threads=len(os.sched_getaffinity(0)))
                    log.info("configuration received", model=config.model)
                    return config
                case EngineShutdown():
                    return None
                case _:
                    log.warning("message before the configuration ignored", type=type(msg).__name__)
    log.error("no configuration from the frontend", within_s=headless.start_timeout_s)
    return None


async def _exit_when_frontend_leaves(bridge: Bridge[FromEngine, ToEngine], scope: anyio.CancelScope,
                                     session: anyio.CancelScope | None) -> None:
    """The frontend's connection dropped: exit (as a spawned engine does when its parent dies), or
    with `serve_forever` end this session (`session`: its scope)."""
    with scope:
        await bridge.disconnected.wait()
        if session is not None:
            log.warning("the frontend went away: ending the session")
            session.cancel()
            return
        print("troupe engine: the frontend went away (its connection dropped): exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PARENT_GONE)


async def _run_engine(core: EngineCore, engine_index: int, outbox: MemoryObjectSendStream[FromEngine],
                      inbox: MemoryObjectReceiveStream[ToEngine], pool: StepThread) -> int:
    """The actor reads the bridge's stream itself (one hand-off between the socket and the step loop)
    and stops at `EngineShutdown`. An actor that failed (`EngineDead` sent) leaves the rest of the
    stream here: inputs are dropped until the frontend's `EngineShutdown`."""
    actor = EngineCoreActor(core, inbox, outbox.clone(), engine_index=engine_index, step_thread=pool)
    await actor.run()
    if actor.failed:
        await _until_shutdown(inbox)
    log.info("engine process exiting", failed=actor.failed)
    return EXIT_FAILED if actor.failed else EXIT_OK


async def _until_shutdown(inbox: MemoryObjectReceiveStream[ToEngine]) -> None:
    """Drop what the frontend sends until its `EngineShutdown` (or the end of the stream): after a
    failure the engine's last message must not be lost to `linger=0` by leaving first."""
    async for msg in inbox:
        if isinstance(msg, EngineShutdown):
            return
