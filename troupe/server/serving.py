"""`POST /v1/completions` and `POST /v1/chat/completions`.

1. Read the body (capped, JSON only) and decode it strictly into the request Struct; keys it does
   not declare are ignored with one warning naming them (`fields.unknown_fields`).
2. Check the model name (404), fields troupe cannot honour (400), and build `SamplingParams` (400
   naming the field) over the model's generation-config defaults: DELTA outputs when streaming,
   FINAL_ONLY otherwise.
3. Prompts: completions' as given (tokenized here only for `add_special_tokens=false`); chat's
   rendered here through the chat template with the request's tools and template variables, then
   tokenized (both in a worker thread when long). One engine request per prompt (`llm.generate`,
   n choices each), followed by `ServerState.follow` (in-flight set, metrics) under the request id:
   the `X-Request-Id` header, else the body's `request_id`, else a fresh one; `-<i>` is appended for
   each prompt of a batch.
4. Streaming: an `EventStream` of OpenAI chunks (a usage chunk with `stream_options.include_usage`,
   then `[DONE]`). Otherwise: every request gathered in a task group, raced against the client's
   disconnect, and one JSON body (`completions.CompletionFormat`, `chat_format.ChatFormat`).
A client that goes away cancels the work, which closes each generator and so aborts its request.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from troupe.errors import single_error
from troupe.inputs import render_chat
from troupe.limits import check_params, check_prompts
from troupe.outputs import RequestOutput
from troupe.server.chat import ChatCompletionRequest
from troupe.server.chat_format import ChatFormat
from troupe.server.completions import CompletionFormat
from troupe.server.errors import APIError, bad_request
from troupe.server.fields import reject_unsupported, unknown_fields, warn_ignored
from troupe.server.protocol import CompletionRequest
from troupe.server.sse import EventStream, cancel_on_disconnect
from troupe.server.state import ServerState
from troupe.tools.parsers import ToolParser, tool_parser
from troupe.tools.reasoning import ReasoningParser, reasoning_parser

T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_INT_GOT_FLOAT = re.compile(r"Expected `[^`]*\bint\b[^`]*`, got `float`")
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII, no spaces
OFFLOAD_CHARS = 4096  # render / tokenize longer texts in a worker thread
OFFLOAD_BODY_BYTES = 65_536  # decode larger bodies in a worker thread


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.troupe
    return state


def request_id(request: Request, body_id: str | None = None) -> str:
    """The header's id; else the body's `request_id` (validated), which the response header echoes."""
    scope_state = request.scope["state"]
    if body_id is not None and not scope_state.get("request_id_from_header"):
        if not REQUEST_ID.fullmatch(body_id):
            raise bad_request("request_id", "must be 1 to 128 visible ASCII characters")
        scope_state["request_id"] = body_id
    rid: str = scope_state["request_id"]
    return rid


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


async def read_body(request: Request, kind: type[T], limit: int) -> T:
    """The JSON body decoded as `kind`: 415 if not JSON, 413 past `limit` bytes, 400 if invalid.
    Undeclared keys are ignored, with a warning naming them."""
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the body must be application/json, got {media!r}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {declared} bytes; at most {limit} are accepted", code="request_too_large")
    chunks, size = [], 0
    timeout = server_state(request).settings.body_timeout_s
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the body is over {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {timeout:g} s (troupe serve --body-timeout)",
                       code="request_timeout") from None
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    body = b"".join(chunks)

    def decode() -> tuple[T, list[str]]:
        try:
            try:
                result: T = decoder.decode(body)
            except msgspec.ValidationError as exc:
                if not _INT_GOT_FLOAT.search(str(exc)):
                    raise
                result = decoder.decode(integral_floats_as_ints(body))  # 5.0 for an int, as vLLM's pydantic
        except RecursionError:
            raise bad_request(None, "the request body nests objects or arrays too deeply") from None
        return result, unknown_fields(body, kind)

    # a large body decodes in a worker thread (tens of ms per MB, twice): the loop serves others meanwhile
    result, ignored = await anyio.to_thread.run_sync(decode) if len(body) > OFFLOAD_BODY_BYTES else decode()
    if ignored:
        warn_ignored(ignored, request.scope["state"]["request_id"])
    return result


def integral_floats_as_ints(body: bytes) -> bytes:
    """The JSON `body` with every integral float (5.0) written as an integer (5): vLLM's pydantic
    models take 5.0 for an integer field, msgspec does not; 5.5 stays a float (and a 400 for an
    integer field). Used only when the body failed to decode on such a float."""

    def walk(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:  # beyond: no int64 anyway
            return int(value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return msgspec.json.encode(walk(msgspec.json.decode(body)))


async def offload(size: int, fn: Callable[[], T]) -> T:
    return await anyio.to_thread.run_sync(fn) if size > OFFLOAD_CHARS else fn()


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


def _encoder(tok: Any, text: str, special: bool = False) -> Callable[[], list[int]]:
    return lambda: list(tok(text, add_special_tokens=special)["input_ids"])


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    req = await read_body(request, CompletionRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    reject_unsupported(req)
    llm = state.generating_engine()
    check_params(req, llm.config.input_limits)  # before any field is converted
    check_prompts(req.prompt, llm.config.input_limits)
    params = req.sampling_params(llm.generation_defaults, llm.config.input_limits)
    prompts = req.prompts()
    tok = llm.get_tokenizer()
    truncated = req.truncate_prompt_tokens is not None  # echo then shows the tokens served, decoded
    texts = [p if isinstance(p, str) and not truncated else None for p in prompts]
    if not req.add_special_tokens:  # the engine would add them: tokenize here
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                prompts[i] = {"prompt_token_ids": await offload(len(p), _encoder(tok, p))}
    base = request_id(request, req.request_id)
    ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
    sources = [state.follow(rid, params.output_kind, arrival,
                            llm.generate(p, params.clone(), rid, priority=req.priority), params=params)
               for p, rid in zip(prompts, ids, strict=True)]
    fmt = CompletionFormat(req, texts, tok, f"cmpl-{base}", model, int(time.time()))
    if req.stream:
        return EventStream(sources, fmt)
    finals = await gather_finals(request, sources)
    if finals is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    return json_response(fmt.response(finals))


@dataclass(slots=True)
class ChatRun:
    """A chat request submitted to the engine: its output source and the pieces its formatter takes."""

    req: ChatCompletionRequest
    source: AsyncGenerator[RequestOutput]
    tokenizer: Any
    model: str
    request_id: str
    tool_parser: ToolParser | None
    reasoning: ReasoningParser | None  # None where the output is constrained (structured outputs)

    def formatter(self, response_id: str) -> ChatFormat:
        return ChatFormat(self.req, self.tokenizer, self.tool_parser, response_id, self.model, int(time.time()),
                          self.reasoning)


async def start_chat(request: Request, req: ChatCompletionRequest, arrival: float) -> ChatRun:
    """Check `req`, render and tokenize its conversation, and submit it (steps 2-3 of the module
    docstring). Shared by chat completions and the Responses API (`responses_api.py`)."""
    state = server_state(request)
    settings = state.settings
    model = state.check_model(req.model)
    reject_unsupported(req)
    if req.chat_template is not None and not settings.trust_request_chat_template:
        raise bad_request("chat_template", "a request's own chat_template needs `troupe serve "
                                           "--trust-request-chat-template`")
    llm = state.generating_engine()
    check_params(req, llm.config.input_limits)  # before any field is converted
    params = req.sampling_params(llm.generation_defaults, llm.config.input_limits)
    tools = tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
    if tools is not None and tools.keeps_special_tokens and req.tool_mode == "auto":
        params.skip_special_tokens = False  # the format's marker is a special token (as vLLM)
    reasoning = reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    messages, template_kwargs = req.template_inputs()
    if req.chat_template is None and settings.chat_template is not None:
        template_kwargs["chat_template"] = settings.chat_template
    tok = llm.get_tokenizer()
    size = sum(len(str(m.get("content", ""))) for m in messages)
    if req.chat_template is not None:  # the client's own template: its cost is its own, never on the loop
        size = OFFLOAD_CHARS + 1
    limits = llm.config.input_limits

    def prompt_ids() -> list[int]:
        return _encoder(tok, render_chat(tok, messages, limits=limits, **template_kwargs), req.add_special_tokens)()

    prompt = {"prompt_token_ids": await offload(size, prompt_ids)}
    base = request_id(request, req.request_id)
    source = state.follow(base, params.output_kind, arrival, llm.generate(prompt, params, base, priority=req.priority),
                          params=params)
    return ChatRun(req, source, tok, model, base, tools,
                   reasoning if params.structured_outputs is None else None)


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    req = await read_body(request, ChatCompletionRequest, state.settings.max_body_bytes)
    run = await start_chat(request, req, arrival)
    fmt = run.formatter(f"chatcmpl-{run.request_id}")
    if req.stream:
        return EventStream([run.source], fmt)
    finals = await gather_finals(request, [run.source])
    if finals is None:
        return Response(status_code=499)
    return json_response(fmt.response(finals[0]))
