"""`hand_over`: put an item on a bounded memory stream without a checkpoint when the stream has room.

`MemoryObjectSendStream.send` always yields to the event loop first (a checkpoint), even when the
item fits at once. On the per-step path (engine outputs: engine actor -> bridge on one side, bridge ->
relay -> output handler on the other) each such yield is one more pass of the event loop per token,
and on a 2-core machine whose cores both compute those passes are taken from a compute thread. `hand_over` gives the item to a waiting receiver or the buffer
directly, and only waits (with `send`) when the buffer is full: back-pressure is unchanged, and the
receiver still runs at the sender's next await. A closed or broken stream goes through `send` as well,
so the errors and their timing against cancellation are `send`'s.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectSendStream

T = TypeVar("T")


async def hand_over(stream: MemoryObjectSendStream[T], item: T) -> None:
    """`stream.send(item)`, without the yield when the item fits now."""
    try:
        stream.send_nowait(item)
    except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
        # full: wait for room; gone: `send` checkpoints first, so a cancellation already pending (a graph
        # shutting down after the receiver crashed) wins over the error, as it always did
        await stream.send(item)
