"""Structural tags (`structured_outputs.structural_tag`) in both of vLLM's forms, compiled by troupe's backend
against the default model's vocabulary and walked character by character with xgrammar's matcher: what each
form lets through and what it refuses. The engine runs them in tests/e2e/test_sampling_features.py and the
server in tests/server/test_server_tools.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from troupe import StructuredOutputsParams
from troupe.errors import InvalidInputError
from troupe.structured import backend

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
LEGACY = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
          "triggers": ["<function="]}
FORCED = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                               "content": {"type": "json_schema", "json_schema": WEATHER}}}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> backend.GrammarCompiler:
    return backend.GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler: backend.GrammarCompiler, tag: dict[str, Any], text: str) -> bool:
    spec = StructuredOutputsParams(structural_tag=json.dumps(tag))
    backend.validate(spec)
    matcher = backend._xgr().GrammarMatcher(compiler.compile(spec))
    return bool(matcher.accept_string(text))


@pytest.mark.parametrize(("text", "ok"), [
    ("any text at all, no call", True),
    ('Let me look. <function=get_weather>{"city": "Paris"}</function> Done.', True),
    ('<function=get_weather>{"city": "Paris"}</function><function=get_weather>{"city": "Rome"}</function>', True),
    ('<function=get_weather>{"town": "Paris"}</function>', False),  # the schema's keys only
    ('<function=get_weather>{"city": 3}</function>', False),
    ("<function=get_time>{}</function>", False),  # a trigger must start one of the structures
])
def test_the_older_form_is_free_text_with_checked_calls(compiler: backend.GrammarCompiler, text: str,
                                                        ok: bool) -> None:
    assert accepts(compiler, LEGACY, text) is ok


@pytest.mark.parametrize(("text", "ok"), [
    ('<answer>{"city": "Paris"}</answer>', True),
    ('{"city": "Paris"}', False),  # the tag is not optional
    ('Sure: <answer>{"city": "Paris"}</answer>', False),
    ('<answer>{"city": "Paris"}</answer> and more', False),
])
def test_a_tag_format_must_be_taken(compiler: backend.GrammarCompiler, text: str, ok: bool) -> None:
    assert accepts(compiler, FORCED, text) is ok


@pytest.mark.parametrize("tag", [
    {"structures": [], "triggers": ["<f"]},
    {"structures": [{"begin": "<f>", "end": "</f>", "schema": WEATHER}], "triggers": []},
    {"structures": [{"begin": "<f>", "schema": WEATHER}], "triggers": ["<f"]},
    {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>"}},
])
def test_malformed_tags_are_refused_naming_the_field(tag: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError) as info:
        backend.validate(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    assert info.value.field == "structured_outputs.structural_tag"
