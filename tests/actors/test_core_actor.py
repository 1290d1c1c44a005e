"""The engine-core actor on its streams, with a scripted core instead of an EngineCore (no model, no
engine process): what reaches the outbox for each inbox message, that adds and aborts are taken in
while a step runs, a request's failing add as that request's error, a failing step as `EngineDead`,
the end of the inbox as the actor's end, and `EngineShutdown` (the engine process's stop, in the
same stream) as its end after the step in flight."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from factories import add_request

from troupe.config import EngineConfig
from troupe.engine.core_actor import EngineCoreActor
from troupe.errors import InvalidInputError
from troupe.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    EngineOutput,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from troupe.process.protocol import EngineShutdown, EngineStart, ToEngine


class ScriptedCore:
    """The EngineCore methods the actor calls. Each step gives every running request one token (the
    step's number) and finishes it at its `max_tokens`; `hold_step` makes step `hold_step` wait until
    `release` is set (from the test's thread); `fail_step` makes that step raise; an add whose id is
    in `reject` raises `InvalidInputError`."""

    def __init__(self, *, hold_step: int = 0, fail_step: int = 0, reject: tuple[str, ...] = ()) -> None:
        self.running: dict[str, int] = {}  # id -> tokens still to give
        self.unreported: list[str] = []
        self.steps = 0
        self.hold_step, self.fail_step, self.reject = hold_step, fail_step, reject
        self.holding = threading.Event()
        self.release = threading.Event()
        self.threads: set[int] = set()  # every thread that called into the core

    def add_request(self, req: Any) -> None:
        self.threads.add(threading.get_ident())
        if req.request_id in self.reject:
            raise InvalidInputError("prompt", "scripted rejection")
        self.running[req.request_id] = req.max_tokens

    def abort_requests(self, ids: list[str]) -> None:
        self.threads.add(threading.get_ident())
        for rid in ids:
            if self.running.pop(rid, None) is not None:
                self.unreported.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def has_unreported_finishes(self) -> bool:
        return bool(self.unreported)

    def step(self) -> EngineCoreOutputs:
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.steps == self.hold_step:
            self.holding.set()
            self.release.wait(10)
        if self.steps == self.fail_step:
            raise RuntimeError("scripted step failure")
        outputs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            done = self.running[rid] == 0
            if done:
                del self.running[rid]
                self.unreported.append(rid)
            outputs.append(EngineCoreOutput(rid, [self.steps], FinishReason.LENGTH if done else None))
        finished, self.unreported = self.unreported, []
        return EngineCoreOutputs(outputs=outputs, finished_requests=finished)

    def reset_prefix_cache(self) -> bool:
        return True

    def get_stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running)}


class Actor:
    """The actor running on a scripted core; the test holds the inbox's send end and the outbox's
    receive end."""

    def __init__(self, core: ScriptedCore, inbox: MemoryObjectSendStream[ToEngine],
                 outbox: MemoryObjectReceiveStream[EngineOutput], actor: EngineCoreActor) -> None:
        self.core, self.inbox, self.outbox, self.actor = core, inbox, outbox, actor
        self.ended = anyio.Event()

    async def until_finished(self, *ids: str) -> dict[str, list[int]]:
        """Every token the outbox gives each of `ids` until all of them finished."""
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        left = set(ids)
        while left:
            msg = await self.outbox.receive()
            assert isinstance(msg, EngineCoreOutputs), msg
            for out in msg.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    left.discard(out.request_id)
        return tokens


@asynccontextmanager
async def running(core: ScriptedCore) -> AsyncIterator[Actor]:
    to_actor, inbox = anyio.create_memory_object_stream[ToEngine](16)
    outbox, from_actor = anyio.create_memory_object_stream[EngineOutput](16)
    actor = EngineCoreActor(core, inbox, outbox, engine_index=3)  # type: ignore[arg-type]
    handle = Actor(core, to_actor, from_actor, actor)

    async def run() -> None:
        await actor.run()
        handle.ended.set()

    with anyio.fail_after(10):
        async with to_actor, inbox, from_actor, anyio.create_task_group() as tg:
            tg.start_soon(run)
            yield handle
            core.release.set()
            tg.cancel_scope.cancel()


async def test_requests_step_until_they_finish_and_the_closed_inbox_ends_the_actor() -> None:
    """Two adds are stepped together, each until its `max_tokens`; once the inbox closes and nothing
    is left the actor returns and closes its outbox. Adds, aborts and steps all run on one thread, the
    actor's own step thread (not the event loop's, not one of a pool's), which has ended with the actor."""
    async with running(ScriptedCore()) as a:
        await a.inbox.send(add_request("a", max_tokens=2))
        await a.inbox.send(add_request("b", max_tokens=3))
        tokens = await a.until_finished("a", "b")
        assert len(tokens["a"]) == 2 and len(tokens["b"]) == 3
        [thread] = a.core.threads
        assert thread != threading.get_ident()
        assert [t.name for t in threading.enumerate() if t.ident == thread] == ["troupe-step-3"]
        await a.inbox.aclose()
        await a.ended.wait()
        with pytest.raises(anyio.EndOfStream):
            await a.outbox.receive()
        assert a.actor.statistics().steps == a.core.steps and not a.actor.failed
        assert "troupe-step-3" not in {t.name for t in threading.enumerate()}  # joined when the actor ended


async def test_adds_and_aborts_arriving_during_a_step_wait_for_the_next_one() -> None:
    """While step 1 runs in its thread the inbox is still read: an add and an abort are queued
    (`pending`), not applied, and take effect between steps."""
    core = ScriptedCore(hold_step=1)
    async with running(core) as a:
        await a.inbox.send(add_request("a", max_tokens=5))
        await anyio.to_thread.run_sync(core.holding.wait, 10)
        await a.inbox.send(add_request("b", max_tokens=1))
        await a.inbox.send(AbortRequest(["a"]))
        await wait_all_tasks_blocked()
        assert a.actor.statistics().pending == 2 and "b" not in core.running
        core.release.set()
        first = await a.outbox.receive()
        assert isinstance(first, EngineCoreOutputs) and [o.request_id for o in first.outputs] == ["a"]
        assert (await a.until_finished("b")) == {"b": [2]}
        assert "a" not in core.running and core.steps == 2
        assert len(core.threads) == 1 and threading.get_ident() not in core.threads  # the step thread alone


async def test_a_rejected_add_fails_that_request_alone() -> None:
    """An add the core rejects comes back as that request's error output (finished, with the text and
    `invalid_request` as its kind, the actor's engine index); the other request goes on."""
    async with running(ScriptedCore(reject=("bad",))) as a:
        await a.inbox.send(add_request("bad"))
        await a.inbox.send(add_request("good", max_tokens=1))
        seen: dict[str, EngineCoreOutput] = {}
        while len(seen) < 2:
            msg = await a.outbox.receive()
            assert isinstance(msg, EngineCoreOutputs)
            seen.update((o.request_id, o) for o in msg.outputs)
            assert "bad" not in seen or msg.engine_index == 3 or seen["bad"] not in msg.outputs
        bad = seen["bad"]
        assert bad.finish_reason == FinishReason.ERROR and bad.error == "prompt: scripted rejection"
        assert bad.error_kind == "invalid_request" and bad.new_token_ids == []
        assert seen["good"].finish_reason == FinishReason.LENGTH and not a.actor.failed


async def test_utility_calls_are_answered_and_an_unknown_one_fails_alone() -> None:
    """Each utility call gets its own result, tagged with the call id and engine index; an unknown
    method or one that raises is a failure of that call only."""
    async with running(ScriptedCore()) as a:
        for call in (UtilityCall(1, "echo", ["x"]), UtilityCall(2, "nope"), UtilityCall(3, "fail", ["boom"]),
                     UtilityCall(4, "get_stats")):
            await a.inbox.send(call)
        results = {}
        while len(results) < 4:
            msg = await a.outbox.receive()
            assert isinstance(msg, UtilityResult) and msg.engine_index == 3
            results[msg.call_id] = msg
        assert results[1].result == "x" and results[1].failure is None
        assert results[2].failure is not None and "no utility method 'nope'" in results[2].failure
        assert results[3].failure == "Call to fail method failed: boom"
        assert results[4].result == {"num_running": 0}


async def test_a_failing_step_is_engine_dead_and_the_actor_stops() -> None:
    """A step that raises sends `EngineDead` with the exception's text and ends the actor, which
    closes its outbox; nothing else is stepped."""
    core = ScriptedCore(fail_step=2)
    async with running(core) as a:
        await a.inbox.send(add_request("a", max_tokens=5))
        first = await a.outbox.receive()
        assert isinstance(first, EngineCoreOutputs)
        dead = await a.outbox.receive()
        assert isinstance(dead, EngineDead) and dead.engine_index == 3
        assert dead.reason == "RuntimeError: scripted step failure"
        await a.ended.wait()
        assert a.actor.failed and core.steps == 2
        with pytest.raises(anyio.EndOfStream):
            await a.outbox.receive()


async def test_shutdown_ends_the_actor_after_the_step_in_flight() -> None:
    """`EngineShutdown` in the inbox (an engine process's actor reads the bridge's stream) ends the
    actor once the step in flight is done, with its request still running and the inbox still open;
    a late `EngineStart` is dropped, and the add queued behind the shutdown is never applied."""
    core = ScriptedCore(hold_step=1)
    async with running(core) as a:
        await a.inbox.send(add_request("a", max_tokens=100))
        await anyio.to_thread.run_sync(core.holding.wait, 10)
        await a.inbox.send(EngineStart(EngineConfig(model="unused")))
        await a.inbox.send(EngineShutdown())
        await a.inbox.send(add_request("late", max_tokens=1))
        await wait_all_tasks_blocked()
        assert not a.ended.is_set()  # step 1 still runs
        core.release.set()
        await a.ended.wait()
        step = await a.outbox.receive()
        assert isinstance(step, EngineCoreOutputs) and [o.request_id for o in step.outputs] == ["a"]
        assert core.steps == 1 and core.running == {"a": 99} and not a.actor.failed
        assert a.actor.statistics().pending == 0
        with pytest.raises(anyio.EndOfStream):
            await a.outbox.receive()
