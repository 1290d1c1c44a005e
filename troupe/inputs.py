"""Prompt handling: turn what a user passes into a validated `AddRequest` (pure, no event loop).

Accepted prompts (as in vLLM): a string; `{"prompt": str}`; `{"prompt_token_ids": [...]}`
(vLLM's `TokensPrompt`); or, through `render_chat`, a conversation rendered by the model's chat
template. A prompt dict with vLLM's multimodal or embedding keys (`multi_modal_data`, ...) is
refused: troupe serves text-only models, and dropping them would answer another question.
`SamplingParams.truncate_prompt_tokens` keeps the prompt's last k tokens (`truncate_prompt`).
Every check raises `InvalidInputError` naming the field and the allowed range.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from troupe.errors import InvalidInputError
from troupe.limits import InputLimits, check_params, check_structured
from troupe.messages import AddRequest
from troupe.pooling import PoolerConfig, PoolingParams
from troupe.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

PromptType = str | Mapping[str, Any]
ChatMessages = Sequence[Mapping[str, Any]]

_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the input processor checks prompts against."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kv_capacity_tokens: int | None = None  # tokens one request can hold in the KV pool
    data_parallel_size: int = 1
    priority_scheduling: bool = False  # the engine honours `priority` (scheduling_policy="priority")
    max_logprobs: int = 20  # EngineConfig.max_logprobs: -1 allows the whole vocabulary
    inputs: InputLimits = InputLimits()  # the frontend's EngineConfig.input_limits (troupe.limits)
    pooler: PoolerConfig | None = None  # a pooling engine's pooler (runner="pooling"); None: it generates


def make_request_id(external_id: str) -> str:
    """A unique internal id; user ids may repeat."""
    return f"{external_id}-{uuid.uuid4().hex[:8]}"


def next_request_id() -> str:
    return str(next(_counter))


_UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")


def split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """(text, token ids): exactly one is set."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        for key in _UNSUPPORTED_PROMPT_KEYS:
            if prompt.get(key) is not None:
                raise InvalidInputError(key, f"`{key}` is not supported: troupe serves text-only models "
                                             "(give the prompt as text or token ids)")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
                raise InvalidInputError("prompt_token_ids", "must be a list of integers")
            return None, list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
    raise InvalidInputError(
        "prompt", f"must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
    )


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` as the model expects them: a prompt's with the tokenizer's BOS/EOS; a rendered
    chat template's without (`add_special_tokens=False`: the template writes its own BOS, as vLLM)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def render_chat(tokenizer: Any, messages: ChatMessages, add_generation_prompt: bool = True,
                chat_template: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None,
                limits: InputLimits | None = None, **template_kwargs: Any) -> str:
    """The conversation as text through the model's chat template; `tools` (OpenAI function
    definitions) and `template_kwargs` are passed to the template as transformers does. A caller's own
    `chat_template` renders under `limits`' template bounds (`troupe.chat_template`)."""
    if not isinstance(messages, Sequence) or not messages:
        raise InvalidInputError("messages", "must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidInputError(f"messages[{i}]", "must be an object with 'role' and 'content'")
    if chat_template is not None:
        from troupe.chat_template import render_bounded

        try:
            return render_bounded(tokenizer, chat_template, messages, add_generation_prompt, tools,
                                  limits or InputLimits(), **template_kwargs)
        except InvalidInputError:
            raise
        except Exception as exc:  # the template's own error (jinja2's TemplateError, a raise_exception)
            raise InvalidInputError("messages", f"chat template failed: {type(exc).__name__}: {exc}") from exc
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools, **template_kwargs)
    except Exception as exc:  # no template, or the template refused the conversation (jinja2's TemplateError)
        raise InvalidInputError("messages", f"chat template failed: {type(exc).__name__}: {exc}") from exc
    return str(text)


def validate_prompt_ids(ids: list[int], limits: ModelLimits, output_room: int = 1) -> None:
    """`output_room`: tokens the request needs after its prompt (1 to generate; 0 for pooling)."""
    if not ids:
        raise InvalidInputError("prompt", "the prompt is empty; at least 1 token is needed")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise InvalidInputError(
                "prompt_token_ids", f"token id {t!r} is outside the vocabulary [0, {limits.vocab_size})"
            )
    if len(ids) + output_room > limits.max_model_len:
        room = " with room for one output token" if output_room else ""
        raise InvalidInputError(
            "prompt",
            f"the prompt has {len(ids)} tokens; at most {limits.max_model_len - output_room} fit the model's "
            f"context of {limits.max_model_len} tokens (max_model_len){room}",
        )
    if limits.kv_capacity_tokens is not None and len(ids) + output_room > limits.kv_capacity_tokens:
        raise InvalidInputError(
            "prompt",
            f"the prompt has {len(ids)} tokens but the KV cache holds at most {limits.kv_capacity_tokens} "
            "tokens for one request; raise kv_cache_memory_bytes or shorten the prompt",
        )


def validate_sampling(params: SamplingParams, limits: ModelLimits) -> None:
    """The checks of `params` that need the model: token ids inside the vocabulary, logprob counts
    within `max_logprobs`, list sizes within the input limits. Raises `InvalidInputError` naming the field."""
    check_params(params, limits.inputs)
    vocab = limits.vocab_size
    for field, ids in (("stop_token_ids", params.stop_token_ids or ()), ("allowed_token_ids",
                       params.allowed_token_ids or ()), ("logit_bias", params.logit_bias or ())):
        for t in ids:
            if t >= vocab:
                raise InvalidInputError(field, f"token id {t} is outside the vocabulary [0, {vocab})")
    most = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, field)
        if asked is None:
            continue
        if (vocab if asked == -1 else asked) > most:
            raise InvalidInputError(field, f"asks for {asked} logprobs; at most {limits.max_logprobs} are allowed "
                                    "(the engine's max_logprobs; -1 there allows the whole vocabulary)")


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word (leading spaces stripped) alone, and after a space
    when that gives a different first token with as many tokens (the word in mid-text)."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for word in words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (alone, spaced):
            if ids and tuple(ids) not in seen and (ids is alone or (ids[0] != alone[0] and len(ids) == len(alone))):
                seen.add(tuple(ids))
                out.append(ids)
        for t in alone + spaced:
            if not 0 <= t < vocab_size:
                raise InvalidInputError("bad_words", f"{word!r} tokenizes to id {t}, outside the vocabulary")
    return out


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The last `params.truncate_prompt_tokens` ids (-1: max_model_len), as vLLM truncates on the left;
    `ids` when unset. More than max_model_len is an `InvalidInputError`."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise InvalidInputError("truncate_prompt_tokens", f"got {k}, more than the model's context of "
                                f"{max_model_len} tokens (max_model_len)")
    return ids[-k:] if len(ids) > k else ids


def build_request(
    *, prompt_token_ids: list[int], params: SamplingParams, limits: ModelLimits, external_id: str,
    priority: int = 0, data_parallel_rank: int | None = None, tokenizer: Any = None,
    pooling_params: PoolingParams | None = None,
) -> AddRequest:
    """Validate and resolve one request (max_tokens, EOS ids, a unique internal id, the bad words'
    token ids with `tokenizer`); a structured-output spec is parsed by the backend here, so a bad one
    fails at the edge. A pooling request (`pooling_params`, with the facade's internal `params`) is
    checked against the engine's pooler."""
    if not isinstance(params, SamplingParams):
        raise InvalidInputError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
    params.verify()  # again: the struct is mutable, and a field changed since construction must not reach the engine
    check_runner(limits.pooler, pooling_params)
    prompt_token_ids = truncate_prompt(prompt_token_ids, params, limits.max_model_len)
    validate_prompt_ids(prompt_token_ids, limits, 0 if pooling_params is not None else 1)
    validate_sampling(params, limits)
    bad_words: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise InvalidInputError("bad_words", "bad words need a tokenizer (this engine has none)")
        bad_words = bad_words_token_ids(tokenizer, params.bad_words, limits.vocab_size)
    if params.structured_outputs is not None:
        from troupe.structured.backend import validate

        check_structured(params.structured_outputs, limits.inputs)
        validate(params.structured_outputs)
    if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
        raise InvalidInputError("priority", f"must be a signed 64-bit integer, got {priority!r}")
    if priority != 0 and not limits.priority_scheduling:
        raise InvalidInputError("priority", f"got {priority}, but the engine schedules first-come-first-served; "
                                "start it with scheduling_policy='priority' to use priorities")
    if data_parallel_rank is not None and (
            isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int)
            or not 0 <= data_parallel_rank < limits.data_parallel_size):
        raise InvalidInputError(
            "data_parallel_rank",
            f"must be in [0, {limits.data_parallel_size - 1}] (data_parallel_size={limits.data_parallel_size}), "
            f"got {data_parallel_rank}",
        )
    room = limits.max_model_len - len(prompt_token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if pooling_params is not None:
        max_tokens = 1  # nothing is generated; the scheduler sizes the request by its prompt
    return AddRequest(
        request_id=make_request_id(external_id),
        prompt_token_ids=prompt_token_ids,
        params=params,
        max_tokens=max_tokens,
        eos_token_ids=list(limits.eos_token_ids),
        arrival_time=time.time(),
        priority=priority,
        external_id=external_id,
        data_parallel_rank=data_parallel_rank,
        bad_words_token_ids=bad_words,
        pooling_params=pooling_params,
    )


def check_runner(pooler: PoolerConfig | None, pooling_params: PoolingParams | None) -> None:
    """A pooling request needs a pooling engine (and one it can honour), a generation request a
    generating one: else an `InvalidInputError` naming the runner."""
    if pooling_params is None:
        if pooler is not None:
            raise InvalidInputError("runner", "this engine was started with runner='pooling' (--runner pooling): "
                                    "it answers encode / embed / score requests, not generation")
        return
    if not isinstance(pooling_params, PoolingParams):
        raise InvalidInputError("pooling_params", f"must be a PoolingParams, got {type(pooling_params).__name__}")
    pooling_params.verify()
    if pooler is None:
        raise InvalidInputError("runner", "pooling (encode / embed / score) needs an engine started with "
                                "runner='pooling' (--runner pooling); this one generates")
    pooler.check(pooling_params)



P = TypeVar("P")


def per_prompt(params: P | Sequence[P] | None, n: int, kind: type[P], field: str,
               default: Callable[[], P]) -> list[P]:
    """One parameter object per prompt from what a batch call was given: none (`default()` each), one
    `kind` for every prompt, or exactly `n` (else an error naming `field`)."""
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, kind):
        return [params] * n
    listed = list(params)  # type: ignore[arg-type]
    if len(listed) != n:
        raise InvalidInputError(field, f"got {len(listed)} for {n} prompts; pass one, or one per prompt")
    return listed
