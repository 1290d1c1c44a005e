"""The frontend's engine sides: what the graph holds for each engine, wherever that engine runs.

Every side takes the same pair of stream ends from the graph (`EngineInput` in, `EngineOutput` out),
starts with `await tg.start(side.run)` (returning once the engine is ready, or raising
`EngineStartupError`), then exposes `ready` (an `EngineReady`: limits, model path, KV blocks) and
`pids`. Nothing else in the graph or the facades knows which one runs.

- `InProcessEngine` (troupe.engine_side.in_process, `multiprocess=False`, for debugging): builds the
  EngineCore on its step thread and runs the `EngineCoreActor` there, in the graph's task group.
- `EngineProcess` (troupe.engine_side.engine_process, the default): the same actor in a spawned
  process, behind a ZMQ bridge; or (`remote=True`) in a headless engine that joins over TCP.
- `RayEngine` (troupe.engine_side.ray_engine, `data_parallel_backend="ray"`): that headless engine in
  a Ray actor the side places and owns.

What runs beside the model (the core actor, its build, the engine process's main) is troupe.engine;
the wire the process and Ray sides talk over (bridge, codec, protocol, launch, logs) is troupe.process.
`make_engine_side` picks a rank's side from the configuration.
"""

from __future__ import annotations

from typing import Any, Protocol

from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.build import MakeCore
from troupe.engine_side.engine_process import EngineProcess
from troupe.engine_side.in_process import InProcessEngine
from troupe.engine_side.ray_engine import RayEngine
from troupe.errors import InvalidInputError
from troupe.messages import EngineInput, EngineOutput
from troupe.process.launch import rank_gpu
from troupe.process.protocol import EngineReady


class EngineSide(Protocol):
    @property
    def ready(self) -> EngineReady: ...

    @property
    def pids(self) -> list[int]: ...

    async def run(self, *, task_status: TaskStatus[None] = ...) -> None: ...

    def statistics(self) -> Any: ...


def make_engine_side(config: EngineConfig, inbox: MemoryObjectReceiveStream[EngineInput],
                     outbox: MemoryObjectSendStream[EngineOutput], *,
                     make_core: MakeCore | None = None, engine_index: int = 0) -> EngineSide:
    """Rank `engine_index`'s side: ranks below `num_local_engines` start here (in this process with
    `multiprocess=False`, else in a spawned one); the others are headless engines that join over TCP;
    with `data_parallel_backend="ray"` every rank is a Ray actor (troupe.engine_side.ray_engine).

    Raises `InvalidInputError` before anything starts when local ranks cannot have a GPU each on CUDA
    (`rank_gpu`: fewer GPUs than spawned ranks; several ranks in this process)."""
    if config.data_parallel_backend == "ray":
        return RayEngine(config, inbox, outbox, engine_index=engine_index)
    remote = engine_index >= config.num_local_engines
    if not remote and rank_gpu(config, engine_index) and not config.multiprocess:
        raise InvalidInputError("multiprocess", f"{config.num_local_engines} data-parallel ranks on CUDA need a "
                                "process and a GPU each: leave multiprocess=True")
    if not remote and not config.multiprocess:
        return InProcessEngine(config, inbox, outbox, make_core=make_core, engine_index=engine_index)
    return EngineProcess(config, inbox, outbox, make_core=None if remote else make_core,
                         engine_index=engine_index, remote=remote)
