"""msgpack frames for the ZMQ bridges, and what to answer when a frame does not decode.

A message travels as one ZMQ frame: the msgspec msgpack of the message (every message is plain data:
ints, floats, strings, lists; nothing carries tensors). The encoder and decoder keep the list-of-frames
shape of a multipart message, so the bridges send and receive exactly what a socket carries.

`FrameDecoder(T).decode(frames)` is typed and validated; a bad frame raises `msgspec.DecodeError`
(`ValidationError` is a subclass). `reject_input` / `reject_output` then turn the frame, read
untyped, into per-request errors where it can be tied to requests (the engine stays up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from troupe.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    FinishReason,
    UtilityResult,
)
from troupe.process.protocol import FromEngine, ToEngine

T = TypeVar("T")
Buffer = bytes | memoryview


class FrameEncoder:
    """`encode(msg) -> [frame]`. Not thread-safe (one per sending task)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> list[Buffer]:
        return [self._encoder.encode(msg)]


class FrameDecoder(Generic[T]):
    """Typed decoder for a message's frames. Not thread-safe (one per receiving task)."""

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    def decode(self, frames: Sequence[Buffer]) -> T:
        if len(frames) != 1:
            raise msgspec.DecodeError(f"a message is one frame, got {len(frames)}")
        return self._decoder.decode(frames[0])


def _untyped(header: Buffer) -> Any:
    try:
        return msgspec.msgpack.decode(header)
    except msgspec.DecodeError:
        return None


def reject_input(header: Buffer, error: Exception) -> tuple[list[FromEngine], list[ToEngine]]:
    """Engine side: a frontend frame that does not decode -> (replies to the frontend, nothing local).

    An add becomes that request's error output; a utility call becomes its failure; anything else
    (an abort, garbage) has no one to answer and is only logged by the bridge.
    """
    raw = _untyped(header)
    if not isinstance(raw, list) or len(raw) < 2:
        return [], []
    tag, key = raw[0], raw[1]
    if tag == "add" and isinstance(key, str):
        out = EngineCoreOutput(key, [], FinishReason.ERROR, error=f"bad add request frame: {error}",
                               error_kind="internal")
        return [EngineCoreOutputs(outputs=[out], finished_requests=[key])], []
    if tag == "utility" and isinstance(key, int):
        method = raw[2] if len(raw) > 2 and isinstance(raw[2], str) else "?"
        return [UtilityResult(key, failure=f"Call to {method} method failed: bad frame: {error}")], []
    return [], []


def reject_output(header: Buffer, error: Exception) -> tuple[list[ToEngine], list[FromEngine]]:
    """Frontend side: an engine frame that does not decode -> (replies to the engine, local messages).

    The requests of an outputs frame each get an error output here and an abort in the engine; a
    utility result becomes a failure of that call; an unreadable `EngineDead` is still a death.
    """
    raw = _untyped(header)
    if not isinstance(raw, list) or not raw:
        return [], []
    tag = raw[0]
    index = raw[1] if len(raw) > 1 and isinstance(raw[1], int) else 0
    if tag == "outputs":
        entries = raw[2] if len(raw) > 2 and isinstance(raw[2], list) else []
        ids = [e[0] for e in entries if isinstance(e, list) and e and isinstance(e[0], str)]
        if not ids:
            return [], []
        errors = [EngineCoreOutput(rid, [], FinishReason.ERROR, error=f"bad engine output frame: {error}",
                                  error_kind="internal")
                  for rid in ids]
        return [AbortRequest(ids)], [EngineCoreOutputs(engine_index=index, outputs=errors, finished_requests=ids)]
    if tag == "utility_result" and len(raw) > 1 and isinstance(raw[1], int):
        return [], [UtilityResult(raw[1], failure=f"bad utility result frame: {error}")]
    if tag == "dead":
        return [], [EngineDead(reason=f"engine reported its death in a frame that does not decode: {error}")]
    return [], []
