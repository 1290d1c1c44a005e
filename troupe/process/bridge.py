"""The ZMQ bridge actor: one socket <-> a pair of memory streams, on either side of a process boundary.

Inbox:    messages to send (`S`) from a memory stream; each is encoded (troupe.process.codec) and
          sent as one multipart message. `send()` sends one message outside the pump (a goodbye).
Delivery: messages received (`R`), decoded and validated, go to the owner's `deliver` coroutine,
          awaited in arrival order before the next frame is read (its waiting is the back-pressure):
          a memory stream's `hand_over` where a task reads them (the engine-core actor), or the
          owner's own routing (the frontend's engine process side: straight to the graph). A frame
          that does not decode is logged and given to `on_bad_frame`, whose answers go back to the
          peer and/or to `deliver` (per-request errors); it never stops the bridge.
Owns:     a zmq.asyncio context and one socket. Frontend: a ROUTER bound at the address, talking
          to one engine identity (SNDHWM=0, so a message to a live engine is never dropped; one to
          an engine that is gone is dropped silently, and the process monitor reports the death).
          Engine: a DEALER connected to that address under its identity.
Peers:    with `watch_connection=True` a ZMQ socket monitor sets `connected` when the peer's
          connection is up and `disconnected` when it drops (the death signal of an engine on
          another host, and of the frontend for a headless engine). tcp:// sockets send ZMTP
          heartbeats, so a peer that vanishes without closing its connection (a host gone) is
          noticed within `HEARTBEAT_TIMEOUT_MS`. A connecting socket aimed at a free local port in
          the ephemeral range can, while it retries, be handed that same port as its source and
          connect to itself (TCP simultaneous open); the monitor checks every new connection's two
          ends and sets `looped` instead of `connected` when they are the same: the owner then
          starts over with a fresh socket (what it sent went to itself).
Shutdown: leaving the context cancels both pumps, then closes the socket (linger=0), destroys the
          context (`destroy`, never `term`, which can block) and removes a bound ipc:// socket
          file. The end of the inbox ends the send pump only.

This is the only module that imports zmq (STYLE §8). No RCVTIMEO: time limits are cancel scopes.
Cancelling a pump is safe (the socket stays usable); closing a socket under a waiting pump is not
(the waiter gets a bare CancelledError), hence the order above.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Generic, NamedTuple, TypeVar

import anyio
import structlog
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from troupe.process.codec import Buffer, FrameDecoder, FrameEncoder

log = structlog.get_logger("troupe.bridge")

S = TypeVar("S")
R = TypeVar("R")
OnBadFrame = Callable[[Buffer, Exception], tuple[list[S], list[R]]]
HWM = 64  # messages queued per direction before the sender waits (outputs are one per step)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000


class BridgeStats(NamedTuple):
    sent: int
    received: int
    bad_frames: int


def engine_identity(engine_index: int) -> bytes:
    return engine_index.to_bytes(2, "little")


class Bridge(anyio.AsyncContextManagerMixin, Generic[S, R]):
    def __init__(self, address: str, *, bind: bool, identity: bytes,
                 inbox: MemoryObjectReceiveStream[S], deliver: Callable[[R], Awaitable[None]],
                 decoder: FrameDecoder[R], on_bad_frame: OnBadFrame[S, R], watch_connection: bool = False) -> None:
        """`bind=True`: a ROUTER bound at `address` whose peer is `identity`; else a DEALER that
        connects to `address` as `identity`."""
        self._address = address
        self._bind = bind
        self._identity = identity
        self._inbox = inbox
        self._deliver = deliver
        self._decoder = decoder
        self._encoder = FrameEncoder()
        self._on_bad_frame = on_bad_frame
        self._watch = watch_connection
        self.connected = anyio.Event()
        self.disconnected = anyio.Event()
        self.looped = anyio.Event()  # a connecting socket that reached itself (see the module docstring)
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_lock = anyio.Lock()
        self._prefix = [identity] if bind else []
        self._socket: zmq.asyncio.Socket | None = None
        self.endpoint = address  # the bound endpoint, with a "*" port resolved
        self._sent = self._received = self._bad = 0

    def statistics(self) -> BridgeStats:
        return BridgeStats(self._sent, self._received, self._bad)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Bridge[S, R]]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER if self._bind else zmq.DEALER)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, HWM)
            if self._address.startswith("tcp://"):
                sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
            if self._watch:
                monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
                self._monitor = monitor
            if self._bind:
                sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops at its HWM: never for a live peer
                sock.bind(self._address)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sock.setsockopt(zmq.SNDHWM, HWM)  # a DEALER waits at its HWM: back-pressure
                sock.setsockopt(zmq.IDENTITY, self._identity)
                sock.connect(self._address)
            self._socket = sock
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_pump)
                tg.start_soon(self._recv_pump)
                if monitor is not None:
                    tg.start_soon(self._watch_peer)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()  # pumps first, socket after
        finally:
            self._socket = None
            self._monitor = None
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            ctx.destroy(linger=0)
            if self._bind and self.endpoint.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.endpoint.removeprefix("ipc://"))

    async def _watch_peer(self) -> None:
        while True:
            await self._peer_event()

    async def _peer_event(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        assert self._monitor is not None
        async with self._monitor_lock:  # the watcher, or `wait_disconnected` once it was cancelled
            message = parse_monitor_message(await self._monitor.recv_multipart())
        event = message["event"]
        if event == zmq.EVENT_CONNECTED and not self._bind and _connected_to_itself(int(message["value"])):
            log.warning("connected to itself (the address is a free local port): starting over", endpoint=self.endpoint)
            self.looped.set()
        elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            self.connected.set()
        elif event == zmq.EVENT_DISCONNECTED and self.connected.is_set():
            log.info("peer disconnected", endpoint=self.endpoint)
            self.disconnected.set()

    async def wait_disconnected(self) -> None:
        """Until the peer's connection drops (`watch_connection=True`); also works after the
        bridge's own tasks were cancelled (a graph shutting down), as long as the socket is open."""
        while not self.disconnected.is_set() and self._monitor is not None:
            await self._peer_event()

    async def send(self, msg: S) -> None:
        """Send one message now (alongside the pump; ZMQ keeps each multipart message whole)."""
        if self._socket is None:
            raise anyio.ClosedResourceError
        frames = self._encoder.encode(msg)
        await self._socket.send_multipart([*self._prefix, *frames], copy=False)
        self._sent += 1

    async def _send_pump(self) -> None:
        async with self._inbox:
            async for msg in self._inbox:
                await self.send(msg)

    async def _recv_pump(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while True:
            parts = await sock.recv_multipart(copy=False)
            if self._bind and parts[0].bytes != self._identity:  # not our engine: not ours to read
                self._bad += 1
                log.error("frame from an unknown peer dropped", peer=parts[0].bytes.hex())
                continue
            frames = [p.buffer for p in parts[len(self._prefix):]]
            try:
                msg = self._decoder.decode(frames)
            except Exception as exc:  # DecodeError, ValidationError, a bad tensor reference: the edge
                await self._reject(frames[0] if frames else b"", exc)
                continue
            self._received += 1
            try:
                await self._deliver(msg)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # nobody listens any more: shutting down

    async def _reject(self, header: Buffer, exc: Exception) -> None:
        self._bad += 1
        replies, local = self._on_bad_frame(header, exc)
        log.error("bad frame", error=str(exc), size=len(header), answered=len(replies) + len(local))
        for reply in replies:
            await self.send(reply)
        for msg in local:
            await self._deliver(msg)


def _connected_to_itself(fd: int) -> bool:
    """Whether the TCP connection on `fd` has the same address at both ends (False for other transports)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            return bool(conn.family in (socket.AF_INET, socket.AF_INET6) and conn.getsockname() == conn.getpeername())
    except OSError:
        return False
