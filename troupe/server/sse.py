"""`EventStream`: a server-sent-events response over one or more requests' output generators.

1. One pump task per source iterates its generator (closing it on the way out, which aborts the
   request in the engine) and sends `(index, output)` or `(index, error)` into a small stream.
2. A watcher task reads the ASGI `receive` channel; `http.disconnect` cancels the whole response
   at once: every pump is cancelled, every generator closed, every request aborted.
3. The response starts only once every source produced its first output, so an error found at
   submission (a prompt too long, a dead engine) is still answered with its 4xx/5xx status and
   an OpenAI error body instead of a 200 stream.
4. An error after the start becomes an SSE `data: {"error": ...}` event followed by `[DONE]`.

Everything lives in one task group inside `__call__`; nothing outlives the response. Starlette's
own `StreamingResponse` is not used because, when a disconnect cancels it while it is sending,
it leaves the body iterator suspended for the garbage collector to close.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing, suppress
from typing import Any, Protocol

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from troupe.errors import EngineDeadError, EngineGenerateError
from troupe.outputs import RequestOutput
from troupe.server.errors import to_api_error

log = structlog.get_logger("troupe.server")

DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class StreamFormatter(Protocol):
    """Turns outputs into SSE events; keeps what the tail needs (usage)."""

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]: ...

    def tail(self) -> list[bytes]: ...


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel `scope` when the client goes away (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


Item = tuple[int, RequestOutput | Exception]


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, sources: Sequence[AsyncGenerator[RequestOutput]], formatter: StreamFormatter) -> None:
        self.sources = list(sources)
        self.formatter = formatter
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        items_send, items_recv = anyio.create_memory_object_stream[Item](max(4, len(self.sources)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            async with items_send:
                for index, source in enumerate(self.sources):
                    tg.start_soon(self._pump, index, source, items_send.clone())
            try:
                await self._respond(items_recv, send)
            except OSError:  # ASGI >= 2.4 servers raise on a send to a closed connection
                pass
            tg.cancel_scope.cancel()

    @staticmethod
    async def _pump(index: int, source: AsyncGenerator[RequestOutput], out: MemoryObjectSendStream[Item]) -> None:
        async with out, aclosing(source):
            try:
                async for output in source:
                    await out.send((index, output))
            except anyio.BrokenResourceError:
                pass  # the response already ended (an error in another source)
            except Exception as exc:
                with suppress(anyio.BrokenResourceError):
                    await out.send((index, exc))

    async def _respond(self, items: MemoryObjectReceiveStream[Item], send: Send) -> None:
        pending: list[bytes] = []
        primed: set[int] = set()
        started = False

        async def body(chunks: list[bytes], more: bool = True) -> None:
            if chunks or not more:
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": more})

        async with items:
            async for index, item in items:
                if isinstance(item, Exception):
                    err = to_api_error(item)
                    if err.status >= 500 and not isinstance(item, EngineDeadError | EngineGenerateError):
                        # an unexpected failure; an engine death is logged once by the server's engine
                        # watch, a request failing in the engine by its canonical line
                        log.error("request failed", status=err.status, error=err.message, exc_info=item)
                    if not started:
                        await _send_error(send, err.status, err.body(), self.raw_headers)
                        return
                    await body([sse_event(err.body()), DONE], more=False)
                    return
                chunks = self.formatter.chunks(index, item)
                if started:
                    await body(chunks)
                    continue
                pending.extend(chunks)
                primed.add(index)
                if len(primed) == len(self.sources):
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    started = True
                    await body(pending)
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pending.extend(self.formatter.tail())
            await body(pending, more=False)
        else:
            await body(self.formatter.tail(), more=False)


async def _send_error(send: Send, status: int, payload: Any, sse_headers: list[tuple[bytes, bytes]]) -> None:
    content = msgspec.json.encode(payload)
    headers = [(k, v) for k, v in sse_headers if k not in (b"content-type", b"cache-control")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})
