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
`grammar` -> EBNF / GBNF text; `structural_tag` -> xgrammar's structural tag (`structural_tag_grammar`: the
older `structures` / `triggers` form becomes the same `triggered_tags` format vLLM's deprecated call
built).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from troupe.errors import InvalidInputError
from troupe.structured.params import StructuredOutputsParams


def _xgr() -> Any:
    import xgrammar  # imported on first use, or by `preload`

    return xgrammar


def preload() -> None:
    """Import xgrammar now, on the calling thread. Its native library's initialisation holds the GIL for
    ~120 ms (more on a loaded machine): done lazily on the first structured request, that stalls every
    other thread of the process, the server's event loop included. The frontend calls this in the thread
    that loads the tokenizer while the engines start, after the tokenizer: xgrammar imports transformers'
    tokenizer classes, and a second thread importing transformers at the same time finds its lazy module
    half built (`cannot import name 'PreTrainedTokenizerBase'`)."""
    _xgr()


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices`."""
    def quote(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
            .replace("\t", "\\t") + '"'
    return "root ::= " + " | ".join(quote(c) for c in choices)


def _schema_text(spec: StructuredOutputsParams) -> str:
    return spec.json if isinstance(spec.json, str) else json.dumps(spec.json)


def structural_tag_grammar(text: str) -> Any:
    """The xgrammar `Grammar` of a structural tag in either of vLLM's forms (troupe.structured.params).

    The older form, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, is free text until
    a trigger, then one structure (begin, JSON per its schema, end), then free text again: xgrammar's
    `triggered_tags` format, which is what its deprecated `(tags, triggers)` call builds."""
    xgr = _xgr()
    tag = json.loads(text)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(text)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers \
            or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError('"structures" must be a non-empty list of {"begin", "schema", "end"} and "triggers" a '
                         "non-empty list of strings")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema", {}), dict | bool):
            raise ValueError(f'each structure needs "begin" and "end" strings and a JSON schema "schema", got {s!r}')
        tags.append({"begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s.get("schema", {})}})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


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
        elif kind == "structural_tag":
            assert spec.structural_tag is not None
            structural_tag_grammar(spec.structural_tag)
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
        if kind == "structural_tag":
            assert spec.structural_tag is not None
            return c.compile_grammar(structural_tag_grammar(spec.structural_tag))
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
