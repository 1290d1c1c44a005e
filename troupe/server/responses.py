"""OpenAI response bodies as msgspec Structs: what the server encodes, and what `/openapi.json`
documents (`troupe.server.openapi` builds the schema from these and the request Structs).

Non-streaming answers are one `CompletionResponse` / `ChatCompletionResponse`; streams are SSE
`data:` events of `CompletionChunk` / `ChatCompletionChunk` (with `usage` present, as null, only
when `stream_options.include_usage` asked for the final usage chunk); errors are `ErrorResponse`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReasonText = Literal["stop", "length", "abort", "error"]
StopReason = int | str | None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None  # the offending field (a JSON path such as `messages[0].role`), when one is known
    code: str | int | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every 4xx/5xx answer, and the last SSE event of a stream that failed after it started."""

    error: ErrorInfo


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReasonText | None
    stop_reason: StopReason = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int | None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
