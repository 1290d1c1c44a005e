"""`troupe.handoff.hand_over`: a memory-stream send without the event-loop pass when the item fits, and
`send`'s behaviour (back-pressure, errors, cancellation) otherwise."""

from __future__ import annotations

import anyio
import pytest

from troupe.handoff import hand_over


async def test_an_item_that_fits_goes_without_letting_other_tasks_run():
    send, recv = anyio.create_memory_object_stream[int](1)
    ran = []
    async with send, recv, anyio.create_task_group() as tg:
        tg.start_soon(_append, ran)  # ready to run at the next pass of the loop
        await hand_over(send, 1)
        assert ran == []  # no pass of the loop happened in hand_over
        assert recv.receive_nowait() == 1
        await anyio.lowlevel.checkpoint()
        assert ran == [True]


async def _append(out: list[bool]) -> None:
    out.append(True)


async def test_a_full_stream_waits_for_room():
    send, recv = anyio.create_memory_object_stream[int](1)
    async with send, recv, anyio.create_task_group() as tg:
        await hand_over(send, 1)
        done = anyio.Event()

        async def second() -> None:
            await hand_over(send, 2)
            done.set()

        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()  # back-pressure: the buffer is full
        assert await recv.receive() == 1
        await done.wait()
        assert await recv.receive() == 2


async def test_a_stream_nobody_reads_raises_as_send_does():
    send, recv = anyio.create_memory_object_stream[int](1)
    recv.close()
    with pytest.raises(anyio.BrokenResourceError):
        await hand_over(send, 1)
    send.close()
    with pytest.raises(anyio.ClosedResourceError):
        await hand_over(send, 1)


async def test_a_pending_cancellation_wins_over_a_broken_stream():
    send, recv = anyio.create_memory_object_stream[int](1)
    recv.close()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await hand_over(send, 1)  # send's checkpoint delivers the cancellation before the error
    assert scope.cancelled_caught
    send.close()
