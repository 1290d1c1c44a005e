"""`troupe serve` process lifecycle: SIGTERM drain, engine death, start-up failure (modelled on
vLLM's tests/entrypoints/openai/completion/test_shutdown.py). Each test owns its server process.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # a server process

FAULTY = [str(Path(__file__).parents[1] / "faulty_serve.py")]
TINY = ["--dtype", "float32"]


async def wait_refusing(url: str) -> None:
    """Until the server refuses new work: /health 503 or the connection refused."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        with anyio.fail_after(20):
            while True:
                try:
                    if (await http.get("/health")).status_code == 503:
                        return
                except httpx.TransportError:
                    return
                await anyio.sleep(0.05)


async def test_sigterm_drains_then_aborts_and_exits_0(tiny_llama: Path, tmp_path: Path) -> None:
    """SIGTERM: new work is refused, a short stream finishes normally within the grace, a long one
    is aborted when the grace ends (finish_reason "abort", then [DONE]), and the process exits 0.

    Each model step waits 10 ms (`step_delay_ms`), so the 1900-token stream needs at least 19 s
    whatever the machine's speed and cannot finish inside the 3 s grace; the 40-token one needs
    about 0.4 s plus its compute."""
    grace = 3.0
    args = [str(tiny_llama), *TINY, "--shutdown-timeout", str(grace)]
    with ServerProcess(args, tmp_path, module=[*FAULTY, "step_delay_ms=10"]) as srv:
        streams: dict[str, list[Any]] = {}
        ended: dict[str, float] = {}
        first = {"short": anyio.Event(), "long": anyio.Event()}

        async def stream(http: httpx.AsyncClient, name: str, max_tokens: int) -> None:
            body = {"prompt": f"A {name} story", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            payloads: list[Any] = []
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        payloads.append(data if data == "[DONE]" else json.loads(data))
                        first[name].set()
            streams[name], ended[name] = payloads, time.monotonic()

        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream, http, "long", 1900)
                    tg.start_soon(stream, http, "short", 40)
                    await first["long"].wait()
                    await first["short"].wait()
                    sent = time.monotonic()
                    srv.signal(signal.SIGTERM)
                    await wait_refusing(srv.url)
                    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as fresh:
                        try:
                            resp = await fresh.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                            assert resp.status_code == 503
                        except httpx.TransportError:
                            pass  # the listener is already closed
        code = await anyio.to_thread.run_sync(srv.wait_exit, grace + 30)
        exited = time.monotonic()
    assert code == 0, srv.stderr_tail()
    for name, reason in (("short", "length"), ("long", "abort")):
        payloads = streams[name]
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] == reason
    assert ended["long"] - sent >= grace - 0.5  # ran on until the grace was over
    assert exited - sent < grace + 20


def test_engine_death_gives_503_then_the_process_exits_nonzero(tiny_llama: Path, tmp_path: Path) -> None:
    """A model failure kills the engine: the stream in flight gets an SSE error, new requests and
    /health get 503, and after --exit-on-engine-death-after the server exits 1 by itself."""
    args = [str(tiny_llama), *TINY, "--exit-on-engine-death-after", "2"]
    with ServerProcess(args, tmp_path, module=[*FAULTY, "raise_after_steps=3"]) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            body = {"prompt": "doomed", "max_tokens": 20, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = [line for line in resp.iter_lines() if line]
            died = time.monotonic()
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
            assert http.get("/health").status_code == 503
            resp = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
        code = srv.wait_exit(60)
        assert code == 1, srv.stderr_tail()
        assert time.monotonic() - died >= 1.5


def test_a_model_that_cannot_load_exits_3(tmp_path: Path) -> None:
    """Start-up failure: the process exits 3 (uvicorn's start-up failure code) naming the cause."""
    with ServerProcess([str(tmp_path / "no-such-model"), *TINY], tmp_path / "logs", wait_healthy=False) as srv:
        assert srv.wait_exit(180) == 3
        assert "no-such-model" in srv.stderr_tail(200)


def test_one_request_failing_leaves_the_server_serving(tiny_llama: Path, tmp_path: Path) -> None:
    """Requests that used to kill the engine get a normal answer (`min_tokens`) or a 400 naming
    `seed` (2**70); a request whose sampling fails after 2 tokens gets a final SSE error event
    (streamed) or a 500 OpenAI error (not streamed) while a request beside it finishes; /health
    stays 200 and the server serves on."""
    with ServerProcess([str(tiny_llama), *TINY], tmp_path,
                       module=[*FAULTY, "fail_sampling=poison,fail_after_tokens=2"]) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "min_tokens": 2})
            assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
            resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": 2**70, "temperature": 1})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "seed"
            body = {"prompt": "poisoned", "max_tokens": 10, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "poison-stream"}) as resp:
                assert resp.status_code == 200
                payloads = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
            assert payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])["error"]
            assert error["code"] == "request_failed" and "injected sampling failure" in error["message"]
            assert any(json.loads(p).get("choices") for p in payloads[:-2])  # it had started

            async def side_by_side() -> tuple[httpx.Response, httpx.Response]:
                async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ahttp:
                    body = {"prompt": "together", "max_tokens": 6, "ignore_eos": True}
                    with anyio.fail_after(60):
                        bad, good = await _gather(ahttp.post("/v1/completions", json=body,
                                                             headers={"X-Request-Id": "poison-plain"}),
                                                  ahttp.post("/v1/completions", json=body))
                return bad, good

            bad, good = anyio.run(side_by_side)
            assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 6
            assert http.get("/health").status_code == 200
            resp = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3})
            assert resp.status_code == 200


async def _gather(*coros: Any) -> list[Any]:
    results: list[Any] = [None] * len(coros)

    async def one(i: int, coro: Any) -> None:
        results[i] = await coro

    async with anyio.create_task_group() as tg:
        for i, coro in enumerate(coros):
            tg.start_soon(one, i, coro)
    return results
