"""OpenAI request bodies as msgspec Structs, and their mapping to `SamplingParams`.

Decoding is strict: a wrong type, a value outside the range the field states (`Meta`, the same
ranges `SamplingParams` checks, published in `/openapi.json`) or an unknown field is a 400 naming
the field. OpenAI fields the
engine does not implement yet are declared so that clients sending their *neutral* value (`n=1`,
`logprobs=null`, `presence_penalty=0`, ...) are served; any other value is a 400 naming the field
(`reject_unsupported`), never a silent ignore. vLLM's extras that troupe implements are accepted
as in vLLM (`top_k`, `min_p`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`, `priority`).
Defaults follow vLLM: completions `max_tokens=16`; chat `max_tokens=None` (up to the context).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from troupe.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams
from troupe.server.errors import bad_request

# Ranges the schema (and so /openapi.json) states, the same as SamplingParams checks.
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # the vocabulary's end is the model's: checked later


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields completions and chat share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None  # vLLM's server range: what a torch.Generator takes
    user: str | None = None  # for abuse monitoring at OpenAI; accepted and not used
    # declared so that neutral values pass; anything else is rejected (see _UNSUPPORTED)
    n: PositiveInt = 1
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    logit_bias: dict[str, float] | None = None
    # vLLM extras troupe implements
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams: DELTA outputs when streaming, FINAL_ONLY otherwise.

        Raises `InvalidInputError` (a 400 naming the field) for out-of-range values.
        """
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream=true")
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/completions`: a prompt (text or token ids) or a batch of them."""

    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[PromptItem], Meta(min_length=1)]
    max_tokens: PositiveInt | None = 16
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per choice: a string, or `{"prompt_token_ids": [...]}`."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt", "the prompt list is empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": [x for x in p if isinstance(x, int)]}]
        out: list[str | dict[str, list[int]]] = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, list):
                out.append({"prompt_token_ids": x})
            else:
                raise bad_request(f"prompt[{i}]", "a batch must be a list of strings or of token-id lists")
        return out


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    # what SDKs echo back for assistant messages; must be empty
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


_ROLES = ("system", "developer", "user", "assistant")


class ChatCompletionRequest(_GenerationRequest, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/chat/completions`: a conversation rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any | None = None
    reasoning_effort: str | None = None
    prediction: Any | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as `{"role", "content"}` dicts for the chat template (text only)."""
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role not in _ROLES:
                raise bad_request(f"{where}.role", f"must be one of {list(_ROLES)} (tools are not supported "
                                                   f"yet), got {m.role!r}")
            for field in ("name", "audio", "function_call", "tool_calls", "tool_call_id", "refusal"):
                if getattr(m, field) is not None:
                    raise bad_request(f"{where}.{field}", f"`{field}` in messages is not supported by troupe yet")
            if m.annotations:
                raise bad_request(f"{where}.annotations", "`annotations` in messages are not supported")
            out.append({"role": m.role, "content": _text_of(m.content, where)})
        if not out:
            raise bad_request("messages", "must be a non-empty list of messages")
        return out


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        raise bad_request(f"{where}.content", "content is required")
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]", "only {'type': 'text', 'text': str} content parts are "
                                                       f"supported, got type {part.get('type')!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def _none(v: Any) -> bool:
    return v is None


def _none_or_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# field -> is its value neutral? (the penalties are checked by SamplingParams itself; n > 1 runs in the
# engine, but the responses do not carry n choices yet)
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "logit_bias": _none_or_empty,
    "best_of": lambda v: v is None or v == 1,
    "echo": lambda v: v is False,
    "suffix": _none,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "tools": _none_or_empty,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": _none_or_empty,
    "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _none,
    "reasoning_effort": _none,
    "prediction": _none,
    "store": lambda v: v is None or v is False,
    "service_tier": lambda v: v in (None, "auto", "default"),
}


def reject_unsupported(req: _GenerationRequest) -> None:
    """A 400 naming the first field set to a value troupe cannot honour yet."""
    for field, neutral in _UNSUPPORTED.items():
        if field in req.__struct_fields__:
            value = getattr(req, field)
            if not neutral(value):
                raise bad_request(field, f"`{field}` is not supported by troupe yet (got {value!r}); "
                                         "leave it unset")


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /tokenize`: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, str]]:
        return ChatCompletionRequest(messages=self.messages or []).conversation()


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]

