"""Input limits: how much one request may ask for, checked before any work that grows with it.

What a client sends decides how long validating it takes (a JSON schema nested 1,000 deep parses for
minutes; a 100,000-value enum compiles for longer), and that work runs where every other request
waits: the server's event loop, the engine's grammar thread. Each such input has a bound here,
checked first with `len()`-cost tests, and a request past one is refused with an
`InvalidInputError` naming the field and the bound (a 400 from the server).

`InputLimits` holds them; its defaults are in docs/reliability.md. Set them with
`AsyncLLM(input_limits=InputLimits(...))` / `LLM(...)` (an `EngineConfig` field) or
`troupe serve --limit NAME=VALUE` (repeatable).

- `check_params(params, limits)`: the list fields of a `SamplingParams` (or of a server request,
  which has the same names), before they are converted or validated one by one.
- `check_structured(spec, limits)`: a structured-output spec's text, nesting and enumerations,
  before xgrammar parses it; `check_constraint` the same for one constraint as a client sent it (the
  server checks each before its text is parsed on the event loop).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from troupe.errors import InvalidInputError


class InputLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The bounds on one request (each >= 1; docs/reliability.md gives the reasons for the defaults)."""

    max_json_schema_bytes: int = 65_536  # a JSON schema's text (also a structural tag's)
    max_json_schema_depth: int = 32  # objects and arrays nested in a JSON schema
    max_enum_values: int = 1_024  # enum and const values in a schema, or `choice` strings
    max_regex_chars: int = 4_096
    max_grammar_chars: int = 65_536  # an EBNF / GBNF grammar
    max_logit_bias: int = 1_024  # entries
    max_allowed_token_ids: int = 65_536
    max_bad_words: int = 128
    max_stop: int = 64  # stop strings
    max_stop_token_ids: int = 1_024
    max_prompts: int = 1_024  # prompts of one completions request (each is an engine request)
    max_detokenize_tokens: int = 131_072  # ids of one /detokenize request
    max_chat_template_chars: int = 65_536  # a caller's own chat template (troupe.chat_template)
    max_chat_template_output_chars: int = 1_048_576  # what it renders
    max_chat_template_render_ms: int = 2_000

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"input_limits.{name}", f"must be an integer >= 1, got {value!r}")

    @classmethod
    def from_pairs(cls, pairs: list[str]) -> InputLimits:
        """`["max_stop=8", ...]` (the CLI's `--limit NAME=VALUE`) over the defaults."""
        values: dict[str, int] = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in cls.__struct_fields__:
                raise InvalidInputError("--limit", f"expected NAME=VALUE with NAME one of {sorted(cls.__struct_fields__)}, "
                                        f"got {pair!r}")
            try:
                values[name] = int(value)
            except ValueError:
                raise InvalidInputError(f"--limit {name}", f"must be an integer, got {value!r}") from None
        return cls(**values)


_LISTS = (("logit_bias", "max_logit_bias"), ("allowed_token_ids", "max_allowed_token_ids"),
          ("bad_words", "max_bad_words"), ("stop_token_ids", "max_stop_token_ids"))


def _over(field: str, count: int, bound: int, limit_name: str, what: str) -> InvalidInputError:
    return InvalidInputError(field, f"has {count} {what}; at most {bound} are accepted "
                             f"(input limit {limit_name})")


def check_params(params: Any, limits: InputLimits) -> None:
    """The list fields of `params` (a SamplingParams or a server request) against `limits`."""
    for field, name in _LISTS:
        value = getattr(params, field, None)
        if isinstance(value, dict | list | tuple) and len(value) > getattr(limits, name):
            raise _over(field, len(value), getattr(limits, name), name, "entries")
    stop = getattr(params, "stop", None)
    if isinstance(stop, list | tuple) and len(stop) > limits.max_stop:
        raise _over("stop", len(stop), limits.max_stop, "max_stop", "strings")


def check_prompts(prompt: Any, limits: InputLimits) -> None:
    """A completions `prompt`: a batch (a list of strings or of id lists) of at most max_prompts."""
    if isinstance(prompt, list) and len(prompt) > limits.max_prompts and not all(isinstance(x, int) for x in prompt):
        raise _over("prompt", len(prompt), limits.max_prompts, "max_prompts", "prompts")


def check_structured(spec: Any, limits: InputLimits) -> None:
    """A `StructuredOutputsParams` against `limits`, before anything parses it."""
    kind = spec.kind
    check_constraint(f"structured_outputs.{kind}", kind, getattr(spec, kind), limits)


def check_constraint(field: str, kind: str, value: Any, limits: InputLimits) -> None:
    """One output constraint of kind "regex", "grammar", "choice", "json" or "structural_tag", as a client
    sent it in `field` (text or parsed), against `limits`: before anything parses or converts it."""
    if kind in ("regex", "grammar") and isinstance(value, str):
        bound, name = (limits.max_regex_chars, "max_regex_chars") if kind == "regex" else \
            (limits.max_grammar_chars, "max_grammar_chars")
        if len(value) > bound:
            raise InvalidInputError(field, f"is {len(value)} characters long; at most {bound} are accepted "
                                    f"(input limit {name})")
    if kind == "choice" and isinstance(value, list | tuple) and len(value) > limits.max_enum_values:
        raise _over(field, len(value), limits.max_enum_values, "max_enum_values", "choices")
    if kind in ("json", "structural_tag"):
        check_schema(field, value, limits)


def check_schema(field: str, value: Any, limits: InputLimits) -> None:
    """A JSON schema (text or parsed) or structural tag: its size, nesting depth and enum values."""
    if isinstance(value, str):
        if len(value) > limits.max_json_schema_bytes:
            raise InvalidInputError(field, f"is {len(value)} characters long; at most {limits.max_json_schema_bytes} "
                                    "are accepted (input limit max_json_schema_bytes)")
        if _text_depth(value) > limits.max_json_schema_depth:
            raise _too_deep(field, limits)
        try:
            value = json.loads(value)
        except ValueError:
            return  # not JSON: the backend's parse names the error
    depth, enums = _walk(value, limits.max_json_schema_depth)
    if depth > limits.max_json_schema_depth:
        raise _too_deep(field, limits)
    if enums > limits.max_enum_values:
        raise _over(field, enums, limits.max_enum_values, "max_enum_values", "enum values")
    if not isinstance(value, str) and len(msgspec.json.encode(value)) > limits.max_json_schema_bytes:
        raise InvalidInputError(field, f"is over {limits.max_json_schema_bytes} bytes as JSON "
                                "(input limit max_json_schema_bytes)")


def _too_deep(field: str, limits: InputLimits) -> InvalidInputError:
    return InvalidInputError(field, f"nests objects and arrays more than {limits.max_json_schema_depth} deep "
                             "(input limit max_json_schema_depth)")


def _text_depth(text: str) -> int:
    """The deepest bracket nesting of JSON text (brackets inside strings skipped), without parsing it:
    Python's parser would recurse once per level."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _walk(value: Any, max_depth: int) -> tuple[int, int]:
    """(nesting depth, enum + const values) of a parsed schema, iteratively; stops past max_depth."""
    deepest, enums = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > max_depth:
            return deepest, enums
        items = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
            if "const" in node:
                enums += 1
        stack.extend((child, depth + 1) for child in items)
    return deepest, enums
