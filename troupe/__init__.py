"""troupe: a small, fast, honest LLM inference engine, built as an actor graph on anyio.

Public names: `LLM` (offline, blocking) and `AsyncLLM` (streaming) over the same actor graph,
`EngineArgs` / `AsyncEngineArgs` (vLLM's way to configure either), `SamplingParams`,
`StructuredOutputsParams`, `RequestOutputKind`, `RequestOutput`, `CompletionOutput`,
`Logprob`, `EngineDeadError`, `EngineStartupError`, `EngineHungError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from troupe.errors import EngineDeadError, EngineHungError, EngineStartupError, InvalidInputError
from troupe.sampling_params import RequestOutputKind, SamplingParams
from troupe.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from troupe.engine_args import AsyncEngineArgs, EngineArgs
    from troupe.facades.async_llm import AsyncLLM
    from troupe.facades.llm import LLM
    from troupe.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "AsyncEngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineDeadError",
    "EngineStartupError",
    "EngineHungError",
    "InvalidInputError",
]

_LAZY = {
    "LLM": "troupe.facades.llm",
    "AsyncLLM": "troupe.facades.async_llm",
    "EngineArgs": "troupe.engine_args",
    "AsyncEngineArgs": "troupe.engine_args",
    "RequestOutput": "troupe.outputs",
    "CompletionOutput": "troupe.outputs",
    "Logprob": "troupe.outputs",
}


def __getattr__(name: str) -> Any:
    # torch and transformers load only when an engine is first used: `import troupe` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'troupe' has no attribute {name!r}")
