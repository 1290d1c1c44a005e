"""`troupe serve` end to end: a real server subprocess on the tiny random-weight Llama, driven by
the official `openai` client and by plain httpx (modelled on vLLM's tests/entrypoints/openai).

One server serves the whole module (start-up costs seconds); every test leaves it idle. Metrics
checks compare before/after snapshots, so they do not depend on test order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # a server process

API_KEY = "test-key"
MODEL = "tiny"
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [str(tiny_llama), "--dtype", "float32", "--served-model-name", MODEL, "--max-num-seqs", "32"]
    with ServerProcess(args, tmp_path_factory.mktemp("server"), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def metrics(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels without model_name/engine) -> value."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def aborted(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return m[("vllm:request_success_total", (("finished_reason", "abort"),))]


def sse_payloads(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an SSE body, `[DONE]` as the string itself."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------- the openai client


def test_completion_with_the_openai_client(client: openai.OpenAI) -> None:
    """A completion returns text, finish_reason "length" and usage that adds up."""
    resp = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, **GREEDY)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_chat_uses_the_chat_template(client: openai.OpenAI, http: httpx.Client) -> None:
    """A chat completion's prompt is the conversation rendered by the template (= /tokenize of it)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)  # type: ignore[arg-type]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert resp.usage is not None and resp.usage.prompt_tokens == rendered["count"]
    assert rendered["count"] > len(http.post("/tokenize", json={"prompt": "Hi there"}).json()["tokens"]) + 5


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_text_equals_non_streaming_text(client: openai.OpenAI, endpoint: str) -> None:
    """Greedy: the concatenated deltas equal the non-streamed text; usage arrives in a last chunk."""
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=24, **GREEDY)
    if endpoint == "chat":
        kw["messages"] = [{"role": "user", "content": "Tell me a story"}]
        full = client.chat.completions.create(**kw)
        full_text, full_usage = full.choices[0].message.content, full.usage
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw["prompt"] = "Once upon a time"
        full_c = client.completions.create(**kw)
        full_text, full_usage = full_c.choices[0].text, full_c.usage
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 3
    assert "".join(pieces) == full_text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full_usage
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("include", [False, True], ids=["exclude", "include"])
@pytest.mark.parametrize("stream", [False, True], ids=["final", "stream"])
def test_stop_string(client: openai.OpenAI, include: bool, stream: bool) -> None:
    """The text ends before the first occurrence of the stop string (or right after it, included)."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="The weather today", max_tokens=30, temperature=0.0)
    text = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    words = [w for w in text.split()[2:] if len(w) >= 3]
    assert words, f"no stop candidate in {text!r}"
    stop = words[0]
    cut = text.index(stop) + (len(stop) if include else 0)
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    if stream:
        chunks = list(client.completions.create(stop=[stop], stream=True, extra_body=extra, **kw))
        got = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        last = client.completions.create(stop=[stop], extra_body=extra, **kw).choices[0]
        got = last.text
    assert got == text[:cut]
    assert last.finish_reason == "stop"
    assert (last.model_extra or {}).get("stop_reason") == stop


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    """The same seed gives the same sampled text."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="Random words:", max_tokens=12, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_batch_prompts(client: openai.OpenAI) -> None:
    """A list of prompts gives one choice per prompt, in order, streamed or not."""
    prompts = ["One", "Two words", "Three little words"]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY).choices[0].text
               for p in prompts]
    assert [c.text for c in resp.choices] == singles
    streamed = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, stream=True, **GREEDY):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == singles


_COMPLETION_ERRORS = [
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"min_p": 2.0}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0.0}}, "repetition_penalty"),
    ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
    ({"extra_body": {"min_tokens": 50}, "max_tokens": 5}, "min_tokens"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"cache_salt": "x"}}, "cache_salt"),
    ({"extra_body": {"request_id": "has space"}}, "request_id"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1] * 3000}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 10**7]}, "prompt"),  # the request field, not the engine's name for it
]


@pytest.mark.parametrize(("kwargs", "param"), _COMPLETION_ERRORS, ids=[p for _, p in _COMPLETION_ERRORS])
def test_completion_errors_are_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    """Bad or unsupported values raise openai.BadRequestError with `param` set."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw)
    assert err.value.status_code == 400 and err.value.param == param, err.value.message
    assert param in err.value.message or param in str(err.value.body)


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_CHAT_ERRORS = [
    ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),  # neither format nor structures
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "structured_outputs.structural_tag"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": []}, "messages"),
    ({"extra_body": {"priority": 1}}, "priority"),
    ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),  # not trusted by default
    ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),  # with add_generation_prompt
]


@pytest.mark.parametrize(("kwargs", "param"), _CHAT_ERRORS, ids=[p for _, p in _CHAT_ERRORS])
def test_chat_errors_are_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    """Bad or unsupported chat fields (images, inconsistent tool choice, ...) are refused, not ignored."""
    kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    assert err.value.param == param, err.value.message


def test_unknown_model_is_404_and_the_server_stays_healthy(client: openai.OpenAI, http: httpx.Client) -> None:
    """An unknown model name is openai.NotFoundError; after all the errors a request still works."""
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.param == "model"
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_api_key_is_required_on_v1_only(server: ServerProcess) -> None:
    """Without the right Bearer key every /v1 endpoint is 401; the others are open, as in vLLM."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path in ("/health", "/metrics", "/version"):
            assert anon.get(path).status_code == 200
        resp = anon.get("/v1/models")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_request_id_header_is_used_and_echoed(http: httpx.Client) -> None:
    """X-Request-Id becomes the response id and is echoed; without one a fresh id is echoed."""
    body = {"prompt": "hi", "max_tokens": 2}
    resp = http.post("/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
    assert resp.headers["x-request-id"] == "req-42" and resp.json()["id"] == "cmpl-req-42"
    resp = http.post("/v1/completions", json=body)
    assert len(resp.headers["x-request-id"]) >= 16 and resp.json()["id"] == f"cmpl-{resp.headers['x-request-id']}"
    assert http.post("/v1/completions", json=body, headers={"X-Request-Id": "has space"}).status_code == 400


def test_models_version_tokenize_detokenize(client: openai.OpenAI, http: httpx.Client) -> None:
    """The small endpoints: model list, version, and a tokenize/detokenize round trip."""
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello world, again."}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 2
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world, again."
    assert http.post("/detokenize", json={"tokens": [10**7]}).json()["error"]["param"] == "tokens[0]"


# ---------------------------------------------------------------------- raw HTTP


def test_raw_sse_lines(http: httpx.Client) -> None:
    """The stream is text/event-stream of `data: {json}` events, then `data: [DONE]`."""
    body = {"prompt": "Hello", "max_tokens": 5, "stream": True, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(list(resp.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


_BAD_BODIES = [
    ("/v1/completions", b'{"prompt": "hi"', 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", b"{}", 400, "prompt"),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1.5}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "hi", "stop": [1]}', 400, "stop[0]"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1e400}', 400, "seed"),
    ("/v1/completions", b'{"prompt": [[1, "a"]]}', 400, "prompt[0][1]"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": "2"}', 400, "n"),
    ("/tokenize", b'{"prompt": "a", "messages": []}', 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), _BAD_BODIES)
def test_malformed_bodies_and_wrong_types(http: httpx.Client, path: str, body: bytes, status: int,
                                          param: str | None) -> None:
    """Malformed JSON and wrong types are a 400 OpenAI error naming the field when there is one."""
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_wrong_content_type_huge_body_and_unknown_route(http: httpx.Client) -> None:
    """Non-JSON is 415, a body over 16 MiB is 413, unknown routes 404 and wrong methods 405."""
    resp = http.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 415
    huge = b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}'
    resp = http.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/health").status_code == 200


def test_prompt_over_the_context_length_is_400(http: httpx.Client) -> None:
    """A prompt longer than the context (tokenized in a worker thread) is a 400 on `prompt`."""
    resp = http.post("/v1/completions", json={"prompt": "hello " * 5000, "max_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "2048" in resp.json()["error"]["message"]


async def test_disconnect_mid_stream_aborts_the_request(server: ServerProcess) -> None:
    """Closing a stream after a few chunks aborts its request at once: the abort counter goes up.

    (The engine's `num_requests_running` gauge is not checked: an idle engine publishes no new
    SchedulerStats after an abort, so the gauge keeps its last value until the next step.)"""
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
        before = aborted(await ametrics(http))
        body = {"prompt": "Go on forever", "max_tokens": 1900, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
        with anyio.fail_after(20):
            while True:
                m = await ametrics(http)
                if aborted(m) == before + 1:
                    break
                await anyio.sleep(0.05)


async def ametrics(http: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = await http.get("/metrics")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


async def test_concurrent_streams(server: ServerProcess) -> None:
    """16 concurrent streaming chats all finish with their full token count."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        counts: list[int] = []

        async def one(i: int) -> None:
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=10 + i,
                stream=True, stream_options={"include_usage": True}, **GREEDY)
            async for chunk in stream:
                if chunk.usage is not None:
                    counts.append(chunk.usage.completion_tokens - i)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
    assert counts == [10] * 16


def test_metrics_match_the_requests_served(client: openai.OpenAI, http: httpx.Client) -> None:
    """After a known sequence of requests the counters and histogram counts moved by exactly that."""
    before = metrics(http)
    usages = []
    for n in (3, 5, 7):
        usages.append(client.completions.create(model=MODEL, prompt=f"Count {n}", max_tokens=n, **GREEDY).usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usages.append(chunks[-1].usage)
    after = metrics(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    prompt = sum(u.prompt_tokens for u in usages if u)
    completion = sum(u.completion_tokens for u in usages if u)
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == completion == 3 + 5 + 7 + 4
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == completion - 4
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", ())] <= 1.0
