"""Inputs that used to stall `troupe serve`, each sent to a real server while a prober watches it.

One server (a tiny random Llama with the default model's tokenizer, its engine in its own process,
the default console log format) serves the module. Each attack runs beside a prober thread that
asks `/health` every 50 ms and a plain completion; every test then checks that

- the attack got its 400 naming the field and the input limit it broke (docs/reliability.md);
- every `/health` answered within 1 s, and the plain request finished;
- the server's event-loop watchdog (`troupe:event_loop_lag_max_seconds`, the largest lag since the
  server started) is under 250 ms, so no attack so far held the loop.

The engine-death test has a server of its own: 24 streams in flight when the engine is SIGKILLed,
console logs, each stream must get its error event within 2 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from engines import engine_pid
from server_process import HealthProber, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--trust-request-chat-template",
        "--limit", "max_chat_template_render_ms=500"]
VOCAB = 49152
MAX_LAG_S = 0.25
HEALTH_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess([str(tiny_llama), *ARGS], tmp_path_factory.mktemp("attacks"),
                       env={"TROUPE_LOG_FORMAT": "console"}) as srv:
        yield srv


def max_lag(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r"^troupe:event_loop_lag_max_seconds (\S+)$", text, re.M)
    assert m, "no watchdog gauge in /metrics"
    return float(m.group(1))


def under_watch(server: ServerProcess, attack: Callable[[httpx.Client], Any]) -> Any:
    """Run `attack` while a prober asks /health every 50 ms and a plain request is served; return
    what the attack returned, after checking the prober's and the watchdog's bounds."""
    def plain() -> int:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}).status_code

    with HealthProber(server.url) as prober, ThreadPoolExecutor(1) as pool, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        plain_status = pool.submit(plain)
        result = attack(http)
        assert plain_status.result(timeout=60) == 200
    lag = max_lag(server.url)
    print(f"\nslowest /health {prober.slowest * 1000:.0f} ms, watchdog max lag {lag * 1000:.0f} ms")
    assert prober.slowest < HEALTH_S, prober.slowest
    assert lag < MAX_LAG_S, lag
    return result


def refused(resp: httpx.Response, param: str, limit: str) -> None:
    assert resp.status_code == 400, (resp.status_code, resp.text[:500])
    error = resp.json()["error"]
    assert error["param"] == param and limit in error["message"], error


def nested_schema(depth: int) -> str:
    """A JSON schema of objects nested `depth` deep, as text (Python's json recurses per level)."""
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


@pytest.mark.parametrize("depth", [300, 1000, 3000])
@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_deeply_nested_schema_is_refused_at_once(server: ServerProcess, field: str, depth: int) -> None:
    """A JSON schema nested 300 to 3,000 deep, as a string (it used to be parsed by xgrammar on the
    event loop for minutes): 400 naming the field the client used and max_json_schema_depth, decided
    on the text before anything parses it."""
    text = nested_schema(depth)
    body: dict[str, Any] = {"prompt": "Hi", "max_tokens": 4}
    body.update({"guided_json": text} if field == "guided_json" else {"structured_outputs": {"json": text}})
    resp = under_watch(server, lambda http: http.post("/v1/completions", json=body))
    limit = "max_json_schema_depth" if len(text) <= 65_536 else "max_json_schema_bytes"  # 3,000 deep: 162 kB
    refused(resp, "guided_json" if field == "guided_json" else "structured_outputs.json", limit)


@pytest.mark.parametrize("field,value,limit", [
    ("guided_json", json.dumps({"type": "string", "description": "x" * 70_000}), "max_json_schema_bytes"),
    ("guided_regex", "a" * 5_000, "max_regex_chars"),
    ("guided_grammar", "root ::= " + '"a" ' * 20_000, "max_grammar_chars"),
    ("guided_choice", [f"c{i}" for i in range(2_000)], "max_enum_values"),
    ("tool_choice", None, "max_json_schema_depth"),
])
def test_each_constraint_field_is_bounded_at_the_edge(server: ServerProcess, field: str, value: Any,
                                                      limit: str) -> None:
    """Every way a client sends an output constraint is checked against its limit before it is parsed or
    converted, with the client's own field in the error (a forced tool call's schema included)."""
    if field == "tool_choice":
        fn = {"name": "f", "parameters": json.loads(nested_schema(40))}
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "tools": [{"type": "function", "function": fn}], "tool_choice": "required"}
        resp = under_watch(server, lambda http: http.post("/v1/chat/completions", json=body))
    else:
        resp = under_watch(server, lambda http: http.post("/v1/completions",
                                                          json={"prompt": "Hi", "max_tokens": 4, field: value}))
    refused(resp, field, limit)


def test_a_huge_enum_is_refused_and_structured_requests_go_on(server: ServerProcess) -> None:
    """A schema with a 100,000-string enum (it used to hold the engine's grammar thread for every
    structured request behind it): 400 naming max_enum_values; a small regex request then finishes."""
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(100_000)]}

    def attack(http: httpx.Client) -> httpx.Response:
        resp = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "pick"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}})
        small = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "guided_regex": "[ab]{1,3}"},
                          timeout=30)
        assert small.status_code == 200, small.text
        return resp

    resp = under_watch(server, attack)
    assert resp.status_code == 400 and "max_enum_values" in resp.json()["error"]["message"], resp.text[:300]


@pytest.mark.parametrize("template,limit", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "max_chat_template_render_ms"),
    ("{{ 'a' * 10**10 }}", "max_chat_template_output_chars"),
])
def test_a_trusted_chat_template_is_bounded(server: ServerProcess, template: str, limit: str) -> None:
    """A request's own chat template (the server trusts them) that would render for hours or allocate
    10 GB: 400 naming chat_template and the limit, after at most the 500 ms render deadline, off the loop."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "chat_template": template}
    refused(under_watch(server, lambda http: http.post("/v1/chat/completions", json=body)), "chat_template", limit)


def test_logit_bias_over_the_whole_vocabulary_sixteen_at_once(server: ServerProcess) -> None:
    """16 concurrent requests whose logit_bias covers the whole vocabulary: each 400 naming
    logit_bias and max_logit_bias, checked before the map is converted."""
    body = {"prompt": "Hi", "max_tokens": 4, "logit_bias": {str(t): 1.0 for t in range(VOCAB)}}

    def attack(http: httpx.Client) -> list[httpx.Response]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda _: http.post("/v1/completions", json=body), range(16)))

    for resp in under_watch(server, attack):
        refused(resp, "logit_bias", "max_logit_bias")


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("bad_words", [f"w{i}" for i in range(10_000)], "max_bad_words"),
    ("stop", [f"s{i}" for i in range(10_000)], "max_stop"),
    ("stop_token_ids", list(range(VOCAB)) * 2, "max_stop_token_ids"),
    ("allowed_token_ids", list(range(VOCAB)) * 2, "max_allowed_token_ids"),
])
def test_long_lists_are_refused(server: ServerProcess, field: str, value: list[Any], limit: str) -> None:
    """bad_words (its de-duplication was quadratic, on the loop), stop strings and token-id lists
    past their bounds: 400 naming the field and the limit."""
    resp = under_watch(server, lambda http: http.post("/v1/completions",
                                                      json={"prompt": "Hi", "max_tokens": 4, field: value}))
    refused(resp, field, limit)


def test_a_huge_prompt_batch_and_detokenize_are_refused(server: ServerProcess) -> None:
    """A completions batch of 100,000 prompts (each would be an engine request) and a /detokenize of
    a million ids: 400 naming prompt / tokens and their limits."""
    def attack(http: httpx.Client) -> tuple[httpx.Response, httpx.Response]:
        batch = http.post("/v1/completions", json={"prompt": ["x"] * 100_000, "max_tokens": 1})
        detok = http.post("/detokenize", json={"tokens": [1] * 1_000_000})
        return batch, detok

    batch, detok = under_watch(server, attack)
    refused(batch, "prompt", "max_prompts")
    refused(detok, "tokens", "max_detokenize_tokens")


@pytest.mark.parametrize("where", ["vllm_xargs", "chat_template_kwargs", "response_format"])
def test_nesting_past_the_decoder_limit_is_a_400(server: ServerProcess, where: str) -> None:
    """Objects nested 5,000 deep in a free-form field (msgspec's recursion limit, a 500 before):
    400 with an OpenAI error body."""
    deep = "{\"a\":" * 5000 + "1" + "}" * 5000
    if where == "response_format":
        raw = ('{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"response_format":'
               '{"type":"json_schema","json_schema":{"name":"d","schema":' + deep + "}}}")
    else:
        raw = '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"' + where + '":' + deep + "}"
    resp = under_watch(server, lambda http: http.post("/v1/chat/completions", content=raw,
                                                      headers={"content-type": "application/json"}))
    assert resp.status_code == 400, resp.text[:300]
    assert "too deeply" in resp.json()["error"]["message"]


def test_engine_death_reaches_every_stream_within_2s_with_console_logs(tiny_llama: Path, tmp_path: Path) -> None:
    """24 streams in flight, the engine SIGKILLed, the default console log format: every stream
    ends with its engine_dead error event within 2 s of the kill (each 5xx used to be logged with a
    rich traceback on the event loop, seconds apiece), and /health answers 503 within 1 s."""
    args = ["--dtype", "float32", "--max-model-len", "2048", "--exit-on-engine-death-after", "-1"]
    with ServerProcess([str(tiny_llama), *args], tmp_path,
                       env={"TROUPE_LOG_FORMAT": "console"}) as srv:
        started = threading.Barrier(25)
        killed_at: list[float] = []
        ended: list[tuple[float, str]] = []

        def stream() -> None:
            body = {"prompt": "Tell me a story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=srv.url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                assert first.startswith("data: ")
                started.wait(timeout=60)
                last = ""
                for line in lines:
                    if line:
                        last = line if line != "data: [DONE]" else last
                ended.append((time.monotonic(), last))

        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(stream) for _ in range(24)]
            started.wait(timeout=60)
            assert srv.proc is not None
            os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)
            killed_at.append(time.monotonic())
            for f in futures:
                f.result(timeout=60)
        with httpx.Client(base_url=srv.url, timeout=5) as http:
            t0 = time.monotonic()
            assert http.get("/health").status_code == 503
            assert time.monotonic() - t0 < HEALTH_S
        late = max(t for t, _ in ended) - killed_at[0]
        print(f"\nlast stream error {late * 1000:.0f} ms after the kill")
        assert len(ended) == 24 and late < 2.0, late
        for _, last in ended:
            assert json.loads(last.removeprefix("data: "))["error"]["code"] == "engine_dead", last
        assert srv.stderr_tail(400).count("Traceback") <= 1


def test_limits_are_set_from_the_cli_and_the_engine_options(tiny_llama: Path, tmp_path: Path) -> None:
    """`troupe serve --limit max_stop=2` refuses a third stop string and serves two; an engine's
    `input_limits` applies to `LLM.generate` the same way."""
    from troupe import LLM, InvalidInputError, SamplingParams
    from troupe.limits import InputLimits

    with ServerProcess([str(tiny_llama), *ARGS, "--limit", "max_stop=2"], tmp_path / "serve") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop": ["a", "b"]})
            assert ok.status_code == 200, ok.text
            refused(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop": ["a", "b", "c"]}),
                    "stop", "max_stop")
    with LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, multiprocess=False,
             input_limits=InputLimits(max_bad_words=1)) as llm:
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2, bad_words=["x"]))[0].outputs[0].token_ids
        with pytest.raises(InvalidInputError, match="max_bad_words"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, bad_words=["x", "y"]))
