"""`InProcessEngine`: the engine side in the frontend's own process (`multiprocess=False`).

Builds the EngineCore on the engine's step thread (`core_actor.step_thread`: the build and the steps on one
thread, one OpenMP team), then runs the `EngineCoreActor` on it in the graph's task group on the graph's two
stream ends, with no process or wire between them. Several in-process ranks share the
process, so they cannot each take a GPU: on CUDA, `make_engine_side` refuses them (an `InvalidInputError`
naming `multiprocess`; spawned ranks get one GPU each, `troupe.process.launch.rank_gpu`).
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.config import EngineConfig
from troupe.engine.build import MakeCore, build_core, ready_info
from troupe.engine.core_actor import EngineCoreActor, run_on, step_thread
from troupe.messages import EngineInput, EngineOutput
from troupe.process.protocol import EngineReady


class InProcessEngine:
    """The engine side in this process: an `EngineCoreActor` whose core is built on its step thread."""

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
        with step_thread(self.engine_index) as pool:
            core = await run_on(pool, build_core, self.config, self._make_core, self.engine_index)
            self._ready = ready_info(core, self.engine_index)
            self.actor = EngineCoreActor(core, self._inbox, self._outbox, engine_index=self.engine_index,
                                         step_thread=pool)
            async with self._inbox:  # the actor reads it; its owner closes it
                await self.actor.run(task_status=task_status)
