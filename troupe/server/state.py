"""`ServerState`: what one app holds, and `EngineClient`: the part of `AsyncLLM` it uses.

The app takes its engine by dependency (`build_app(settings, open_engine)`); the lifespan enters
`open_engine()` and sets `ServerState.llm` for as long as the server runs. Tests pass a fake
engine the same way.

Every request the server submits runs through `ServerState.follow`, which registers it as in
flight (so a shutdown can abort what is left after the grace time), feeds its metrics record,
and closes the engine's generator however the consumer stops (closing it aborts the request).
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from troupe.config import EngineConfig
from troupe.errors import EngineDeadError, EngineGenerateError, InvalidInputError
from troupe.messages import SchedulerStats
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams
from troupe.server.errors import APIError
from troupe.server.metrics import ServerMetrics
from troupe.server.watchdog import LoopWatchdog

MAX_BODY_BYTES = 16 * 2**20


class EngineClient(Protocol):
    """What the server needs of an engine; `AsyncLLM` is one."""

    config: EngineConfig

    @property
    def errored(self) -> bool: ...

    @property
    def dead_error(self) -> EngineDeadError: ...

    @property
    def engine_stats(self) -> dict[int, SchedulerStats]: ...

    async def check_health(self) -> None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def generation_defaults(self) -> dict[str, Any]: ...

    def get_tokenizer(self) -> Any: ...

    def generate(self, prompt: str | Mapping[str, Any], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0) -> AsyncGenerator[RequestOutput]: ...

    async def abort(self, request_id: str | Sequence[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_names: Sequence[str]
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 60.0  # a request's body must arrive within this (a 408 past it)
    allowed_hosts: Sequence[str] | None = None  # Host headers served (None: any)
    tool_call_parser: str | None = "hermes"  # parses tool calls for tool_choice "auto"; None: no parsing
    trust_request_chat_template: bool = False  # may a request bring its own `chat_template`?
    reasoning_parser: str | None = None  # splits <think> reasoning off the output (troupe.tools.reasoning)
    chat_template: str | None = None  # the server-wide chat template (--chat-template), over the model's
    responses_store_size: int = 256  # stored Responses API answers kept (oldest dropped first)
    # vLLM's CORS flags (Starlette's CORSMiddleware; the defaults are vLLM's) and /tokenizer_info
    allowed_origins: Sequence[str] = ("*",)
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False
    enable_tokenizer_info_endpoint: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(slots=True, eq=False)
class ServerState:
    settings: ServerSettings
    llm: EngineClient | None = None
    draining: bool = False  # set at shutdown: new generation requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    openapi: bytes | None = None  # the encoded /openapi.json, built on first use
    metrics: ServerMetrics = field(init=False)
    watchdog: LoopWatchdog = field(init=False)
    _in_flight: collections.Counter[str] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.settings.model_name,
                                     lambda: self.llm.engine_stats if self.llm is not None else {})
        self.watchdog = LoopWatchdog(self.metrics.registry)

    def engine(self) -> EngineClient:
        """The engine, or a 503 when it is dead, not started, or the server is shutting down."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.llm is None:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="not_ready")
        if self.llm.errored:
            raise self.llm.dead_error
        return self.llm

    def generating_engine(self) -> EngineClient:
        """`engine()`, for the generation endpoints: a pooling engine (`--runner pooling`) is a 400 naming
        the runner."""
        llm = self.engine()
        if getattr(llm.config, "runner", "generate") == "pooling":
            raise APIError(400, "this server was started with --runner pooling: it serves /v1/embeddings, /pooling, "
                                "/score and /rerank, not generation; start it without --runner pooling (the "
                                "generate runner) to generate", param="runner")
        return llm

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (None: the first one), or 404."""
        if name is None:
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{list(self.settings.served_model_names)}.",
                           param="model", code="model_not_found")
        return name

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    @contextmanager
    def _registered(self, request_id: str) -> Iterator[None]:
        self._in_flight[request_id] += 1
        try:
            yield
        finally:
            self._in_flight[request_id] -= 1
            if not self._in_flight[request_id]:
                del self._in_flight[request_id]

    async def follow(self, request_id: str, kind: RequestOutputKind, arrival: float,
                     outputs: AsyncGenerator[RequestOutput], *,
                     params: SamplingParams | None = None) -> AsyncGenerator[RequestOutput]:
        """`outputs` of one request, tracked; closing this generator closes (aborts) the request.
        A request that failed on its own (finish_reason "error") raises `EngineGenerateError` with
        its error text instead of yielding its final output: the client gets an error, not a
        truncated answer. When the failure was the request's own fault (`RequestOutput.error_kind`
        "invalid_request", e.g. allowed_token_ids, bad_words, min_tokens and the grammar leaving no token
        to sample), it raises `InvalidInputError` instead: a 400 naming them, not a 500. `params`
        (the request's) feed the `vllm:request_params_*` histograms."""
        async with aclosing(outputs):
            with self._registered(request_id), self.metrics.track(kind, arrival, params) as record:
                async for out in outputs:
                    record.observe(out)
                    if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                        if out.error_kind == "invalid_request":  # its parameters conflict
                            raise InvalidInputError("sampling parameters", f"request {out.request_id}: {out.error}")
                        raise EngineGenerateError(f"request {out.request_id} failed: {out.error}")
                    yield out

    async def abort_all(self) -> int:
        """Abort every request in flight (each stream ends with finish_reason "abort")."""
        ids = list(self._in_flight)
        if ids and self.llm is not None and not self.llm.errored:
            await self.llm.abort(ids)
        return len(ids)
