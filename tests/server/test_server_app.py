"""The server app in-process, on a scripted fake engine (httpx.ASGITransport, or raw ASGI calls).

These pin what a subprocess cannot show deterministically: the status of each engine failure,
an error in the middle of a stream, and that a client disconnect closes the engine's generator
(which is what aborts the request in `AsyncLLM`).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from server_fakes import FakeEngine, delta, make_app, serving
from starlette.applications import Starlette
from starlette.types import Message

from troupe.errors import EngineDeadError
from troupe.server.chat import ChatCompletionRequest
from troupe.server.errors import to_api_error
from troupe.server.fields import reject_unsupported
from troupe.server.protocol import CompletionRequest

SCRIPT = [delta("Hel", 5), delta("lo", 6), delta("!", 7, "length")]


async def test_streaming_and_final_bodies_from_the_same_outputs() -> None:
    """Deltas become SSE chunks (usage last, then [DONE]); the final body carries the whole text."""
    async with serving(FakeEngine(SCRIPT)) as client:
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
        resp = await client.post("/v1/completions", json=body)
        events = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello!"
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    async with serving(FakeEngine([delta("Hello!", 7, "length")])) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}


async def test_dead_engine_is_503_everywhere() -> None:
    """With the engine dead, /health and every generation endpoint answer 503 (OpenAI error body)."""
    async with serving(FakeEngine(SCRIPT, dead=True)) as client:
        assert (await client.get("/health")).status_code == 503
        for path, body in [("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/completions", {"prompt": "x", "stream": True})]:
            resp = await client.post(path, json=body)
            assert resp.status_code == 503
            assert resp.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize(("error", "status"), [
    (EngineDeadError("died mid-request"), 503),
    (ValueError("prompt: too long"), 400),
    (RuntimeError("boom"), 500),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_error_before_the_first_output_keeps_its_status(error: Exception, status: int,
                                                                  stream: bool) -> None:
    """An engine error raised at submission is the response status, streamed or not; such a
    rejected request is not counted as a finished one."""
    async with serving(FakeEngine([error])) as client:
        resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert resp.status_code == status
        assert resp.json()["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert "vllm:request_success_total" in metrics
        assert all(line.endswith(" 0.0") for line in metrics.splitlines()
                   if line.startswith("vllm:request_success_total"))


async def test_an_error_mid_stream_is_an_sse_error_event() -> None:
    """After the stream started, an error becomes a `data: {"error": ...}` event and `[DONE]`."""
    engine = FakeEngine([delta("Hel", 5), EngineDeadError("died")])
    async with serving(engine) as client:
        resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.text.split("\n\n") if line]
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        assert events[-1] == "[DONE]"
        metrics = (await client.get("/metrics")).text
        assert 'vllm:request_success_total{engine="0",finished_reason="error",model_name="fake"} 1.0' in metrics


async def asgi_call(app: Starlette, body: dict[str, Any], disconnect: anyio.Event) -> list[Message]:
    """One POST /v1/completions through raw ASGI; the client disconnects when `disconnect` is set."""
    sent: list[Message] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> Message:
        if request:
            return request.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "server": ("app", 80),
             "client": ("test", 1), "root_path": ""}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_disconnect_closes_the_engine_generator(stream: bool) -> None:
    """The client going away mid-request closes the engine's generator at once (AsyncLLM aborts the
    request there) and counts the request as aborted."""
    engine = FakeEngine(SCRIPT, block_after=1)
    app = make_app(engine)
    async with app.router.lifespan_context(app):
        disconnect = anyio.Event()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(asgi_call, app, {"prompt": "x", "stream": stream, "max_tokens": 50}, disconnect)
                await engine.started.wait()
                disconnect.set()
        assert engine.closed == [engine.closed[0]] and len(engine.closed[0]) == 32  # uuid4 hex request id
        state = app.state.troupe
        assert state.num_in_flight == 0
        text = state.metrics.render().decode()
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="fake"} 1.0' in text
        assert 'vllm:num_requests_running{engine="0",model_name="fake"} 2.0' in text


async def test_draining_refuses_new_work_and_abort_all_ends_streams() -> None:
    """While shutting down, /health and new requests are 503; abort_all aborts what is in flight."""
    engine = FakeEngine(SCRIPT, block_after=1)
    app = make_app(engine)
    async with app.router.lifespan_context(app):
        state = app.state.troupe
        async with anyio.create_task_group() as tg:
            tg.start_soon(asgi_call, app, {"prompt": "x", "stream": True}, anyio.Event())
            await engine.started.wait()
            state.draining = True
            assert await state.abort_all() == 1
            assert len(engine.aborted) == 1
            tg.cancel_scope.cancel()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            assert (await client.get("/health")).status_code == 503
            resp = await client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"


_CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "cache_salt": "salt"}, "cache_salt"),
    ({"prompt": "x", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({**_CHAT, "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
    ({"prompt": "x", "logits_processors": ["my.Processor"]}, "logits_processors"),
    ({**_CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({**_CHAT, "functions": [{"name": "f"}]}, "functions"),
])
def test_unsupported_values_are_named(body: dict[str, Any], param: str) -> None:
    """A non-neutral value of a field troupe knows but cannot honour is a 400 naming that field."""
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(Exception) as err:
        reject_unsupported(msgspec.convert(body, kind))
    api = to_api_error(err.value)
    assert (api.status, api.param) == (400, param)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "logprobs": None, "presence_penalty": 0, "user": "u",
     "use_beam_search": False, "length_penalty": 1.0, "vllm_xargs": {}, "stream_interval": 1},
    {**_CHAT, "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
     "top_logprobs": 0, "store": False, "service_tier": "auto", "parallel_tool_calls": True, "modalities": ["text"]},
])
def test_neutral_values_are_accepted(body: dict[str, Any]) -> None:
    """Clients that send OpenAI's and vLLM's defaults explicitly are served."""
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    req = msgspec.convert(body, kind)
    reject_unsupported(req)
    req.sampling_params({})
