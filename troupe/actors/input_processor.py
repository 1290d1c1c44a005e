"""The input processor actor: prompts -> validated `AddRequest`s for the engine side.

Inbox:    `Submission`s from the facades (prompt or chat messages, params, ids, a `Reply`), and
          the facades' `AbortRequest`s and `UtilityCall`s, passed through in order (an abort
          never overtakes the add it cancels); from the output handler, `ReleaseChildren` (n > 1:
          the children held back for a shared prefill may go now).
Outbox:   `AddRequest`s towards the engine(s) (balancer or engine core); an n > 1 request as its n
          children (troupe.output.parallel).
Owns:     the tokenizer; one task per long prompt (tokenized in a worker thread).
Calls:    the request table through `Registrar` (register a request, take held children): nothing else.
Shutdown: EndOfStream on the inbox, or cancellation.

Each submission is answered through its `Reply` with the request's `RequestStream` (already
registered in the `RequestTable`, so no output can overtake it) or with the validation error
(`InvalidInputError`; anything else that fails on one prompt is that request's
`EngineGenerateError`, and the other submissions go on).
Short prompts are handled inline, in order; a prompt longer than `offload_chars` is tokenized in a
worker thread in its own task, and so is all of a submission whose checks cost more (`_costly`: a
structured-output spec, bad words, a request's own chat template), so one huge prompt or schema does
not hold up the event loop or other submissions.

Logs (`actor=input_processor`): "request submitted" (debug) and "request rejected" (info), each
with the request's `request_id`, passed on the line (binding it in the context per request costs
more on this hot path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.actors.reply import Reply
from troupe.actors.requests import RequestStream
from troupe.errors import EngineGenerateError
from troupe.inputs import (
    ChatMessages,
    ModelLimits,
    PromptType,
    build_request,
    render_chat,
    split_prompt,
    tokenize,
)
from troupe.messages import AbortRequest, AddRequest, EngineInput, UtilityCall
from troupe.sampling_params import SamplingParams, check_utf8

log = structlog.get_logger("troupe.input")


def _costly(sub: Submission) -> bool:
    """Whether checking the submission costs more than the event loop should spend on it: a
    structured-output spec (xgrammar parses it), bad words (tokenized), a request's own chat template."""
    params = sub.params
    return sub.chat_template is not None or (isinstance(params, SamplingParams) and (
        params.structured_outputs is not None or bool(params.bad_words)))


class Registrar(Protocol):
    """What the input processor may do with the request table (troupe.actors.requests.RequestTable)."""

    def register(self, req: AddRequest, prompt_text: str | None, *,
                 share_prefill_tokens: int | None = None) -> tuple[RequestStream, list[AddRequest]]: ...

    def take_held(self, parent_id: str) -> list[AddRequest]: ...


@dataclass(slots=True, frozen=True)
class Submission:
    """One request from a facade; `reply` gets its registered stream, or its validation error. A
    caller that goes away before the answer abandons the reply, and a graph that stops answers it
    with an error: either way the request is then not sent."""

    external_id: str
    params: SamplingParams
    prompt: PromptType | None = None
    messages: ChatMessages | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    data_parallel_rank: int | None = None
    reply: Reply[RequestStream] = field(default_factory=Reply)


@dataclass(slots=True, frozen=True)
class ReleaseChildren:
    """From the output handler: child 0 of n > 1 request `parent_id` has computed the shared prompt;
    send the children held back for it (those still live). Through this inbox, so that an abort of
    the parent, which also comes here, is always ordered with them."""

    parent_id: str


FrontendInput = Submission | AbortRequest | UtilityCall | ReleaseChildren


class InputProcessorStats(NamedTuple):
    submitted: int
    offloaded: int
    rejected: int


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: ModelLimits, table: Registrar,
                 inbox: MemoryObjectReceiveStream[FrontendInput], outbox: MemoryObjectSendStream[EngineInput],
                 *, offload_chars: int = 4096, share_prefill_tokens: int | None = None) -> None:
        """`share_prefill_tokens`: the engine's KV block size when it caches prefixes (None: it does
        not): an n > 1 prompt at least this long is computed once and shared (RequestTable.register)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self._table = table
        self._inbox = inbox
        self._outbox = outbox
        self.offload_chars = offload_chars
        self.share_prefill_tokens = share_prefill_tokens
        self._submitted = self._offloaded = self._rejected = 0

    def statistics(self) -> InputProcessorStats:
        return InputProcessorStats(self._submitted, self._offloaded, self._rejected)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        structlog.contextvars.bind_contextvars(actor="input_processor")
        task_status.started()
        async with self._inbox, self._outbox, anyio.create_task_group() as tg:
            async for msg in self._inbox:
                if isinstance(msg, AbortRequest | UtilityCall):
                    await self._outbox.send(msg)
                elif isinstance(msg, ReleaseChildren):
                    for child in self._table.take_held(msg.parent_id):
                        await self._outbox.send(child)
                else:
                    await self._handle(msg, tg)

    async def _handle(self, sub: Submission, tg: TaskGroup) -> None:
        if _costly(sub):
            self._offloaded += 1
            tg.start_soon(self._prepare_then_register, sub)
            return
        try:
            text, ids = self._prompt_parts(sub)
            if ids is None and text is not None and len(text) > self.offload_chars:
                self._offloaded += 1
                tg.start_soon(self._tokenize_then_send, sub, text)
                return
            if ids is None:
                assert text is not None
                ids = tokenize(self.tokenizer, text, sub.messages is None)
        except Exception as exc:
            self._reject(sub, exc)
            return
        await self._send(sub, text, ids)

    def _prompt_parts(self, sub: Submission) -> tuple[str | None, list[int] | None]:
        if sub.messages is not None:
            text = render_chat(self.tokenizer, sub.messages, sub.add_generation_prompt, sub.chat_template,
                               limits=self.limits.inputs)
            if not text.isascii():
                check_utf8("messages", text)
            return text, None
        assert sub.prompt is not None
        prompt_text, ids = split_prompt(sub.prompt)
        if prompt_text is not None and not prompt_text.isascii():
            check_utf8("prompt", prompt_text)
        return prompt_text, ids

    async def _tokenize_then_send(self, sub: Submission, text: str) -> None:
        try:
            ids = await anyio.to_thread.run_sync(tokenize, self.tokenizer, text, sub.messages is None)
        except Exception as exc:
            self._reject(sub, exc)
            return
        await self._send(sub, text, ids)

    def _build(self, sub: Submission, ids: list[int]) -> AddRequest:
        return build_request(prompt_token_ids=ids, params=sub.params, limits=self.limits,
                             external_id=sub.external_id, priority=sub.priority,
                             data_parallel_rank=sub.data_parallel_rank, tokenizer=self.tokenizer)

    def _prepare(self, sub: Submission) -> tuple[str | None, list[int], AddRequest]:
        text, ids = self._prompt_parts(sub)
        if ids is None:
            assert text is not None
            ids = tokenize(self.tokenizer, text, sub.messages is None)
        return text, ids, self._build(sub, ids)

    async def _prepare_then_register(self, sub: Submission) -> None:
        """A costly submission (see `_costly`): prompt, tokens and checks in a worker thread."""
        try:
            text, ids, req = await anyio.to_thread.run_sync(self._prepare, sub)
        except Exception as exc:
            self._reject(sub, exc)
            return
        await self._register(sub, text, ids, req)

    async def _send(self, sub: Submission, text: str | None, ids: list[int]) -> None:
        try:
            req = self._build(sub, ids)
        except Exception as exc:
            self._reject(sub, exc)
            return
        await self._register(sub, text, ids, req)

    async def _register(self, sub: Submission, text: str | None, ids: list[int], req: AddRequest) -> None:
        if not sub.reply.pending:  # the caller went away, or the graph stopped and answered it
            return
        try:
            stream, to_send = self._table.register(req, text, share_prefill_tokens=self.share_prefill_tokens)
        except Exception as exc:
            self._reject(sub, exc)
            return
        self._submitted += 1
        sub.reply.send(stream)  # pending: checked above, with no await between
        log.debug("request submitted", request_id=sub.external_id, internal_id=req.request_id, prompt_tokens=len(ids),
                  n=req.params.n)
        for engine_req in to_send:  # the request, or (n > 1) the children to send now
            await self._outbox.send(engine_req)

    def _reject(self, sub: Submission, exc: BaseException) -> None:
        """Answer one submission with its error: a `ValueError` (`InvalidInputError`) as itself,
        anything else (a tokenizer or template failing on this prompt) as `EngineGenerateError`."""
        self._rejected += 1
        if isinstance(exc, ValueError):
            log.info("request rejected", request_id=sub.external_id, error=str(exc))
            sub.reply.fail(exc)
        else:
            log.error("request failed in the input processor", request_id=sub.external_id, exc_info=exc)
            error = EngineGenerateError(f"the prompt could not be processed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            sub.reply.fail(error)
