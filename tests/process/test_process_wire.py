"""The process boundary's wire: one frame per message, bad frames answered per request, the ZMQ bridges
(in one process, no engine), and the engine process client against bad frames and over tcp://."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from troupe import AsyncLLM, SamplingParams
from troupe.config import EngineConfig
from troupe.engine_side.engine_process import EngineProcess
from troupe.errors import EngineStartupError, InvalidInputError
from troupe.inputs import ModelLimits
from troupe.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    EngineInput,
    EngineOutput,
    FinishReason,
    UtilityCall,
    UtilityResult,
)
from troupe.pooling import PoolerConfig, PoolingParams
from troupe.process.bridge import Bridge, engine_identity
from troupe.process.codec import FrameDecoder, FrameEncoder, reject_input, reject_output
from troupe.process.protocol import EngineReady, EngineShutdown, FromEngine, ToEngine

GOOD = AddRequest("good", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 3)
BAD_ADD = AddRequest("bad", ["not", "ints"], SamplingParams(), 4)  # type: ignore[list-item]  # encodes, fails validation
BAD_CALL = UtilityCall(7, 123)  # type: ignore[arg-type]  # method must be a str


def test_a_message_is_one_frame_of_plain_data() -> None:
    """Every wire message is one msgpack frame; a tensor cannot be sent (nothing carries one), and a
    message of several frames does not decode."""
    assert len(FrameEncoder().encode(GOOD)) == 1
    with pytest.raises(TypeError):
        FrameEncoder().encode(UtilityResult(1, result=torch.zeros(2)))
    frame = FrameEncoder().encode(GOOD)[0]
    with pytest.raises(msgspec.DecodeError, match="one frame, got 2"):
        FrameDecoder(ToEngine).decode([frame, frame])


def test_every_message_round_trips() -> None:
    """Each wire message decodes to an equal message through the typed union decoders."""
    pooling = AddRequest("p", [1, 2], SamplingParams(max_tokens=1), 1,
                         pooling_params=PoolingParams(dimensions=8, normalize=False, truncate_prompt_tokens=2))
    to_engine: list[Any] = [GOOD, pooling, AbortRequest(["a", "b"]), UtilityCall(3, "get_stats", [1, "x"]),
                            EngineShutdown()]
    from_engine: list[Any] = [
        EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5, 6], FinishReason.LENGTH)], finished_requests=["r"]),
        EngineCoreOutputs(outputs=[EngineCoreOutput("e", [], FinishReason.ERROR, error="masked",
                                                    error_kind="invalid_request")], finished_requests=["e"]),
        EngineCoreOutputs(outputs=[EngineCoreOutput("p", [], FinishReason.STOP, pooled=[0.25, -1.5])],
                          finished_requests=["p"]),
        UtilityResult(3, result={"num_running": 0}), EngineDead("boom"),
    ]
    enc = FrameEncoder()
    for msgs, union in ((to_engine, ToEngine), (from_engine, FromEngine)):
        dec: FrameDecoder[Any] = FrameDecoder(union)
        for msg in msgs:
            back = dec.decode(enc.encode(msg))
            assert back == msg or (isinstance(msg, EngineCoreOutputs) and back.outputs == msg.outputs)
    limits = ModelLimits(100, 64, (2,), pooler=PoolerConfig(pooling_type="MEAN", hidden_size=8, matryoshka=True))
    ready = EngineReady(engine_index=0, pid=1, limits=limits, model_path="m", num_blocks=4, block_size=16)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=EngineReady) == ready  # the pooler reaches the frontend


def test_bad_frames_become_per_request_errors() -> None:
    """An undecodable add / utility call is answered for that request; garbage is only dropped."""
    dec: FrameDecoder[Any] = FrameDecoder(ToEngine)
    enc = FrameEncoder()
    for msg in (BAD_ADD, BAD_CALL):
        header = enc.encode(msg)[0]
        with pytest.raises(msgspec.ValidationError) as err:
            dec.decode([header])
        replies, local = reject_input(header, err.value)
        assert local == [] and len(replies) == 1
        reply = replies[0]
        if isinstance(reply, EngineCoreOutputs):
            assert reply.outputs[0].request_id == "bad" and reply.outputs[0].finish_reason == FinishReason.ERROR
            assert reply.outputs[0].error_kind == "internal"
            assert reply.finished_requests == ["bad"]
        else:
            assert isinstance(reply, UtilityResult) and reply.call_id == 7
            assert reply.failure is not None and reply.failure.startswith("Call to ? method failed: bad frame")
    assert reject_input(b"\xc1garbage", ValueError("x")) == ([], [])
    outputs = enc.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [1]), EngineCoreOutput("r2", [2])]))[0]
    replies, local = reject_output(outputs, ValueError("corrupt"))
    assert replies == [AbortRequest(["r1", "r2"])]
    assert [o.request_id for o in local[0].outputs] == ["r1", "r2"]  # type: ignore[union-attr]


async def test_bridges_carry_messages_and_answer_bad_frames(tmp_path: Path) -> None:
    """A ROUTER bridge and a DEALER bridge in one process: messages cross both ways in order, a bad
    add is answered with that request's error, and the bound socket file is gone after close."""
    address = f"ipc://{tmp_path}/e0"
    f_in_send, f_in_recv = anyio.create_memory_object_stream[ToEngine](8)
    f_out_send, f_out_recv = anyio.create_memory_object_stream[FromEngine](8)
    e_in_send, e_in_recv = anyio.create_memory_object_stream[FromEngine](8)
    e_out_send, e_out_recv = anyio.create_memory_object_stream[ToEngine](8)
    frontend = Bridge(address, bind=True, identity=engine_identity(0), inbox=f_in_recv, deliver=f_out_send.send,
                      decoder=FrameDecoder(FromEngine), on_bad_frame=reject_output)
    engine = Bridge(address, bind=False, identity=engine_identity(0), inbox=e_in_recv, deliver=e_out_send.send,
                    decoder=FrameDecoder(ToEngine), on_bad_frame=reject_input)
    with anyio.fail_after(10):
        async with frontend, engine, f_in_send, f_out_send, f_out_recv, e_in_send, e_out_send, e_out_recv:
            assert os.listdir(tmp_path) == ["e0"]
            await e_in_send.send(EngineDead("hello first"))  # the engine speaks first: the ROUTER learns it
            assert await f_out_recv.receive() == EngineDead("hello first")
            for msg in (GOOD, BAD_ADD, AbortRequest(["good"])):
                await f_in_send.send(msg)
            assert await e_out_recv.receive() == GOOD
            answer = await f_out_recv.receive()  # the engine bridge answered the bad add itself
            assert isinstance(answer, EngineCoreOutputs) and answer.outputs[0].request_id == "bad"
            assert await e_out_recv.receive() == AbortRequest(["good"])
            assert engine.statistics().bad_frames == 1
    assert os.listdir(tmp_path) == []


async def test_a_connection_to_itself_is_noticed() -> None:
    """A connecting bridge whose TCP connection has itself at the other end (what a socket retrying a free
    local port can get: here forced with ZMQ's `source;destination` address) sets `looped`, never
    `connected`; a normal connection to a listening bridge sets `connected` and not `looped`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def dealer(address: str) -> tuple[Bridge[FromEngine, ToEngine], Any]:
        out_send, out_recv = anyio.create_memory_object_stream[ToEngine](8)
        in_send, in_recv = anyio.create_memory_object_stream[FromEngine](8)
        bridge = Bridge(address, bind=False, identity=engine_identity(0), inbox=in_recv, deliver=out_send.send,
                        decoder=FrameDecoder(ToEngine), on_bad_frame=reject_input, watch_connection=True)
        return bridge, (out_send, out_recv, in_send, in_recv)

    looped, streams = dealer(f"tcp://127.0.0.1:{port};127.0.0.1:{port}")
    with anyio.fail_after(10):
        async with looped:
            await looped.looped.wait()
            assert not looped.connected.is_set()
    for stream in streams:
        stream.close()
    f_in_send, f_in_recv = anyio.create_memory_object_stream[ToEngine](8)
    f_out_send, f_out_recv = anyio.create_memory_object_stream[FromEngine](8)
    frontend = Bridge(f"tcp://127.0.0.1:{port}", bind=True, identity=engine_identity(0), inbox=f_in_recv,
                      deliver=f_out_send.send, decoder=FrameDecoder(FromEngine), on_bad_frame=reject_output)
    normal, streams = dealer(f"tcp://127.0.0.1:{port}")
    with anyio.fail_after(10):
        async with frontend, normal, f_in_send, f_out_send, f_out_recv:
            await normal.connected.wait()
            assert not normal.looped.is_set()
    for stream in streams:
        stream.close()


@pytest.mark.slow
async def test_engine_process_answers_bad_frames_over_tcp(tiny_llama: Path, check_leftovers: Any) -> None:
    """Over tcp:// (any free port): a bad add and a bad utility call each get their own error from the
    engine process, which keeps serving: a good request right after finishes."""
    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                          engine_address="tcp://127.0.0.1:*")
    to_send, to_recv = anyio.create_memory_object_stream[EngineInput](8)
    from_send, from_recv = anyio.create_memory_object_stream[EngineOutput](8)
    engine = EngineProcess(config, to_recv, from_send)
    with anyio.fail_after(120):
        async with to_send, from_recv, anyio.create_task_group() as tg:
            await tg.start(engine.run)
            pids = engine.pids
            for msg in (BAD_ADD, BAD_CALL, GOOD):
                await to_send.send(msg)
            errors, tokens, failures = [], [], []
            async for out in from_recv:
                if isinstance(out, UtilityResult):
                    failures.append(out.failure)
                    continue
                assert isinstance(out, EngineCoreOutputs)
                for o in out.outputs:
                    (errors if o.error else tokens).extend([o.request_id] if o.error else o.new_token_ids)
                if len(tokens) == 3 and failures:
                    break
            assert errors == ["bad"] and len(failures) == 1 and "bad frame" in str(failures[0])
            tg.cancel_scope.cancel()
    check_leftovers(pids)


async def test_make_core_must_be_picklable_for_an_engine_process(tiny_llama: Path) -> None:
    """A closure cannot reach an engine process: a ValueError says so before anything starts."""
    with pytest.raises(ValueError, match="make_core: .* cannot be sent to the engine process"):
        async with AsyncLLM(str(tiny_llama), make_core=lambda config: None):  # type: ignore[arg-type,return-value]
            pass


@pytest.mark.parametrize(("options", "field"), [
    ({"engine_address": "http://x"}, "engine_address"),
    ({"engine_ready_timeout_s": 0}, "engine_ready_timeout_s"),
    ({"engine_hang_timeout_s": -1}, "engine_hang_timeout_s"),
])
def test_process_options_are_validated(options: dict[str, Any], field: str) -> None:
    """Bad process options name the option."""
    with pytest.raises(InvalidInputError, match=field):
        EngineConfig(**options)


async def test_an_address_in_use_is_a_startup_error(tiny_llama: Path) -> None:
    """The frontend cannot bind its engine address: EngineStartupError naming the cause, nothing spawned."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with anyio.fail_after(60), pytest.raises(EngineStartupError, match="Address already in use"):
            async with AsyncLLM(str(tiny_llama), engine_address=f"tcp://127.0.0.1:{port}"):
                pass
