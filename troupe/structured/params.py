"""`StructuredOutputsParams`: the constraint a request's output must satisfy (vLLM's shape).

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object),
`regex`, `choice` (one of these strings), `grammar` (EBNF / GBNF text) or `structural_tag` (JSON text:
text with tagged, schema-constrained parts, the form tool calls take) is set. The three options shape
the JSON a schema allows: `disable_any_whitespace` (compact JSON only), `disable_additional_properties`
(objects whose schema leaves `additionalProperties` unset get no extra keys) and `whitespace_pattern` (a
regex for the whitespace between JSON tokens).

`structural_tag` takes vLLM's two forms (troupe.structured.backend compiles both):
- `{"type": "structural_tag", "format": {...}}`: xgrammar's structural tag (a `tag` with `begin`,
  `content`, `end`; `triggered_tags`; `sequence`; ...);
- `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}` (the older form): free text
  until a trigger starts one of the structures, whose body follows its JSON schema up to its `end`.

Construction checks the shape only (which field, non-empty, a schema that is JSON); whether the schema,
regex or grammar compiles is checked where the request enters troupe (`troupe.structured.validate`),
which needs the structured-output backend.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from troupe.errors import InvalidInputError

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One output constraint; see the module docstring. Raises `InvalidInputError` naming the field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError("structured_outputs", "exactly one of json, json_object, regex, choice, "
                                    f"grammar or structural_tag must be set, got {given or 'none'}")
        kind = given[0]
        if kind == "structural_tag":
            self._check_structural_tag()
        elif kind == "json":
            self._check_schema()
        elif kind == "json_object":
            if self.json_object is not True:
                raise InvalidInputError("structured_outputs.json_object", f"must be true, got {self.json_object!r}")
        elif kind == "choice":
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise InvalidInputError("structured_outputs.choice", f"must be a non-empty list of strings, got "
                                        f"{self.choice!r}")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise InvalidInputError("structured_outputs.choice", f"choices must be non-empty strings, got {c!r}")
            self.choice = list(self.choice)
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise InvalidInputError(f"structured_outputs.{kind}", f"must be a non-empty string, got {value!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"structured_outputs.{name}", f"must be true or false, got "
                                        f"{getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InvalidInputError("structured_outputs.whitespace_pattern", "must be a regex string, got "
                                    f"{self.whitespace_pattern!r}")

    def _check_structural_tag(self) -> None:
        text = self.structural_tag
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("structured_outputs.structural_tag", f"must be a non-empty JSON string, got "
                                    f"{text!r}")
        try:
            tag = _json.loads(text)
        except ValueError as exc:
            raise InvalidInputError("structured_outputs.structural_tag", f"is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidInputError("structured_outputs.structural_tag", "nests objects and arrays too deeply to "
                                    "parse (input limit max_json_schema_depth)") from None
        if not isinstance(tag, dict) or ("format" not in tag and "structures" not in tag):
            raise InvalidInputError("structured_outputs.structural_tag", 'must be a JSON object with "format" '
                                    f'(a structural tag) or "structures" and "triggers", got {text!r}')

    def _check_schema(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                parsed = _json.loads(schema)
            except ValueError as exc:
                raise InvalidInputError("structured_outputs.json", f"is not valid JSON: {exc}") from None
            except RecursionError:
                raise InvalidInputError("structured_outputs.json", "nests objects and arrays too deeply to parse "
                                        "(input limit max_json_schema_depth)") from None
            if not isinstance(parsed, dict | bool):
                raise InvalidInputError("structured_outputs.json", f"must be a JSON schema object, got {schema!r}")
        elif not isinstance(schema, dict):
            raise InvalidInputError("structured_outputs.json", f"must be a JSON schema (an object or its JSON "
                                    f"text), got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> str:
        """A canonical text of the whole spec: equal specs compile to the same grammar (the cache key)."""
        return msgspec.json.encode(self, order="sorted").decode()
