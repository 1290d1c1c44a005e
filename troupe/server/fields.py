"""Request fields the server does not know, and fields it knows but cannot honour.

- `unknown_fields(body, kind)`: the JSON paths (`foo`, `messages[0].bar`) of keys in a body that the
  request Struct `kind` does not declare, at any depth the Struct describes. The server serves such a
  request and ignores them, as vLLM's server does, with one warning naming them (`warn_ignored`:
  logged once per distinct set of names, later repeats at debug level, so a client that always sends
  the same extra field does not flood the log).
- `reject_unsupported(req)`: a 400 naming the first field troupe declares but cannot honour, when it
  is set to anything but its neutral value (`UNSUPPORTED`): such a request would otherwise get an
  answer that silently differs from what it asked for. Every request field of vLLM's server is
  declared, so none of them is ever ignored: each is honoured or, when not neutral, refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from troupe.server.errors import bad_request

log = structlog.get_logger("troupe.server")
_warned: set[tuple[str, ...]] = set()
_WARNED_MAX = 1024  # sets of names remembered; past that the memory starts over (clients choose the names)


@functools.cache
def _info(kind: type) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(kind)


def unknown_fields(body: bytes, kind: type) -> list[str]:
    """The undeclared keys of an already valid body (see the module docstring)."""
    found: list[str] = []
    _walk(msgspec.json.decode(body), _info(kind), "", found)
    return found


def _walk(value: Any, t: msgspec.inspect.Type, path: str, found: list[str]) -> None:
    if isinstance(t, msgspec.inspect.StructType) and isinstance(value, dict):
        declared = {f.encode_name: f.type for f in t.fields}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in declared:
                found.append(where)
            else:
                _walk(item, declared[key], where, found)
    elif isinstance(t, msgspec.inspect.ListType) and isinstance(value, list):
        if not _holds_struct(t.item_type):  # token ids, prompts: no key to find, and a million of them
            return
        for i, item in enumerate(value):
            _walk(item, t.item_type, f"{path}[{i}]", found)
    elif isinstance(t, msgspec.inspect.UnionType):
        for member in t.types:
            if isinstance(member, msgspec.inspect.StructType) and isinstance(value, dict) or \
                    isinstance(member, msgspec.inspect.ListType) and isinstance(value, list):
                _walk(value, member, path, found)
                return


def _holds_struct(t: msgspec.inspect.Type) -> bool:
    """Whether a value of type `t` can hold a Struct (an object with declared keys)."""
    if isinstance(t, msgspec.inspect.StructType):
        return True
    if isinstance(t, msgspec.inspect.ListType):
        return _holds_struct(t.item_type)
    if isinstance(t, msgspec.inspect.UnionType):
        return any(_holds_struct(m) for m in t.types)
    return False


def warn_ignored(fields: list[str], request_id: str) -> None:
    key = tuple(sorted(fields))
    if key in _warned:
        log.debug("request fields ignored", fields=list(key), request_id=request_id)
        return
    if len(_warned) >= _WARNED_MAX:
        _warned.clear()
    _warned.add(key)
    log.warning("request fields ignored: troupe does not know them", fields=list(key), request_id=request_id)


def _none(v: Any) -> bool:
    return v is None


def _none_or_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _false(v: Any) -> bool:
    return v is None or v is False


# field -> is its value neutral (what the request gets anyway)?
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or v == 1,
    "suffix": _none,
    "use_beam_search": _false,
    "length_penalty": lambda v: v is None or v == 1.0,
    "logprob_token_ids": _none,
    "prompt_embeds": _none,
    "cache_salt": _none,
    "kv_transfer_params": _none,
    "ec_transfer_params": _none,
    "vllm_xargs": _none_or_empty,
    "repetition_detection": _none,
    "thinking_token_budget": lambda v: v is None or v == -1,
    "stream_interval": lambda v: v is None or v == 1,
    "watermarking": _false,
    "routed_experts_prompt_start": lambda v: v is None or v == 0,
    "truncation_side": _none,
    "functions": _none_or_empty,
    "function_call": lambda v: v is None or v == "none",
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _none,
    "prediction": _none,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "guided_decoding_backend": lambda v: v in (None, "auto", "xgrammar"),
    "logits_processors": _none_or_empty,
    "mm_processor_kwargs": _none_or_empty,
    "media_io_kwargs": _none_or_empty,
}


def reject_unsupported(req: msgspec.Struct) -> None:
    """A 400 naming the first declared field set to a value troupe cannot honour (see above)."""
    for field, neutral in UNSUPPORTED.items():
        if field in req.__struct_fields__:
            value = getattr(req, field)
            if not neutral(value):
                raise bad_request(field, f"`{field}` is not supported by troupe (got {value!r}); leave it unset")
