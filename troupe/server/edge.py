"""The HTTP edge: uvicorn's h11 protocol with troupe's rules for connections that misbehave.

`troupe serve` hands uvicorn `edge_protocol(header_timeout)` as its HTTP protocol class:

- **Header deadline.** A request's head (request line and headers) must arrive whole within
  `header_timeout` seconds of the connection, or of the previous response on a kept-alive one;
  otherwise the connection is closed. A client trickling header bytes holds a socket for that long
  and no longer (uvicorn's keep-alive timer restarts on every byte, so it cannot bound this).
- **OpenAI error bodies for the protocol's own 400s.** A request h11 refuses before the app sees
  it (a NUL or a newline in a header value, a malformed request line) gets a 400 with
  `{"error": {...}}`, like every other 4xx, instead of uvicorn's text/plain.

- **A connection limit with an OpenAI 503.** With `limit_concurrency` (`--limit-concurrency`), a
  request that arrives while more connections are open, or more requests in flight, than the limit
  gets a 503 `service_unavailable` body and the connection closes; uvicorn's own check (not used)
  answers text/plain.

`--timeout-keep-alive` (an idle kept-alive connection) is uvicorn's own setting. The body's read
deadline is the app's (`serving.read_body`, `--body-timeout`): a 408.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from troupe.server.errors import APIError, bad_request

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
_OVER_LIMIT = msgspec.json.encode(APIError(503, "the server is at its connection limit (--limit-concurrency); retry "
                                           "later", type="service_unavailable").body())


class EdgeProtocol(H11Protocol):
    """See the module docstring; `header_timeout` and `limit_concurrency` are set by `edge_protocol`."""

    header_timeout = 10.0
    max_concurrency: int | None = None
    _header_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.max_concurrency is not None:
            self.app = self._limited(self.app)

    def _limited(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the connection limit: this request's own connection and task are counted."""
        limit = self.max_concurrency
        assert limit is not None

        async def limited(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                          send: Callable[[Any], Awaitable[None]]) -> None:
            if scope["type"] == "http" and (len(self.connections) > limit or len(self.tasks) > limit):
                self.logger.warning("refusing a request past the connection limit (%s)", limit)
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(_OVER_LIMIT)).encode())]})
                await send({"type": "http.response.body", "body": _OVER_LIMIT})
                return
            await app(scope, receive, send)

        return limited

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the head has arrived: the app (and its body deadline) has the request

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head, on this kept-alive connection

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %s s", self.header_timeout)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = msgspec.json.encode(bad_request(None, f"the HTTP request is malformed: {msg} (a header value with a NUL, CR or LF, "
                                               "or a bad request line)").body())
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # a response had already started: nothing more can be said on this connection
        self.transport.close()


def edge_protocol(header_timeout: float, limit_concurrency: int | None = None) -> type[EdgeProtocol]:
    """`EdgeProtocol` with this header deadline and connection limit (uvicorn instantiates the class per
    connection)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"header_timeout": header_timeout,
                                                  "max_concurrency": limit_concurrency})
