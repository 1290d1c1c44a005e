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
3. Build the EngineCore in a worker thread (torch threads: `num_threads`, else all cores); send
   `EngineReady`, or `EngineStartupFailed` with the traceback and wait for `EngineShutdown`.
4. Serve: frontend messages go to the actor's inbox while the actor steps in a worker thread, so
   socket I/O and decoding overlap the model step and aborts never wait for a step. After the actor
   reported `EngineDead`, inputs are dropped and the process waits for `EngineShutdown` (exit 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, assert_never

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.actors.engine_side import MakeCore, build_core, ready_info
from troupe.config import EngineConfig
from troupe.errors import EngineStartupError
from troupe.log import configure_logging
from troupe.messages import AbortRequest, AddRequest, EngineInput, UtilityCall
from troupe.process.bridge import Bridge, engine_identity
from troupe.process.codec import FrameDecoder, reject_input
from troupe.process.protocol import (
    EngineHello,
    EngineShutdown,
    EngineStartupFailed,
    FromEngine,
    ToEngine,
)

if TYPE_CHECKING:
    from troupe.core.engine_core import EngineCore

log = structlog.get_logger("troupe.engine_main")

STREAM_BUFFER = 64
EXIT_OK, EXIT_FAILED, EXIT_PARENT_GONE = 0, 1, 3
WATCHDOG_PERIOD_S = 0.5
SHUTDOWN_WAIT_S = 60.0  # after a failure: how long to wait for the frontend's EngineShutdown
PR_SET_PDEATHSIG = 1


def run_engine_process(*, config: EngineConfig, address: str, engine_index: int, parent_pid: int,
                       make_core: MakeCore | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the frontend set it; in case torch is not loaded yet
    configure_logging()
    structlog.contextvars.bind_contextvars(engine=engine_index, pid=os.getpid())
    code = anyio.run(_serve, config, address, engine_index, make_core, backend="asyncio")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to clean up; interpreter teardown with torch loaded is slow


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


def _build(config: EngineConfig, make_core: MakeCore | None) -> EngineCore:
    import torch

    torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
    return build_core(config, make_core)


async def _serve(config: EngineConfig, address: str, engine_index: int, make_core: MakeCore | None) -> int:
    to_wire_send, to_wire_recv = anyio.create_memory_object_stream[FromEngine](STREAM_BUFFER)
    from_wire_send, from_wire_recv = anyio.create_memory_object_stream[ToEngine](STREAM_BUFFER)
    bridge = Bridge(address, bind=False, identity=engine_identity(engine_index), inbox=to_wire_recv,
                    outbox=from_wire_send, decoder=FrameDecoder(ToEngine), on_bad_frame=reject_input)
    async with bridge, to_wire_send, from_wire_recv:
        await to_wire_send.send(EngineHello(engine_index, os.getpid()))
        try:
            core = await anyio.to_thread.run_sync(_build, config, make_core)
        except EngineStartupError as exc:
            log.error("engine start-up failed", error=f"{exc.cause_type}: {exc.cause_message}")
            await to_wire_send.send(EngineStartupFailed(engine_index, exc.cause_type, exc.cause_message,
                                                        exc.engine_traceback))
            with anyio.move_on_after(SHUTDOWN_WAIT_S):
                async for msg in from_wire_recv:
                    if isinstance(msg, EngineShutdown):
                        break
            return EXIT_FAILED
        await to_wire_send.send(ready_info(core, engine_index))
        return await _run_engine(core, engine_index, to_wire_send, from_wire_recv)


async def _run_engine(core: EngineCore, engine_index: int, outbox: MemoryObjectSendStream[FromEngine],
                      inbox: MemoryObjectReceiveStream[ToEngine]) -> int:
    from troupe.actors.engine_core_actor import EngineCoreActor

    engine_send, engine_recv = anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
    actor = EngineCoreActor(core, engine_recv, outbox.clone(), engine_index=engine_index)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        async with engine_send:
            async for msg in inbox:
                match msg:
                    case EngineShutdown():
                        break
                    case AddRequest() | AbortRequest() | UtilityCall():
                        with contextlib.suppress(anyio.BrokenResourceError):  # a dead engine takes nothing
                            await engine_send.send(msg)
                    case _:
                        assert_never(msg)
        tg.cancel_scope.cancel()  # the step in flight finishes first
    log.info("engine process exiting", failed=actor.failed)
    return EXIT_FAILED if actor.failed else EXIT_OK
