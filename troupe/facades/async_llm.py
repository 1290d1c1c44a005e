"""`AsyncLLM`: the streaming engine, `async with AsyncLLM(model=...) as llm:`.

1. Entering starts the actor graph (engine side first: by default the EngineCore in its own process)
   and returns once it is ready; a failed start raises `EngineStartupError` with the root cause.
2. `generate()` submits the prompt to the input processor through the graph's port
   (troupe.actors.port: the only way this class reaches the graph), gets the request's stream back
   (or the validation error) and yields `RequestOutput`s until one has `finished=True`.
3. A consumer that stops early (break, cancellation, exception) aborts its request in the engine
   from a shielded `finally`.
4. `add_request()` + `follow(stream)` are `generate()` in two steps (what `LLM` uses). `abort(ids)`
   ends the streams of those requests with a final `finish_reason="abort"` output.
5. Leaving the context aborts what is left and stops every actor and the engine process;
   `await llm.shutdown()` (vLLM's) does the same at once, inside the block or after it. An
   exception that leaves the context comes out as itself, never wrapped in an ExceptionGroup:
   the body's own exception first, else the graph's (`errors.single_error`).
6. `check_health()` raises `EngineDeadError` (dead) or `EngineHungError` (no step finished for
   `engine_hang_timeout_s` while requests wait). After a death every call (generate, chat,
   add_request, abort, utility calls, get_tokenizer) raises that `EngineDeadError`.
7. A request that fails on its own (its sampling, stop checks, detokenization) raises nothing: its
   final output has finish_reason "error" and `error` says why; the engine goes on.

Made as vLLM's is: `AsyncLLM(model, **options)` (troupe's `EngineConfig` fields and vLLM's arguments,
see troupe.engine_args), `AsyncLLM.from_engine_args(EngineArgs(...))` or
`AsyncLLM.from_vllm_config(engine_config)`; each is started by `async with`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio

from troupe.actors.graph import Graph
from troupe.actors.input_processor import Submission
from troupe.actors.port import FrontendPort
from troupe.actors.requests import RequestStream
from troupe.config import EngineConfig
from troupe.engine.build import MakeCore
from troupe.engine_args import EngineArgs, engine_config
from troupe.errors import EngineDeadError, EngineHungError, InvalidInputError, single_error
from troupe.inputs import ChatMessages, PromptType, next_request_id
from troupe.log import configure_logging
from troupe.messages import SchedulerStats
from troupe.models.generation_config import read_generation_defaults
from troupe.models.loader import resolve_model_path
from troupe.outputs import RequestOutput
from troupe.sampling_params import SamplingParams, check_utf8


class AsyncLLM(anyio.AsyncContextManagerMixin):
    def __init__(self, model: str | None = None, *, make_core: MakeCore | None = None,
                 **engine_options: Any) -> None:
        """`engine_options` are `EngineConfig` fields. `make_core(config) -> EngineCore` replaces the
        EngineCore factory (tests); with `multiprocess=True` it must be a module-level function."""
        if model is not None:
            engine_options["model"] = model
        self._setup(engine_config(engine_options), make_core)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """vLLM's constructor from `EngineArgs`; start it with `async with`."""
        return cls.from_vllm_config(engine_args.create_engine_config())

    @classmethod
    def from_vllm_config(cls, config: EngineConfig) -> AsyncLLM:
        """vLLM's constructor from the whole engine configuration: troupe's is an `EngineConfig`
        (what `EngineArgs.create_engine_config()` returns); start it with `async with`."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"from_vllm_config takes a troupe.config.EngineConfig, got {type(config).__name__}")
        llm = cls.__new__(cls)
        llm._setup(config, None)
        return llm

    def _setup(self, config: EngineConfig, make_core: MakeCore | None) -> None:
        self.config = config
        configure_logging()
        self._make_core = make_core
        self._graph: Graph | None = None  # owned: entered and left here
        self._port: FrontendPort | None = None  # the same graph, as all the rest of this class may use it
        self._stopped = False
        self._generation_defaults: dict[str, Any] | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[AsyncLLM]:
        body_error: BaseException | None = None
        try:
            async with Graph(self.config, make_core=self._make_core) as graph:
                self._graph = self._port = graph
                try:
                    yield self
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    self._stopped = True
        except BaseExceptionGroup as group:
            leaf = single_error(group, prefer=body_error)
            raise leaf from leaf.__cause__

    # ------------------------------------------------------------------ state

    async def shutdown(self) -> None:
        """Stop now (vLLM's `shutdown()`): every unfinished request ends with finish_reason "abort", the
        actors and the engine processes stop, and later calls raise. Idempotent; after the `async with`
        block it has nothing left to do."""
        self._stopped = True
        if self._port is not None:
            await self._port.stop()

    def _running(self) -> FrontendPort:
        if self._port is None or self._stopped:
            raise RuntimeError("AsyncLLM is not running (not entered, or shut down); use it as "
                               "`async with AsyncLLM(...) as llm:`")
        if self._port.dead_error is not None:
            raise self._port.dead_error
        return self._port

    @property
    def errored(self) -> bool:
        return self._port is not None and self._port.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError:
        if self._port is not None and self._port.dead_error is not None:
            return self._port.dead_error
        return EngineDeadError()

    @property
    def is_running(self) -> bool:
        return self._port is not None and not self._stopped and not self.errored

    async def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine is dead, `EngineHungError` if it looks hung."""
        if self.errored:
            raise self.dead_error
        timeout = self.config.engine_hang_timeout_s
        if self._port is not None and timeout is not None:
            stalled, _ = self._port.stalled_for()
            if stalled > timeout:
                raise EngineHungError(stalled, self._port.num_unfinished, timeout)

    @property
    def engine_pids(self) -> list[int]:
        """Process ids of the engine processes (empty in-process)."""
        return self._port.pids if self._port is not None else []

    def get_tokenizer(self) -> Any:
        return self._running().tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length the engines serve (the model's, or `max_model_len` when set)."""
        limits = self._running().limits
        assert limits is not None
        return limits.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The sampling defaults of the model's `generation_config.json` (`SamplingParams` field ->
        value; see `troupe.models.generation_config`): what a request leaves unset gets these."""
        if self._generation_defaults is None:
            self._running()
            self._generation_defaults = read_generation_defaults(resolve_model_path(self.config.model, self.config.revision))
        return dict(self._generation_defaults)

    @property
    def engine_stats(self) -> dict[int, SchedulerStats]:
        """The latest scheduler stats each engine published with its outputs, by engine index."""
        return self._port.engine_stats if self._port is not None else {}

    @property
    def num_unfinished_requests(self) -> int:
        return self._port.num_unfinished if self._port is not None else 0

    # ------------------------------------------------------------------ requests

    async def add_request(self, prompt: PromptType | None, params: SamplingParams | None = None,
                          request_id: str | None = None, *, messages: ChatMessages | None = None,
                          priority: int = 0, data_parallel_rank: int | None = None,
                          chat_template: str | None = None, add_generation_prompt: bool = True) -> RequestStream:
        """Submit one request; returns its stream (read it with `follow`), or raises the validation error."""
        port = self._running()
        if request_id is not None:
            if not isinstance(request_id, str):
                raise InvalidInputError("request_id", f"must be a string, got {request_id!r}")
            check_utf8("request_id", request_id)
        return await port.submit(Submission(
            external_id=request_id if request_id is not None else next_request_id(),
            params=params if params is not None else SamplingParams(), prompt=prompt, messages=messages,
            chat_template=chat_template, add_generation_prompt=add_generation_prompt, priority=priority,
            data_parallel_rank=data_parallel_rank))

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncGenerator[RequestOutput]:
        """Stream the outputs of one request until it finishes."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority=priority,
                                        data_parallel_rank=data_parallel_rank)
        async with aclosing(self.follow(stream)) as outputs:  # closed with us: the abort runs at once
            async for out in outputs:
                yield out

    async def chat(self, messages: ChatMessages, sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, *, chat_template: str | None = None,
                   add_generation_prompt: bool = True, priority: int = 0) -> AsyncGenerator[RequestOutput]:
        """`generate` for a conversation rendered by the model's chat template."""
        stream = await self.add_request(None, sampling_params, request_id, messages=messages,
                                        chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                        priority=priority)
        async with aclosing(self.follow(stream)) as outputs:  # closed with us: the abort runs at once
            async for out in outputs:
                yield out

    async def follow(self, stream: RequestStream) -> AsyncGenerator[RequestOutput]:
        """The outputs of a request `add_request` submitted, until its final one. A consumer that
        stops early (break, cancellation, an exception; close the generator, e.g. with `aclosing`)
        aborts the request in the engine."""
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer went away: stop the work in the engine
                with anyio.CancelScope(shield=True):
                    await self.abort(stream.request_id, internal=True)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests by the user's id(s): each stream ends with finish_reason='abort'. Raises
        `EngineDeadError` once the engine is dead (every stream has ended with it). With `internal`
        (vLLM's), the ids are the streams' own (`RequestStream.request_id`) and nothing is raised."""
        port = self._port
        if port is None:
            return
        if not internal and port.dead_error is not None:
            raise port.dead_error
        await port.abort(request_id, internal=internal)

    # ------------------------------------------------------------------ utility calls

    async def _utility(self, method: str, *args: Any) -> Any:
        return await self._running().call_utility(method, *args)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._utility("reset_prefix_cache"))

    async def get_stats(self) -> dict[str, Any]:
        return dict(await self._utility("get_stats"))
