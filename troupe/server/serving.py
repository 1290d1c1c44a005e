"""`POST /v1/completions` and `POST /v1/chat/completions`.

1. Read the body (capped, JSON only) and decode it strictly into the request Struct.
2. Check the model name (404), unsupported fields (400) and build `SamplingParams` (400 naming the
   field): DELTA outputs when streaming, FINAL_ONLY otherwise.
3. One engine request per prompt (`llm.generate`, or `llm.chat` through the chat template), each
   followed by `ServerState.follow` (in-flight set, metrics) under the request id: the
   `X-Request-Id` header or a fresh one, `-<i>` appended for each prompt of a batch.
4. Streaming: an `EventStream` of OpenAI chunks (then a usage chunk with
   `stream_options.include_usage`, then `[DONE]`). Otherwise: every request gathered in a task
   group, raced against the client's disconnect, and one JSON body.
A client that goes away cancels the work, which closes each generator and so aborts its request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from troupe.errors import single_error
from troupe.outputs import RequestOutput
from troupe.server.errors import APIError
from troupe.server.protocol import ChatCompletionRequest, CompletionRequest, reject_unsupported
from troupe.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FinishReasonText,
    Usage,
    usage,
)
from troupe.server.sse import EventStream, cancel_on_disconnect, sse_event
from troupe.server.state import ServerState

T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.troupe
    return state


def request_id(request: Request) -> str:
    rid: str = request.scope["state"]["request_id"]
    return rid


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


async def read_body(request: Request, kind: type[T], limit: int) -> T:
    """The JSON body decoded as `kind`: 415 if not JSON, 413 past `limit` bytes, 400 if invalid."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the body must be application/json, got {media!r}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {declared} bytes; at most {limit} are accepted", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the body is over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    result: T = decoder.decode(b"".join(chunks))
    return result


async def gather_finals(request: Request, sources: Sequence[AsyncGenerator[RequestOutput]]) -> list[RequestOutput] | None:
    """The final output of each source, or None if the client went away first."""
    finals: list[RequestOutput | None] = [None] * len(sources)

    async def run(index: int, source: AsyncGenerator[RequestOutput]) -> None:
        async with aclosing(source):
            async for out in source:
                finals[index] = out

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope)
            async with anyio.create_task_group() as work:
                for i, source in enumerate(sources):
                    work.start_soon(run, i, source)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise single_error(group) from None
    if any(f is None or not f.finished for f in finals):
        return None
    return [f for f in finals if f is not None]


# ---------------------------------------------------------------------- completions


class CompletionStream:
    """SSE chunks of `text_completion` objects (`CompletionChunk`)."""

    def __init__(self, response_id: str, model: str, created: int, n: int, include_usage: bool) -> None:
        self._id, self._created, self._model = response_id, created, model
        self._include_usage = include_usage
        self._prompt_tokens = [0] * n
        self._completion_tokens = [0] * n

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        c = out.outputs[0]
        self._prompt_tokens[index] = len(out.prompt_token_ids or ())
        self._completion_tokens[index] += len(c.token_ids)
        if not c.text and c.finish_reason is None:
            return []
        choice = CompletionChoice(index=index, text=c.text, finish_reason=_finish(c.finish_reason),
                                  stop_reason=c.stop_reason)
        return [sse_event(self._chunk([choice]))]

    def _chunk(self, choices: list[CompletionChoice], final_usage: Usage | None = None) -> CompletionChunk:
        return CompletionChunk(id=self._id, created=self._created, model=self._model, choices=choices,
                               usage=final_usage if self._include_usage else msgspec.UNSET)

    def tail(self) -> list[bytes]:
        events = []
        if self._include_usage:
            events.append(sse_event(self._chunk([], usage(sum(self._prompt_tokens), sum(self._completion_tokens)))))
        events.append(b"data: [DONE]\n\n")
        return events


def _finish(reason: str | None) -> FinishReasonText | None:
    assert reason in (None, "stop", "length", "abort", "error"), reason
    return reason  # type: ignore[return-value]


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    req = await read_body(request, CompletionRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    reject_unsupported(req)
    params = req.sampling_params()
    prompts = req.prompts()
    llm = state.engine()
    base = request_id(request)
    ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
    sources = [state.follow(rid, params.output_kind, arrival,
                            llm.generate(p, params.clone(), rid, priority=req.priority))
               for p, rid in zip(prompts, ids, strict=True)]
    response_id, created = f"cmpl-{base}", int(time.time())
    if req.stream:
        return EventStream(sources, CompletionStream(response_id, model, created, len(sources), req.include_usage))
    finals = await gather_finals(request, sources)
    if finals is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    choices = [CompletionChoice(index=i, text=f.outputs[0].text, finish_reason=_finish(f.outputs[0].finish_reason),
                                stop_reason=f.outputs[0].stop_reason)
               for i, f in enumerate(finals)]
    return json_response(CompletionResponse(id=response_id, created=created, model=model, choices=choices,
                                            usage=_usage_of(finals)))


def _usage_of(finals: Sequence[RequestOutput]) -> Usage:
    return usage(sum(len(f.prompt_token_ids or ()) for f in finals),
                 sum(len(f.outputs[0].token_ids) for f in finals))


# ---------------------------------------------------------------------- chat


class ChatStream:
    """SSE chunks of `chat.completion.chunk` objects: the role first, then content deltas."""

    def __init__(self, response_id: str, model: str, created: int, include_usage: bool) -> None:
        self._id, self._created, self._model = response_id, created, model
        self._include_usage = include_usage
        self._prompt_tokens = self._completion_tokens = 0
        self._sent_role = False

    def _event(self, delta: ChatDelta, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> bytes:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=_finish(finish_reason), stop_reason=stop_reason)
        return sse_event(ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice],
                                             usage=None if self._include_usage else msgspec.UNSET))

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        c = out.outputs[0]
        self._prompt_tokens = len(out.prompt_token_ids or ())
        self._completion_tokens += len(c.token_ids)
        events = []
        if not self._sent_role:
            events.append(self._event(ChatDelta(role="assistant", content="")))
            self._sent_role = True
        if c.text or c.finish_reason is not None:
            events.append(self._event(ChatDelta(content=c.text or None), c.finish_reason, c.stop_reason))
        return events

    def tail(self) -> list[bytes]:
        events = []
        if self._include_usage:
            chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[],
                                        usage=usage(self._prompt_tokens, self._completion_tokens))
            events.append(sse_event(chunk))
        events.append(b"data: [DONE]\n\n")
        return events


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    req = await read_body(request, ChatCompletionRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    reject_unsupported(req)
    params = req.sampling_params()
    messages = req.conversation()
    llm = state.engine()
    base = request_id(request)
    source = state.follow(base, params.output_kind, arrival,
                          llm.chat(messages, params, base, add_generation_prompt=req.add_generation_prompt,
                                   priority=req.priority))
    response_id, created = f"chatcmpl-{base}", int(time.time())
    if req.stream:
        return EventStream([source], ChatStream(response_id, model, created, req.include_usage))
    finals = await gather_finals(request, [source])
    if finals is None:
        return Response(status_code=499)
    c = finals[0].outputs[0]
    choice = ChatChoice(index=0, message=ChatMessageOut(content=c.text), finish_reason=_finish(c.finish_reason),
                        stop_reason=c.stop_reason)
    return json_response(ChatCompletionResponse(id=response_id, created=created, model=model, choices=[choice],
                                                usage=_usage_of(finals)))
