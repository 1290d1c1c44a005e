"""OpenAI / vLLM request bodies as msgspec Structs, and their mapping to `SamplingParams`.

Decoding checks types and ranges (`Meta`, the ranges `SamplingParams` checks, published in
`/openapi.json`): a wrong type or an out-of-range value is a 400 naming the field. Like vLLM's
pydantic models, an integer field takes an integral float (`"max_tokens": 5.0`,
`serving.integral_floats_as_ints`); `5.5` stays a 400, and so does a string for a number.
Keys a Struct does not declare are ignored with a warning (`fields.unknown_fields`), as vLLM's server
does for keys it does not know either; vLLM's own request fields are all declared, and those troupe
cannot honour are a 400 unless neutral (`fields.reject_unsupported`).

`sampling_params(defaults)` builds the request's `SamplingParams`: DELTA outputs when streaming,
FINAL_ONLY otherwise; what the request leaves unset comes from `defaults` (the model's
`generation_config.json`), else the OpenAI default; the optional features (logprobs, penalties,
logit_bias, structured outputs, ...) are passed only when set, so SamplingParams keeps its own
defaults. The one output constraint may come from `structured_outputs`, `response_format`, a
`guided_*` field or (chat) a forced tool call. The chat request lives in `chat.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from troupe.limits import InputLimits, check_constraint
from troupe.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams
from troupe.server.errors import bad_request
from troupe.structured import StructuredOutputsParams

# Ranges the schema (and so /openapi.json) states, the same as SamplingParams checks.
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # the vocabulary's end is the model's: checked later
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]  # vLLM's default max_logprobs
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MAX_N = 128  # choices per request: each is an engine request


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format`, with vLLM's two structural-tag forms: `format` (xgrammar's structural
    tag), or the older `structures` (`{"begin", "schema", "end"}` objects) with `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's `structured_outputs` object: exactly one constraint, and options for JSON."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


_STRUCTURED = ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structural_tag")


class GenerationRequest(msgspec.Struct, kw_only=True):
    """The fields completions and chat share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None  # vLLM's server range: what a torch.Generator takes
    user: str | None = None  # for abuse monitoring at OpenAI; accepted and not used
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None  # token id -> bias, clamped to [-100, 100] as vLLM
    response_format: ResponseFormat | None = None
    # vLLM extras
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NumLogprobs | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    request_id: str | None = None
    session_id: str | None = None  # a routing hint in vLLM; accepted and not used
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None  # the last k; -1: max_model_len
    structural_tag: str | None = None  # vLLM's older top-level structural tag (its JSON text)
    # declared so that neutral values pass; anything else is a 400 (fields.UNSUPPORTED)
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    logprob_token_ids: list[int] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    watermarking: bool | None = None
    routed_experts_prompt_start: int | None = None
    truncation_side: str | None = None
    logits_processors: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def sample_logprobs(self) -> int | None:
        raise NotImplementedError

    def default_max_tokens(self) -> int | None:
        raise NotImplementedError

    def extra_constraint(self) -> dict[str, Any] | None:
        """A structured-output constraint the endpoint adds itself (chat: a forced tool call)."""
        return None

    def check(self) -> None:
        """Cross-field rules the schema cannot state (each a 400 naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs", "prompt_logprobs are not available with stream=true")

    def structured_outputs_params(self, limits: InputLimits | None = None) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (any of the fields in `_STRUCTURED`, or a
        forced tool call), as `StructuredOutputsParams`; None without one. With `limits`, the constraint
        is checked against them first (`check_constraint`), before its text is parsed."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            spec = msgspec.structs.asdict(self.structured_outputs)
            if isinstance(spec["structural_tag"], dict):  # the engine's field is its JSON text
                spec["structural_tag"] = json.dumps(spec["structural_tag"])
            found.append(("structured_outputs", {k: v for k, v in spec.items()
                                                 if v is not None and v is not False}))
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "structural_tag":
                if rf.format is None and (rf.structures is None or rf.triggers is None):
                    raise bad_request("response_format", 'type structural_tag needs "format", or "structures" '
                                      'and "triggers"')
                tag = {"type": "structural_tag", **{k: v for k, v in (("format", rf.format), ("structures",
                       rf.structures), ("triggers", rf.triggers)) if v is not None}}
                found.append(("response_format", {"structural_tag": json.dumps(tag)}))
            elif rf.type == "json_object":
                found.append(("response_format", {"json_object": True}))
            else:
                if rf.json_schema is None or rf.json_schema.schema is None:
                    raise bad_request("response_format.json_schema", "type json_schema needs json_schema.schema")
                found.append(("response_format", {"json": rf.json_schema.schema}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("structural_tag", "structural_tag")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, {key: value}))
        tool = self.extra_constraint()
        if tool is not None:
            found.append(("tool_choice", {"json": tool}))
        if not found:
            if self.guided_whitespace_pattern is not None:
                raise bad_request("guided_whitespace_pattern", "needs guided_json")
            return None
        if len(found) > 1:
            raise bad_request(found[1][0], f"give one output constraint; got {[f for f, _ in found]}")
        field, spec = found[0]
        if limits is not None:
            for kind in ("json", "regex", "choice", "grammar", "structural_tag"):
                if kind in spec:
                    check_constraint(field if field != "structured_outputs" else f"{field}.{kind}", kind, spec[kind],
                                     limits)
        if self.guided_whitespace_pattern is not None:
            spec["whitespace_pattern"] = self.guided_whitespace_pattern
        return StructuredOutputsParams(**spec)

    def sampling_params(self, defaults: Mapping[str, Any], limits: InputLimits | None = None) -> SamplingParams:
        """The request's SamplingParams (see the module docstring). Raises `InvalidInputError` (a
        400 naming the field) for values SamplingParams refuses, or past `limits` (its output constraint,
        checked before its text is parsed)."""
        self.check()

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens", self.default_max_tokens())
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        optional: dict[str, Any] = dict(
            presence_penalty=pick("presence_penalty", None), frequency_penalty=pick("frequency_penalty", None),
            repetition_penalty=pick("repetition_penalty", None), logprobs=self.sample_logprobs(),
            prompt_logprobs=self.prompt_logprobs_wanted(), logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            structured_outputs=self.structured_outputs_params(limits),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        kw.update({k: v for k, v in optional.items() if v is not None})  # set only: see the module docstring
        return SamplingParams(**kw)

    def prompt_logprobs_wanted(self) -> int | None:
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = min(100.0, max(-100.0, bias))
            except ValueError:
                raise bad_request("logit_bias", f"keys must be token ids, got {key!r}") from None
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(GenerationRequest, kw_only=True):
    """`POST /v1/completions`: a prompt (text or token ids) or a batch of them."""

    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[PromptItem], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None  # 0 only with echo
    echo: bool = False
    logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any | None = None

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens", "must be >= 1 (0 only with echo=true: the prompt alone)")

    def requested_max_tokens(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # echo only: one token is made and dropped

    def default_max_tokens(self) -> int | None:
        return 16  # OpenAI's and vLLM's completions default

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs  # echo with logprobs: the prompt's too (vLLM)
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per entry: a string, or `{"prompt_token_ids": [...]}`."""
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


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]
