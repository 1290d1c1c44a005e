"""A scripted fake engine, a one-character-per-token tokenizer and the in-process app over them:
what the server-app tests (tests/server/test_server_app.py, test_server_choices.py,
test_server_tools.py) drive instead of a real engine."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette

from troupe.config import EngineConfig
from troupe.errors import EngineDeadError
from troupe.messages import SchedulerStats
from troupe.outputs import CompletionOutput, RequestOutput
from troupe.sampling_params import SamplingParams
from troupe.server.app import build_app
from troupe.server.state import ServerSettings


def delta(text: str, token: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", text, [1, 2, 3], [CompletionOutput(0, text, [token], finish_reason=finish)],
                         finished=finish is not None)


class FakeTokenizer:
    """One token per character; the chat template joins the messages' contents and records what it got."""

    rendered: list[tuple[list[Any], dict[str, Any]]] = []  # (messages, keyword arguments) of each render

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        FakeTokenizer.rendered.append((list(messages), kwargs))
        return "".join(str(m["content"]) for m in messages)


class FakeEngine:
    """Yields `script` (outputs, or an exception to raise at that point); records what was closed."""

    def __init__(self, script: Sequence[RequestOutput | BaseException], *, dead: bool = False,
                 block_after: int | None = None) -> None:
        self.config = EngineConfig(model="fake")
        self.script = script
        self.dead = dead
        self.block_after = block_after  # wait forever after this many outputs (a long generation)
        self.started = anyio.Event()
        self.closed: list[str] = []
        self.aborted: list[str] = []
        self.calls: list[tuple[str | Mapping[str, Any], SamplingParams | None]] = []  # (prompt, params) submitted
        self.generation_defaults: dict[str, Any] = {}

    @property
    def errored(self) -> bool:
        return self.dead

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError("EngineCore died: injected")

    @property
    def engine_stats(self) -> dict[int, SchedulerStats]:
        return {0: SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25)}

    async def check_health(self) -> None:
        if self.dead:
            raise self.dead_error

    max_model_len = 2048

    def get_tokenizer(self) -> Any:
        return FakeTokenizer()

    async def abort(self, request_id: str | Sequence[str]) -> None:
        self.aborted.extend([request_id] if isinstance(request_id, str) else request_id)

    async def generate(self, prompt: str | Mapping[str, Any], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncGenerator[RequestOutput]:
        finished = False
        self.calls.append((prompt, sampling_params))
        try:
            for i, item in enumerate(self.script):
                if self.block_after is not None and i == self.block_after:
                    self.started.set()
                    await anyio.sleep_forever()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.closed.append(str(request_id))



def make_app(engine: FakeEngine, **settings: Any) -> Starlette:
    @asynccontextmanager
    async def open_engine() -> AsyncIterator[FakeEngine]:
        yield engine

    return build_app(ServerSettings(served_model_names=["fake"], **settings), open_engine)


@asynccontextmanager
async def serving(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client
