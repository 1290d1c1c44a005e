"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`to_api_error` is the one place that maps an exception to a status:

| exception                                     | status | type                    |
|-----------------------------------------------|--------|-------------------------|
| `APIError` (raised by the server itself)      | its own| its own                 |
| malformed JSON (`msgspec.DecodeError`)        | 400    | invalid_request_error   |
| wrong type / unknown field (`ValidationError`)| 400    | invalid_request_error   |
| `InvalidInputError` / other `ValueError`      | 400    | invalid_request_error   |
| `EngineDeadError`                             | 503    | service_unavailable     |
| `EngineGenerateError` (one request failed)    | 500    | internal_server_error   |
| anything else                                 | 500    | internal_server_error   |

A request that failed in the engine by its own fault (`RequestOutput.error_kind` "invalid_request",
e.g. its parameters leaving no token to sample: the engine's `NoTokenAllowedError`) reaches this as an
`InvalidInputError` (`ServerState.follow`): a 400.

`param` names the offending field when one is known (`InvalidInputError.field`, the JSON path of
a msgspec error).
"""

from __future__ import annotations

import re

import msgspec

from troupe.errors import EngineDeadError, EngineGenerateError, InvalidInputError

# engine-side field names -> the request field a client sent (token-id prompts arrive as `prompt`)
_PARAM_NAMES = {"prompt_token_ids": "prompt"}
_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]*)`")


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | int | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def _msgspec_param(message: str) -> str | None:
    """The JSON path a msgspec error points at, as `a.b[0]` (None for the whole body)."""
    m = _AT.search(message)
    path = m.group("path") if m else ""
    field = _FIELD.search(message)
    if field:  # the name may be "" (a body with an empty key): still the field to name
        return f"{path}.{field.group('name')}" if path else field.group("name")
    return path or None


def to_api_error(exc: BaseException) -> APIError:
    """The `APIError` an exception is answered with (see the module table)."""
    match exc:
        case APIError():
            return exc
        case msgspec.ValidationError():
            return bad_request(_msgspec_param(str(exc)), f"invalid request: {exc}")
        case RecursionError():  # msgspec's nesting limit, in a free-form field
            return bad_request(None, "the request body nests objects or arrays too deeply")
        case msgspec.DecodeError():
            return bad_request(None, f"the request body is not valid JSON: {exc}")
        case InvalidInputError():
            return bad_request(_PARAM_NAMES.get(exc.field, exc.field), str(exc))
        case ValueError():
            return bad_request(None, str(exc))
        case EngineDeadError():
            return APIError(503, f"the engine is dead and cannot serve requests: {exc}",
                            type="service_unavailable", code="engine_dead")
        case EngineGenerateError():  # finish_reason "error": this request alone failed; the engine serves on
            return APIError(500, str(exc), type="internal_server_error", code="request_failed")
        case _:
            return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                            type="internal_server_error")
