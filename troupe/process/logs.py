"""Engine-process log lines travel to the frontend and are written by its logging set-up.

The child cannot know how the frontend program configured logging (its own structlog chain, stdlib
handlers writing to a file, troupe's console or JSON renderer...). So the child renders nothing: its
structlog chain ends in `ForwardToFrontend`, which turns each event into an `EngineLog` message
(level, event, fields: the child's context — `actor`, `engine`, `request_id`, `step`, ... — and the
event's own keys, made msgpack-safe) and hands it to the event loop, which sends it over the same
socket as the outputs. The frontend re-emits it through the logger `troupe.engine` (`reemit`), so
the line lands in the frontend's sink, in its format, with the child's fields (they win over the
frontend task's own context).

Lines logged before the channel is up, or when the hand-off buffer is full (a burst of trace lines),
are written to the child's stderr (inherited from the frontend) instead, never lost silently; the
count of such lines is kept.

Lines come from the event-loop thread and from the step's worker thread: the hand-off is
`loop.call_soon_threadsafe` into a bounded memory stream, read by `pump` in the engine's task group.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe import log as troupe_log

LOG_BUFFER = 1024
_SAFE = (str, int, float, bool, type(None))
_LEVEL_NUMBERS = {"trace": troupe_log.TRACE, "debug": 10, "info": 20, "warning": 30, "warn": 30,
                  "error": 40, "exception": 40, "critical": 50}
_METHODS = {"debug": "debug", "info": "info", "warning": "warning", "warn": "warning", "error": "error",
            "exception": "error", "critical": "critical"}


class EngineLog(msgspec.Struct, frozen=True, tag="log", array_like=True):
    level: str
    event: str
    fields: dict[str, Any] = {}


def _safe(value: Any) -> Any:
    if isinstance(value, _SAFE):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, _SAFE) for v in value):
        return list(value)
    return repr(value)


class ForwardToFrontend:
    """The last processor of the child's chain: event dict -> `EngineLog` -> the frontend."""

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[EngineLog] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._fallback = troupe_log.console(colors=False)
        self.written_locally = 0

    def attach(self, send: MemoryObjectSendStream[EngineLog]) -> None:
        """From the event loop: lines go to `send` from now on."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._send = send

    def detach(self) -> None:
        self._send = None

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> Any:
        event_dict.pop("timestamp", None)  # the frontend stamps the line when it writes it
        level = str(event_dict.pop("level", method_name))
        event = str(event_dict.pop("event", ""))
        msg = EngineLog(level, event, {k: _safe(v) for k, v in event_dict.items()})
        send, loop = self._send, self._loop
        if send is not None and loop is not None:
            if threading.get_ident() == self._loop_thread:
                if self._offer(send, msg):
                    raise structlog.DropEvent
            else:
                try:
                    loop.call_soon_threadsafe(self._offer_or_print, send, msg)
                    raise structlog.DropEvent
                except RuntimeError:  # the loop is closed: write it here
                    pass
        self._print(msg)
        raise structlog.DropEvent

    def _offer(self, send: MemoryObjectSendStream[EngineLog], msg: EngineLog) -> bool:
        try:
            send.send_nowait(msg)
            return True
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False

    def _offer_or_print(self, send: MemoryObjectSendStream[EngineLog], msg: EngineLog) -> None:
        if not self._offer(send, msg):
            self._print(msg)

    def _print(self, msg: EngineLog) -> None:
        self.written_locally += 1
        line = self._fallback(None, msg.level, {"event": msg.event, "level": msg.level, **msg.fields})
        print(line, file=sys.stderr, flush=True)


def configure_child_logging(level: str | None) -> ForwardToFrontend:
    """The engine process's structlog set-up: troupe's level filter and trace switch
    (`configure_logging`; `level` None: TROUPE_LOG_LEVEL, default info), then a chain that keeps the
    context and hands each event to the frontend instead of rendering it."""
    forward = ForwardToFrontend()
    troupe_log.configure_logging(level, force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            forward,
        ],
        wrapper_class=troupe_log.TroupeBoundLogger,  # troupe's levels, trace included
        logger_factory=structlog.ReturnLoggerFactory(),
        cache_logger_on_first_use=True,
    )
    return forward


def log_channel() -> tuple[MemoryObjectSendStream[EngineLog], MemoryObjectReceiveStream[EngineLog]]:
    return anyio.create_memory_object_stream[EngineLog](LOG_BUFFER)


async def pump(logs: MemoryObjectReceiveStream[EngineLog], send: Callable[[EngineLog], Any]) -> None:
    """Move forwarded lines onto the wire (`send` is the outbox's `send`)."""
    async with logs:
        async for msg in logs:
            await send(msg)


_engine_log = structlog.get_logger("troupe.engine")


def reemit(msg: EngineLog) -> None:
    """In the frontend: write a forwarded line through its own logging set-up."""
    trace = getattr(troupe_log, "trace", None)
    if msg.level == "trace" and callable(trace):
        trace(_engine_log, msg.event, **msg.fields)
        return
    getattr(_engine_log, _METHODS.get(msg.level, "info"))(msg.event, **msg.fields)
