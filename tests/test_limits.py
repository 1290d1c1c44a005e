"""troupe.limits: each bound refuses past it and accepts at it, naming the field and the limit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from troupe import InvalidInputError, SamplingParams
from troupe.limits import InputLimits, check_params, check_prompts, check_structured
from troupe.structured import StructuredOutputsParams as SO

SMALL = InputLimits(max_json_schema_bytes=200, max_json_schema_depth=3, max_enum_values=4, max_regex_chars=8,
                    max_grammar_chars=30, max_logit_bias=2, max_allowed_token_ids=3, max_bad_words=2, max_stop=2,
                    max_stop_token_ids=2, max_prompts=2, max_detokenize_tokens=5)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(("field", "at", "past"), [
    ("logit_bias", {1: 1.0, 2: 1.0}, {1: 1.0, 2: 1.0, 3: 1.0}),
    ("allowed_token_ids", [1, 2, 3], [1, 2, 3, 4]),
    ("bad_words", ["a", "b"], ["a", "b", "c"]),
    ("stop", ["a", "b"], ["a", "b", "c"]),
    ("stop_token_ids", [1, 2], [1, 2, 3]),
])
def test_list_fields(field: str, at: Any, past: Any) -> None:
    """A list field at its bound passes; one entry more is refused naming the field and the limit."""
    check_params(SamplingParams(**{field: at}), SMALL)
    with pytest.raises(InvalidInputError, match="input limit max_") as err:
        check_params(SamplingParams(**{field: past}), SMALL)
    assert err.value.field == field


@pytest.mark.parametrize(("spec", "ok"), [
    (SO(regex="a" * 8), True), (SO(regex="a" * 9), False),
    (SO(grammar='root ::= "' + "a" * 19 + '"'), True), (SO(grammar='root ::= "' + "a" * 21 + '"'), False),
    (SO(choice=["a", "b", "c", "d"]), True), (SO(choice=["a", "b", "c", "d", "e"]), False),
    (SO(json=nested(3)), True), (SO(json=nested(4)), False),
    (SO(json=json.dumps(nested(3))), True), (SO(json=json.dumps(nested(4))), False),
    (SO(json={"enum": [1, 2, 3], "const": 4}), True), (SO(json={"anyOf": [{"enum": [1, 2, 3]}, {"enum": [4, 5]}]}), False),
    (SO(json=json.dumps({"description": "x" * 150})), True), (SO(json=json.dumps({"description": "x" * 250})), False),
    (SO(json={"description": "x" * 250}), False),
])
def test_structured_specs(spec: SO, ok: bool) -> None:
    """Regex and grammar length, choice and enum counts, schema depth and size (text or parsed)."""
    if ok:
        check_structured(spec, SMALL)
        return
    with pytest.raises(InvalidInputError, match="input limit max_") as err:
        check_structured(spec, SMALL)
    assert err.value.field == f"structured_outputs.{spec.kind}"


def test_text_depth_is_measured_without_parsing_and_skips_strings() -> None:
    """Depth counts brackets outside strings (a `[` inside a description is text), and text nested
    past Python's own parser limit is refused without parsing it."""
    check_structured(SO(json=json.dumps({"description": "[[[[[[{{{{", "type": "string"})), SMALL)
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    with pytest.raises(InvalidInputError, match="max_json_schema_depth"):
        check_structured(_raw_json(deep), InputLimits())


def _raw_json(text: str) -> Any:
    """A spec-like object holding unparsed text (StructuredOutputsParams parses its text itself)."""
    class Raw:
        kind = "json"
        json = text
    return Raw()


def test_prompt_batches() -> None:
    """A batch of strings or id lists counts its prompts; a flat id list is one prompt."""
    check_prompts(["a", "b"], SMALL)
    check_prompts([1, 2, 3, 4, 5], SMALL)
    with pytest.raises(InvalidInputError, match="max_prompts"):
        check_prompts(["a", "b", "c"], SMALL)


def test_the_limits_themselves_are_checked() -> None:
    """Each limit is an integer >= 1; `from_pairs` reads NAME=VALUE (the CLI's --limit)."""
    with pytest.raises(InvalidInputError, match="input_limits.max_stop"):
        InputLimits(max_stop=0)
    assert InputLimits.from_pairs(["max_stop=3", "max-bad-words=7"]) == InputLimits(max_stop=3, max_bad_words=7)
    for bad in (["max_stop"], ["nope=1"], ["max_stop=x"]):
        with pytest.raises(InvalidInputError):
            InputLimits.from_pairs(bad)
