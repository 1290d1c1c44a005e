"""The pooling endpoints' request and response bodies (vLLM's / OpenAI's shapes) as msgspec Structs.

`/v1/embeddings` and `/pooling` take `input`: a string, a list of strings, a list of token ids, or a
list of token-id lists (one prompt each); or, as vLLM's chat form, `messages` (one prompt: the
conversation through the chat template, `add_generation_prompt` false unless asked). `/score` takes `text_1` / `text_2`, `/rerank` a `query` and
`documents`. Decoding checks types and ranges: a wrong one is a 400 naming the field.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from troupe.pooling import PoolingParams
from troupe.sampling_params import INT64_MAX, INT64_MIN
from troupe.server.chat import ChatMessage
from troupe.server.errors import bad_request

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Truncate = Annotated[int, Meta(ge=-1, le=INT64_MAX)]  # -1: max_model_len; 0 is refused by PoolingParams
EncodingFormat = Literal["float", "base64"]
PoolingInput = str | list[Any]  # a string, strings, token ids, or lists of token ids: checked in `prompts()`


class _PoolingFields(msgspec.Struct, kw_only=True):
    """Fields every pooling request has (vLLM's)."""

    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None
    priority: Int64 = 0
    request_id: str | None = None
    user: str | None = None  # OpenAI's end-user id: recorded nowhere, changes nothing (as in vLLM)

    def pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        return PoolingParams(dimensions=dimensions, normalize=normalize, truncate_prompt_tokens=self.truncate_prompt_tokens)


class EmbeddingRequest(_PoolingFields, kw_only=True):
    """`POST /v1/embeddings` (OpenAI's, with vLLM's extras) and `POST /pooling`."""

    input: PoolingInput | None = None
    messages: list[ChatMessage] | None = None  # vLLM's chat form: exactly one of `input` and `messages`
    add_generation_prompt: bool = False  # chat form only (vLLM's default for embeddings)
    continue_final_message: bool = False  # chat form only
    chat_template_kwargs: dict[str, Any] | None = None  # chat form only
    chat_template: str | None = None  # chat form only; needs `troupe serve --trust-request-chat-template`
    encoding_format: EncodingFormat = "float"
    dimensions: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = None  # Matryoshka models only
    normalize: bool | None = None  # None: the model's pooler decides
    add_special_tokens: bool | None = None  # default: true for `input`, false for `messages` (as vLLM)

    def check_form(self) -> None:
        """Exactly one of `input` and `messages`; the chat-only fields only with `messages`."""
        if (self.input is None) == (self.messages is None):
            raise bad_request("input", "give exactly one of `input` and `messages`")
        if self.messages is None:
            for name in ("add_generation_prompt", "continue_final_message"):
                if getattr(self, name):
                    raise bad_request(name, "applies to `messages` only")
            for name in ("chat_template_kwargs", "chat_template"):
                if getattr(self, name) is not None:
                    raise bad_request(name, "applies to `messages` only")
        elif self.add_generation_prompt and self.continue_final_message:
            raise bad_request("continue_final_message", "cannot be combined with add_generation_prompt")

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per input (a text, or `{"prompt_token_ids": ...}`); an empty one is a 400."""
        value: Any = self.input
        if isinstance(value, str):
            items: list[Any] = [value]
        elif value and all(_is_id(x) for x in value):
            items = [list(value)]
        else:
            items = list(value)
        if not items:
            raise bad_request("input", "must not be empty")
        out: list[str | dict[str, list[int]]] = []
        for i, item in enumerate(items):
            if isinstance(item, list) and all(_is_id(x) for x in item):
                item = {"prompt_token_ids": item}
            elif not isinstance(item, str):
                raise bad_request(f"input[{i}]", "must be a string or a list of token ids (integers >= 0)")
            if not (item if isinstance(item, str) else item["prompt_token_ids"]):
                raise bad_request(f"input[{i}]", "must not be empty")
            out.append(item)
        return out


class ScoreRequest(_PoolingFields, kw_only=True):
    """`POST /score` and `/v1/score`: `text_1` against `text_2` (one with many, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields, kw_only=True):
    """`POST /rerank`, `/v1/rerank`: `documents` ranked by their score against `query`."""

    query: str
    documents: list[str]
    top_n: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0  # 0: every document


class PoolingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT64_MAX


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """As OpenAI's API: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
