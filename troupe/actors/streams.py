"""What the graph builds before its actors run: every stream of the graph (`GraphStreams`), and the
tokenizer and the structured-output backend, loaded while the engines start (`TokenizerPrefetch`). Used by
troupe.actors.graph."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.actors.input_processor import FrontendInput
from troupe.errors import EngineStartupError
from troupe.messages import EngineInput, EngineOutput
from troupe.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer
from troupe.structured import backend as structured_backend

STREAM_BUFFER = 64


class GraphStreams:
    """Every stream of the graph, bounded, created in one place; each task gets its own clone of a
    shared end. With several engines the balancer sits between: frontend -> balancer -> engine r,
    engines -> balancer -> output handler; with one, the frontend talks to the engine directly.
    Every end is closed when the graph ends (`ends`), also those an actor never got to."""

    def __init__(self, num_engines: int, ends: contextlib.ExitStack) -> None:
        self.to_engine_send, self.to_engine_recv = anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
        self.from_engine_send, self.from_engine_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        self.submit_send, self.submit_recv = anyio.create_memory_object_stream[FrontendInput](STREAM_BUFFER)
        self.per_engine = [anyio.create_memory_object_stream[EngineInput](STREAM_BUFFER)
                           for _ in range(num_engines)] if num_engines > 1 else []
        self.merged_send, self.merged_recv = anyio.create_memory_object_stream[EngineOutput](STREAM_BUFFER)
        self._ends = ends
        for end in (self.to_engine_send, self.to_engine_recv, self.from_engine_send, self.from_engine_recv,
                    self.submit_send, self.submit_recv, self.merged_send, self.merged_recv,
                    *(e for pair in self.per_engine for e in pair)):
            ends.enter_context(end)

    def clone(self, end: Any) -> Any:
        """A clone of `end`, closed with the graph if its user never closes it."""
        return self._ends.enter_context(end.clone())

    def engine_ends(self) -> list[tuple[MemoryObjectReceiveStream[EngineInput], MemoryObjectSendStream[EngineOutput]]]:
        """(inbox, outbox) of each engine side. The engines hold clones of the outbox: the stream
        towards the frontend ends when the last engine stops."""
        if self.per_engine:
            inboxes, outbox = [recv for _, recv in self.per_engine], self.merged_send
        else:
            inboxes, outbox = [self.to_engine_recv], self.from_engine_send
        pairs = [(inbox, self.clone(outbox)) for inbox in inboxes]
        outbox.close()
        return pairs


class TokenizerPrefetch:
    """Loads the tokenizer (and imports xgrammar after it) while the engine starts; `get(path)` falls back
    to loading from the folder the engine reports if the prefetch failed or resolved another folder."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._path: str | None = None
        self._model = ""
        self._tokenizer: Any = None
        self._error: Exception | None = None

    async def load(self, model: str, revision: str | None = None, tokenizer: str | None = None) -> None:
        """The tokenizer of `model` at `revision`, or the one `tokenizer` names (EngineConfig.tokenizer)."""
        self._model = tokenizer or model
        try:
            # not abandoned on cancel: a start that fails waits for this thread, so no thread of ours is
            # left importing transformers in the caller's process (a racing import there sees it half done)
            self._path, self._tokenizer = await anyio.to_thread.run_sync(_resolve_and_load, model, revision, tokenizer)
        except Exception as exc:  # the engine reports the real problem (or get() raises it again)
            self._error = exc
        finally:
            self._done.set()

    async def get(self, model_path: str | None) -> Any:
        """The tokenizer of `model_path` (None: the one `load` resolved on this host: the engines are all
        remote, whose paths are theirs, or the configuration names the tokenizer)."""
        await self._done.wait()
        if self._tokenizer is not None and model_path in (self._path, None):
            return self._tokenizer
        if model_path is None:
            raise EngineStartupError(f"the tokenizer of {self._model!r} could not be loaded on this host: {self._error}")
        return await anyio.to_thread.run_sync(_load, model_path)


def _resolve_and_load(model: str, revision: str | None, tokenizer: str | None) -> tuple[str, Any]:
    path = str(resolve_tokenizer(tokenizer) if tokenizer else resolve_model_path(model, revision))
    return path, _load(path)


def _load(path: str) -> Any:
    """The tokenizer at `path`, then xgrammar imported on the same thread (`structured.backend.preload`:
    validating a structured request needs it, and its import is not to happen on the event loop's watch)."""
    tokenizer = load_tokenizer(path)
    structured_backend.preload()
    return tokenizer
