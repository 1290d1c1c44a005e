"""`LLM`: the offline batch API, a blocking portal onto the same actor graph as `AsyncLLM`.

1. `LLM(...)` starts a `BlockingPortal` (an event loop in a thread) and enters an `AsyncLLM`
   through it; there is no second engine loop.
2. `generate(prompts, params)` runs one coroutine in the portal that submits every prompt with
   `FINAL_ONLY` outputs and gathers the results in input order (a progress bar shows input and
   output tokens/s).
3. Ctrl-C during `generate` cancels that coroutine: its requests are aborted in the engine and
   `KeyboardInterrupt` reaches the caller at once. Python runs signal handlers in the main thread
   only, and a SIGINT the kernel hands to another thread (the portal's workers, torch's) does not
   wake a main thread blocked on a lock; so the caller waits for the result in slices of
   `SIGNAL_CHECK_S`, between which a pending Ctrl-C is raised.
4. `close()` (or `shutdown()`, vLLM's name, or leaving `with`) shuts the graph down and joins the portal thread; a
   `weakref.finalize` does the same for a user who forgets, so interpreter exit never hangs.
5. `encode` / `embed` / `score` (an engine started with `runner="pooling"`, troupe.pooling) run
   every prompt at once the same way and return vLLM's pooling outputs in input order
   (`troupe.facades.pooling`).
6. Errors are the documented ones, never an `ExceptionGroup`: a bad prompt in a batch raises its
   `InvalidInputError` (the requests already submitted are aborted); after an engine death every
   call raises `EngineDeadError`; a request that failed on its own comes back in its place with
   finish_reason "error" and `RequestOutput.error`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from troupe.actors.requests import RequestStream
from troupe.engine_args import EngineArgs
from troupe.errors import InvalidInputError, single_error
from troupe.facades.async_llm import AsyncLLM
from troupe.facades.pooling import PoolingMethods
from troupe.inputs import ChatMessages, PromptType, per_prompt
from troupe.outputs import RequestOutput
from troupe.sampling_params import RequestOutputKind, SamplingParams

SIGNAL_CHECK_S = 0.1  # the longest a Ctrl-C delivered to another thread waits to be raised


def _shutdown(portal: BlockingPortal, stack: contextlib.ExitStack) -> None:
    try:
        stack.close()
    except RuntimeError:  # the portal's loop is already gone (interpreter exit)
        with contextlib.suppress(RuntimeError):
            portal.call(portal.stop, True)


class LLM(PoolingMethods):
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """vLLM's constructor from `EngineArgs`: `LLM(**engine_args.options())`."""
        return cls(**engine_args.options())

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(start_blocking_portal("asyncio"))
        try:
            self._engine = AsyncLLM(model, **engine_options)
            self._stack.enter_context(self._portal.wrap_async_context_manager(self._engine))
        except BaseException as exc:
            try:
                self._stack.close()
            except BaseExceptionGroup as group:
                leaf = single_error(group, prefer=exc)
                raise leaf from leaf.__cause__
            if isinstance(exc, BaseExceptionGroup):
                leaf = single_error(exc)
                raise leaf from leaf.__cause__
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._portal, self._stack)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the engine and the portal thread. Idempotent."""
        try:
            self._finalizer()
        except BaseExceptionGroup as group:  # the portal's own task group: never a group for the user
            leaf = single_error(group)
            raise leaf from leaf.__cause__

    def shutdown(self) -> None:
        """vLLM's name for `close()`."""
        self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> Any:
        return self._engine.config

    def get_tokenizer(self) -> Any:
        return self._engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's `generation_config.json` defaults (vLLM's): what
        `generate` / `chat` use when given no SamplingParams."""
        return SamplingParams(**self._engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        return self._call(self._engine.reset_prefix_cache)

    def get_stats(self) -> dict[str, Any]:
        return self._call(self._engine.get_stats)

    def _call(self, fn: Any, *args: Any) -> Any:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed")
        future = self._portal.start_task_soon(fn, *args)
        try:
            while True:
                try:
                    return future.result(timeout=SIGNAL_CHECK_S)
                except concurrent.futures.TimeoutError:
                    continue  # not done: back to waiting, after any pending signal handler ran
        except KeyboardInterrupt:
            future.cancel()  # the coroutine aborts its requests from its own cleanup
            raise

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in input order. `priority`: one for every
        prompt, or one per prompt (anything but 0 needs `scheduling_policy="priority"`)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        jobs = [{"prompt": p} for p in prompts]
        return self._call(self._run_batch, jobs, sampling_params, use_tqdm, priority)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate a reply for one conversation or a list of them, through the chat template."""
        conversations: list[ChatMessages]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        jobs = [{"messages": c, "chat_template": chat_template, "add_generation_prompt": add_generation_prompt}
                for c in conversations]
        return self._call(self._run_batch, jobs, sampling_params, use_tqdm, None)

    async def _run_batch(self, jobs: list[dict[str, Any]],
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                         use_tqdm: bool, priority: int | Sequence[int] | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams(**self._engine.generation_defaults)
        params_list = per_prompt(sampling_params, len(jobs), SamplingParams, "sampling_params", SamplingParams)
        priorities: list[Any]
        if priority is None or isinstance(priority, int | str):  # a str is checked (refused) as one value
            priorities = [0 if priority is None else priority] * len(jobs)
        else:
            priorities = list(priority)
        if len(priorities) != len(jobs):
            raise InvalidInputError("priority", f"{len(priorities)} values for {len(jobs)} prompts; pass one, "
                                    "or one per prompt")
        results: list[RequestOutput | None] = [None] * len(jobs)
        streams: list[RequestStream] = []
        bar = _ProgressBar(len(jobs)) if use_tqdm else None
        try:
            try:  # every request is submitted (and validated) before any is followed
                for i, (job, params) in enumerate(zip(jobs, params_list, strict=True)):
                    params = params.clone()
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                    if "messages" in job:
                        stream = await self._engine.add_request(None, params, messages=job["messages"],
                                                                chat_template=job["chat_template"],
                                                                add_generation_prompt=job["add_generation_prompt"])
                    else:
                        stream = await self._engine.add_request(job["prompt"], params, priority=priorities[i])
                    streams.append(stream)
            except BaseException:  # one bad prompt: the batch is refused, nothing runs on
                with anyio.CancelScope(shield=True):
                    await self._engine.abort([st.request_id for st in streams], internal=True)
                raise
            try:
                async with anyio.create_task_group() as tg:
                    for i, stream in enumerate(streams):
                        tg.start_soon(self._collect, stream, i, results, bar)
            except BaseExceptionGroup as group:
                leaf = single_error(group)
                raise leaf from leaf.__cause__
        finally:
            if bar is not None:
                bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    async def _collect(self, stream: Any, index: int, results: list[RequestOutput | None],
                       bar: _ProgressBar | None) -> None:
        async for out in self._engine.follow(stream):
            if out.finished:
                results[index] = out
                if bar is not None:
                    bar.update(out)



class _ProgressBar:
    """tqdm with input and output tokens/s, updated as requests finish."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self._start = time.perf_counter()
        self._in = self._out = 0

    def update(self, out: RequestOutput) -> None:
        self._in += len(out.prompt_token_ids or ())
        self._out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-6)
        self._bar.set_postfix_str(f"in: {self._in / elapsed:.0f} tok/s, out: {self._out / elapsed:.0f} tok/s",
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
