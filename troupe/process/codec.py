"""msgpack frames for the ZMQ bridges, and what to answer when a frame does not decode.

A message travels as one multipart ZMQ message: frame 0 is the msgspec msgpack of the message; a
torch tensor anywhere in it is written as `[dtype, shape, data]`, where `data` is the tensor's
bytes inline when it is smaller than `INLINE_BYTES`, else the index of an extra frame that holds a
uint8 view of the tensor's memory (sent with `copy=False`: no copy on the way out). On receipt
`torch.frombuffer` views the frame (no copy either): such a tensor is read-only and aliases the
frame, so `.clone()` it before writing. No message carries tensors yet (logprobs will).

`FrameDecoder(T).decode(frames)` is typed and validated; a bad frame raises `msgspec.DecodeError`
(`ValidationError` is a subclass) or `ValueError` (a bad tensor reference). `reject_input` / `reject_output` then turn the frame, read
untyped, into per-request errors where it can be tied to requests (the engine stays up).
"""

from __future__ import annotations

import sys
import warnings
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
INLINE_BYTES = 256  # smaller tensors go inline: an extra frame costs more than the copy
Buffer = bytes | memoryview


class FrameEncoder:
    """`encode(msg) -> [header, *tensor frames]`. Not thread-safe (one per sending task)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Buffer] = []

    def encode(self, msg: Any) -> list[Buffer]:
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(msg)
            return self._frames
        finally:
            self._frames = []

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # no torch imported: no tensor can exist
        if torch is not None and isinstance(obj, torch.Tensor):
            flat = obj.detach().contiguous().reshape(-1)
            raw = memoryview(flat.view(torch.uint8).numpy()).cast("B")  # (nbytes,) aliasing the tensor
            dtype = str(obj.dtype).removeprefix("torch.")
            if raw.nbytes < INLINE_BYTES:
                return [dtype, list(obj.shape), raw.tobytes()]
            self._frames.append(raw)
            return [dtype, list(obj.shape), len(self._frames) - 1]
        raise NotImplementedError(f"cannot send a {type(obj).__name__} across the process boundary")


class FrameDecoder(Generic[T]):
    """Typed decoder for `[header, *tensor frames]`. Not thread-safe (one per receiving task)."""

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_, dec_hook=self._dec_hook)
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Sequence[Buffer]) -> T:
        if not frames:
            raise msgspec.DecodeError("empty message")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is object:  # msgspec asks for `object` fields (UtilityResult.result): as decoded
            return obj
        import torch

        if type_ is not torch.Tensor:
            raise NotImplementedError(f"no decoder for {type_!r}")
        try:
            dtype_name, shape, data = obj
            dtype = getattr(torch, dtype_name)
            buf = self._frames[data] if isinstance(data, int) else bytearray(data)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"bad tensor reference {obj!r}: {exc}") from exc
        if memoryview(buf).nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # a zmq frame is read-only: torch warns, the docstring says so
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)


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
        out = EngineCoreOutput(key, [], FinishReason.ERROR, error=f"bad add request frame: {error}")
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
        errors = [EngineCoreOutput(rid, [], FinishReason.ERROR, error=f"bad engine output frame: {error}")
                  for rid in ids]
        return [AbortRequest(ids)], [EngineCoreOutputs(engine_index=index, outputs=errors, finished_requests=ids)]
    if tag == "utility_result" and len(raw) > 1 and isinstance(raw[1], int):
        return [], [UtilityResult(raw[1], failure=f"bad utility result frame: {error}")]
    if tag == "dead":
        return [], [EngineDead(reason=f"engine reported its death in a frame that does not decode: {error}")]
    return [], []
