"""Messages that exist only at the process boundary: the start-up handshake and the stop request.

The engine boundary's own messages (`EngineInput`, `EngineOutput` in troupe/messages.py) travel as
they are. The process adds, on the same socket:

- engine -> frontend: `EngineHello` as soon as the engine's socket is connected (before torch is
  imported), then exactly one of `EngineReady` (what the frontend needs: limits,
  model path, KV blocks) or `EngineStartupFailed` (the root cause and its traceback text);
- engine -> frontend, any time: `EngineLog`, a log line for the frontend to write (troupe.process.logs);
- frontend -> engine: `EngineStart` (the configuration), only to a headless engine (`troupe engine
  --connect`), which has none of its own: after its `EngineHello`;
- frontend -> engine: `EngineShutdown` (finish the step in flight, then exit). After
  `EngineStartupFailed` or `EngineDead` the engine waits for it before exiting, so that its last
  message is never lost to `linger=0`.

`ToEngine` and `FromEngine` are the two wire unions (msgspec tags keep the request types apart:
add / abort / utility / shutdown).
"""

from __future__ import annotations

import msgspec

from troupe.config import EngineConfig
from troupe.inputs import ModelLimits
from troupe.messages import EngineInput, EngineOutput
from troupe.process.logs import EngineLog


class EngineReady(msgspec.Struct, frozen=True, tag="ready", array_like=True):
    """The engine is ready; also what an in-process engine reports (`pid` is then this process)."""

    engine_index: int
    pid: int
    limits: ModelLimits
    model_path: str  # the resolved model folder: the frontend loads its tokenizer from there
    num_blocks: int
    block_size: int


class EngineHello(msgspec.Struct, frozen=True, tag="hello", array_like=True):
    engine_index: int
    pid: int


class EngineStartupFailed(msgspec.Struct, frozen=True, tag="startup_failed", array_like=True):
    engine_index: int
    error_type: str
    message: str
    traceback: str


class EngineStart(msgspec.Struct, frozen=True, tag="start", array_like=True):
    config: EngineConfig


class EngineShutdown(msgspec.Struct, frozen=True, tag="shutdown", array_like=True):
    pass


ToEngine = EngineInput | EngineStart | EngineShutdown
FromEngine = EngineOutput | EngineHello | EngineReady | EngineStartupFailed | EngineLog
