"""The structured-output backend: xgrammar (docs/sampling.md says why).

- `validate(spec)`: parse the spec into an xgrammar `Grammar` (no tokenizer needed, fast): what the
  frontend runs on every structured request, so a bad schema, regex or grammar is an
  `InvalidInputError` naming the field before the engine sees it.
- `GrammarCompiler(tokenizer, vocab_size, stop_token_ids)`: compiles a spec against the model's
  vocabulary (`compile(spec)`, thread-safe, the slow part: run off the engine's step path).
- `Matcher(compiled)`: one request's state: `fill(bitmask, row)` writes the allowed tokens of the next
  position, `accept(token)` advances, `terminated` once the grammar has ended (after a stop token).

Specs map to xgrammar as vLLM's xgrammar backend does: `json` -> a JSON-schema grammar (xgrammar's
strict mode: no properties beyond the schema's), `any_whitespace` unless `disable_any_whitespace`;
`json_object` -> the schema `{"type": "object"}` (an object, not any JSON value); `regex`; `choice` -> an EBNF alternation of the strings;
`grammar` -> EBNF / GBNF text.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from troupe.errors import InvalidInputError
from troupe.structured.params import StructuredOutputsParams


def _xgr() -> Any:
    import xgrammar  # a few seconds to import: only when a structured request comes

    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices`."""
    def quote(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
            .replace("\t", "\\t") + '"'
    return "root ::= " + " | ".join(quote(c) for c in choices)


def _schema_text(spec: StructuredOutputsParams) -> str:
    return spec.json if isinstance(spec.json, str) else json.dumps(spec.json)


def validate(spec: StructuredOutputsParams) -> None:
    """Raise `InvalidInputError("structured_outputs.<kind>", ...)` if the spec does not parse."""
    xgr = _xgr()
    kind = spec.kind
    if spec.whitespace_pattern is not None:
        raise InvalidInputError("structured_outputs.whitespace_pattern", "is not supported by troupe's "
                                "structured-output backend (xgrammar); use disable_any_whitespace")
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(spec), any_whitespace=not spec.disable_any_whitespace)
        elif kind == "regex":
            assert spec.regex is not None
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            assert spec.grammar is not None
            xgr.Grammar.from_ebnf(spec.grammar)
        elif kind == "choice":
            assert spec.choice is not None
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
    except Exception as exc:  # xgrammar reports parse errors as RuntimeError / ValueError
        raise InvalidInputError(f"structured_outputs.{kind}", f"is not valid: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


class GrammarCompiler:
    """Compiles specs against one tokenizer's vocabulary (xgrammar's compiler keeps its own cache too)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> Any:
        c, kind = self._compiler, spec.kind
        if kind == "json":
            return c.compile_json_schema(_schema_text(spec), any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            return c.compile_grammar(choice_grammar(spec.choice))
        return c.compile_grammar(spec.grammar)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    """One request's position in its grammar (see the module docstring)."""

    def __init__(self, compiled: Any) -> None:
        self._m = _xgr().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (B, W) int32 (CPU): the tokens allowed next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())
