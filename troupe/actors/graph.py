"""The actor graph, wired in one place.

```
 facades --Submission/AbortRequest--> input processor --AddRequest/Abort--> engine side
                                                                               |
 facades <--RequestStream (per request)-- output handler <--EngineOutput-------+
                                             |--AbortRequest (stop strings)--> engine side
```

`Graph` is an async context manager. Entering it starts the engine side first (the model loads
in a worker thread) and returns once the engine is ready and every actor has started. Leaving
it aborts what is still running (each stream ends with finish_reason "abort"), closes the
submission stream and cancels the actors' task group; an engine step in flight finishes first.

An actor that crashes does not take the caller's code down with it: `_supervised` turns the
crash into `EngineDeadError` for every live and every later request (`RequestTable.fail_all`).
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from troupe.actors.engine_core_actor import EngineCoreActor
from troupe.actors.input_processor import FrontendInput, InputProcessor
from troupe.actors.output_handler import OutputHandler
from troupe.actors.requests import RequestTable
from troupe.config import EngineConfig
from troupe.core.engine_core import EngineCore
from troupe.inputs import ModelLimits
from troupe.messages import EngineInput, EngineOutput
from troupe.models.loader import load_tokenizer

log = structlog.get_logger("troupe.graph")

STREAM_BUFFER = 64


class Graph(anyio.AsyncContextManagerMixin):
    """The running actor graph of one `AsyncLLM` (in-process engine)."""

    def __init__(self, config: EngineConfig, *,
                 make_core: Callable[[EngineConfig], EngineCore] | None = None) -> None:
        self.config = config
        self._make_core = make_core or EngineCore
        self.table: RequestTable = None  # type: ignore[assignment]  # made once the tokenizer is loaded
        self.tokenizer: Any = None
        self.limits: ModelLimits | None = None
        self.submit: MemoryObjectSendStream[FrontendInput] | None = None
        self.engine_actor: EngineCoreActor | None = None
        self.output_handler: OutputHandler | None = None
        self.input_processor: InputProcessor | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Graph]:
        # 1. every stream, bounded; each task gets its own clone of a shared end
        to_engine_send, to_engine_recv = anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
        from_engine_send, from_engine_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        submit_send, submit_recv = anyio.create_memory_object_stream[FrontendInput](STREAM_BUFFER)
        async with anyio.create_task_group() as tg:
            # 2. the engine side first: its model decides the limits the frontend checks against
            core = await anyio.to_thread.run_sync(self._make_core, self.config)
            self.engine_actor = EngineCoreActor(core, to_engine_recv, from_engine_send)
            await tg.start(self._supervised, "engine_core", self.engine_actor._run)
            self.tokenizer = await anyio.to_thread.run_sync(load_tokenizer, core.runner.model_path)
            self.table = RequestTable(self.tokenizer)
            self.limits = core.limits
            # 3. the frontend actors
            self.output_handler = OutputHandler(self.table, from_engine_recv, to_engine_send.clone(),
                                                chunk_size=self.config.output_chunk_size)
            await tg.start(self._supervised, "output_handler", self.output_handler.run)
            self.input_processor = InputProcessor(self.tokenizer, self.limits, self.table, submit_recv,
                                                  to_engine_send)
            await tg.start(self._supervised, "input_processor", self.input_processor.run)
            self.submit = submit_send
            log.info("graph ready", model=self.config.model, max_model_len=self.limits.max_model_len,
                     kv_blocks=core.runner.num_blocks)
            try:
                yield self
            finally:
                # 4. shutdown: end every stream, stop taking work, then stop the actors
                self.table.abort(list(self.table.streams))
                submit_send.close()
                tg.cancel_scope.cancel()

    async def _supervised(self, name: str, run: Callable[..., Awaitable[None]], *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await run(task_status=task_status)
        except Exception as exc:
            log.error("actor crashed", crashed_actor=name, exc_info=exc)
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.table.fail_all(f"{name} crashed: {reason}", exc)
