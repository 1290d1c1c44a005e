"""`Reply`: the typed one-shot answer between an actor and the task waiting for it."""

from __future__ import annotations

import anyio
import pytest

from troupe.actors.reply import Reply


async def test_the_waiter_gets_the_value_sent_once() -> None:
    """`wait()` returns the value; a second answer, value or error, is refused and changes nothing."""
    reply = Reply[int]()
    assert reply.pending
    async with anyio.create_task_group() as tg:
        got: list[int] = []

        async def waiter() -> None:
            got.append(await reply.wait())

        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        assert reply.send(7) is True
    assert got == [7] and not reply.pending
    assert reply.send(8) is False and reply.fail(RuntimeError("late")) is False
    assert await reply.wait() == 7


async def test_a_failure_is_raised_to_the_waiter() -> None:
    """`fail(exc)` makes `wait()` raise that exception; a later value is refused."""
    reply = Reply[str]()
    assert reply.fail(ValueError("prompt: empty")) is True
    assert reply.send("stream") is False
    with pytest.raises(ValueError, match="prompt: empty"):
        await reply.wait()
    assert reply.abandon() is None  # nothing to undo


@pytest.mark.parametrize("answered_first", [False, True], ids=["before-answer", "after-answer"])
async def test_an_abandoned_reply_refuses_answers_and_hands_back_what_to_undo(answered_first: bool) -> None:
    """A waiter that goes away before the answer makes the actor's answer fail (it drops the work);
    after the answer, abandoning returns the value so the waiter can undo it."""
    reply = Reply[str]()
    if answered_first:
        assert reply.send("registered") is True
        assert reply.abandon() == "registered"
    else:
        assert reply.abandon() is None
        assert reply.abandoned and not reply.pending
        assert reply.send("registered") is False
