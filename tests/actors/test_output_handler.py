"""The output handler actor processes big steps in slices and keeps the event loop responsive."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
from factories import add_request

from troupe.actors.engine_stats import EngineStats
from troupe.actors.output_handler import OutputHandler
from troupe.actors.requests import RequestTable
from troupe.messages import (
    AbortRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineInput,
    EngineOutput,
)
from troupe.sampling_params import RequestOutputKind


def add(table: RequestTable, i: int, **kw: Any) -> Any:
    stream, _ = table.register(add_request(f"r{i}", external_id=f"u{i}", output_kind=RequestOutputKind.DELTA, **kw),
                               None)
    return stream


async def test_a_10000_entry_step_is_processed_in_slices_while_others_run(tokenizer: Any) -> None:
    """One outputs message with 10,000 entries: another task gets scheduled between the slices."""
    table = RequestTable(tokenizer)
    streams = [add(table, i) for i in range(10_000)]
    out_send, out_recv = anyio.create_memory_object_stream[EngineOutput](4)
    eng_send, eng_recv = anyio.create_memory_object_stream[EngineInput](4)
    handler = OutputHandler(table, EngineStats(), out_recv, eng_send, chunk_size=128)
    ticks_during: list[int] = []
    ticks = 0
    stop = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.lowlevel.checkpoint()

    token = tokenizer.encode("hello", add_special_tokens=False)[0]
    msg = EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [token]) for i in range(10_000)])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, eng_recv:
            tg.start_soon(handler.run)
            tg.start_soon(ticker)
            before = ticks
            await out_send.send(msg)
            while handler.statistics().entries_processed < 10_000:
                await anyio.lowlevel.checkpoint()
            ticks_during.append(ticks - before)
            stop.set()
            await out_send.aclose()
    stats = handler.statistics()
    assert stats.slices == 79  # ceil(10000 / 128)
    # the ticker ran between (nearly) every pair of slices, not only before and after
    assert ticks_during[0] >= 70
    assert all(s.get_nowait() is not None for s in streams)


async def test_stop_string_hit_sends_an_abort_to_the_engine(tokenizer: Any) -> None:
    """A request finishing on a stop string is aborted in the engine, which does not know stop strings."""
    table = RequestTable(tokenizer)
    stream = add(table, 0, stop="lo")
    out_send, out_recv = anyio.create_memory_object_stream[EngineOutput](4)
    eng_send, eng_recv = anyio.create_memory_object_stream[EngineInput](4)
    handler = OutputHandler(table, EngineStats(), out_recv, eng_send)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, eng_recv:
            tg.start_soon(handler.run)
            await out_send.send(EngineCoreOutputs(outputs=[EngineCoreOutput("r0", ids)]))
            abort = await eng_recv.receive()
            await out_send.aclose()
    assert abort == AbortRequest(["r0"])
    final = await stream.get()
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "lo"
    assert table.num_unfinished == 0
