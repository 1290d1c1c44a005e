"""The graph's engine side: the EngineCore in this process, or a client of an engine process.

Both take the same pair of stream ends from the graph (`EngineInput` in, `EngineOutput` out),
start with `await tg.start(side.run)` (returning once the engine is ready, or raising
`EngineStartupError`), then expose `ready` (an `EngineReady`: limits, model path, KV blocks) and
`pids`. Nothing else in the graph or the facades knows which one runs.

- `InProcessEngine` (`multiprocess=False`, for debugging): builds the EngineCore in a worker thread
  and runs the `EngineCoreActor` in the graph's task group.
- `EngineProcess` (troupe.process.client, the default): the same actor in a spawned process,
  behind a ZMQ bridge; or (`remote=True`) in a headless engine that joins over TCP.
- `RayEngine` (troupe.process.ray_engines, `data_parallel_backend="ray"`): that headless engine in
  a Ray actor the side places and owns.

Both build the core with `troupe.engine.build.build_core` (the test-only fault hooks, failures as
`EngineStartupError`) and report it with `ready_info`.
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.build import EngineReady, MakeCore, build_core, ready_info
from troupe.engine.core_actor import EngineCoreActor
from troupe.messages import EngineInput, EngineOutput
from troupe.process.client import EngineProcess
from troupe.process.ray_engines import RayEngine


class EngineSide(Protocol):
    @property
    def ready(self) -> EngineReady: ...

    @property
    def pids(self) -> list[int]: ...

    async def run(self, *, task_status: TaskStatus[None] = ...) -> None: ...

    def statistics(self) -> Any: ...



class InProcessEngine:
    """The engine side in this process: an `EngineCoreActor` whose core is built in a worker thread."""

    def __init__(self, config: EngineConfig, inbox: MemoryObjectReceiveStream[EngineInput],
                 outbox: MemoryObjectSendStream[EngineOutput], *, make_core: MakeCore | None = None,
                 engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index
        self._inbox = inbox
        self._outbox = outbox
        self._make_core = make_core
        self._ready: EngineReady | None = None
        self.actor: EngineCoreActor | None = None

    @property
    def ready(self) -> EngineReady:
        assert self._ready is not None, "the engine has not started"
        return self._ready

    @property
    def pids(self) -> list[int]:
        return []

    def statistics(self) -> Any:
        return self.actor.statistics() if self.actor is not None else None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        core = await anyio.to_thread.run_sync(build_core, self.config, self._make_core, self.engine_index)
        self._ready = ready_info(core, self.engine_index)
        self.actor = EngineCoreActor(core, self._inbox, self._outbox, engine_index=self.engine_index)
        await self.actor.run(task_status=task_status)


def make_engine_side(config: EngineConfig, inbox: MemoryObjectReceiveStream[EngineInput],
                     outbox: MemoryObjectSendStream[EngineOutput], *,
                     make_core: MakeCore | None = None, engine_index: int = 0) -> EngineSide:
    """Rank `engine_index`'s side: ranks below `num_local_engines` start here (in this process with
    `multiprocess=False`, else in a spawned one); the others are headless engines that join over TCP;
    with `data_parallel_backend="ray"` every rank is a Ray actor (troupe.process.ray_engines)."""
    if config.data_parallel_backend == "ray":
        return RayEngine(config, inbox, outbox, engine_index=engine_index)
    remote = engine_index >= config.num_local_engines
    if not remote and not config.multiprocess:
        return InProcessEngine(config, inbox, outbox, make_core=make_core, engine_index=engine_index)
    return EngineProcess(config, inbox, outbox, make_core=None if remote else make_core,
                         engine_index=engine_index, remote=remote)
