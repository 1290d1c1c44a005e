"""The HTTP edge: uvicorn's h11 protocol with troupe's rules for connections that misbehave.

`troupe serve` hands uvicorn `edge_protocol(header_timeout)` as its HTTP protocol class:

- **Header deadline.** A request's head (request line and headers) must arrive whole within
  `header_timeout` seconds of the connection, or of the previous response on a kept-alive one;
  otherwise the connection is closed. A client trickling header bytes holds a socket for that long
  and no longer (uvicorn's keep-alive timer restarts on every byte, so it cannot bound this).
- **OpenAI error bodies for the protocol's own 400s.** A request h11 refuses before the app sees
  it (a NUL or a newline in a header value, a malformed request line) gets a 400 with
  `{"error": {...}}`, like every other 4xx, instead of uvicorn's text/plain.

The other edge bounds are uvicorn's own settings, passed by the launcher: `--limit-concurrency`
(connections; past it a 503), `--timeout-keep-alive` (an idle kept-alive connection). The body's
read deadline is the app's (`serving.read_body`, `--body-timeout`): a 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from troupe.server.errors import bad_request


class EdgeProtocol(H11Protocol):
    """See the module docstring; `header_timeout` is set by `edge_protocol`."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

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


def edge_protocol(header_timeout: float) -> type[EdgeProtocol]:
    """`EdgeProtocol` with this header deadline (uvicorn instantiates the class per connection)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"header_timeout": header_timeout})
