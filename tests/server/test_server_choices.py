"""Response shapes through the server app in-process, on a scripted fake engine: n choices and their
index (whole and streamed, batch x n), usage over all choices, OpenAI's logprob shapes, echo,
`continuous_usage_stats`, the model's generation-config defaults, request ids from the body and
unknown fields ignored with one warning. The same features through the real model are in
test_server_openai.py.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest
from server_fakes import FakeEngine, serving
from structlog.testing import capture_logs

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.sampling_params import RequestOutputKind

pytestmark = pytest.mark.anyio

PROMPT_IDS = [ord(c) for c in "Hi"]  # the fake tokenizer: one token per character


class LP(NamedTuple):
    """The engine's Logprob shape (logprob, rank, decoded_token)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


def position(token: int, text: str, lp: float) -> dict[int, Any]:
    """A position's logprobs: the sampled token (rank 2) and a better alternative (rank 1)."""
    return {token: LP(lp, 2, text), 99: LP(-0.1, 1, "Z")}


def sample(index: int, text: str, finish: str | None, logprobs: bool = False) -> CompletionOutput:
    ids = [ord(c) for c in text]
    lps = [position(t, c, -1.0 - i) for i, (t, c) in enumerate(zip(ids, text, strict=True))] if logprobs else None
    return CompletionOutput(index, text, ids, logprobs=lps, finish_reason=finish)  # type: ignore[arg-type]


def output(*samples: CompletionOutput, finished: bool = True, prompt_logprobs: Any = None) -> RequestOutput:
    return RequestOutput("r", "Hi", PROMPT_IDS, list(samples), finished=finished, prompt_logprobs=prompt_logprobs)


def events(text: str) -> list[Any]:
    found = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert found[-1] == "[DONE]"
    return [json.loads(e) for e in found[:-1]]


async def test_n_choices_whole_and_streamed() -> None:
    """n=2: two choices with index 0 and 1, usage counting the prompt once and both choices' tokens;
    streamed, each child's deltas carry its index and concatenate to its text."""
    whole = [output(sample(1, "bb", "length"), sample(0, "aaa", "stop"))]
    async with serving(FakeEngine(whole)) as client:
        body = (await client.post("/v1/completions", json={"prompt": "Hi", "n": 2, "temperature": 1.0})).json()
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aaa"), (1, "bb")]
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    script = [output(sample(0, "a", None), finished=False), output(sample(1, "b", None), finished=False),
              output(sample(1, "b", "length"), finished=False), output(sample(0, "aa", "stop"))]
    async with serving(FakeEngine(script)) as client:
        for path, body in [("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
            resp = await client.post(path, json={**body, "n": 2, "stream": True,
                                                 "stream_options": {"include_usage": True}})
            chunks = events(resp.text)
            texts, reasons = ["", ""], [None, None]
            for chunk in chunks[:-1]:
                (c,) = chunk["choices"]
                texts[c["index"]] += c.get("text") or c.get("delta", {}).get("content") or ""
                reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
            assert texts == ["aaa", "bb"] and reasons == ["stop", "length"]
            assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
            if path.endswith("chat/completions"):  # a role chunk for each choice first
                assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]


async def test_batch_times_n_numbers_choices_prompt_major() -> None:
    """Two prompts with n=2: choices 0, 1 for the first prompt and 2, 3 for the second."""
    whole = [output(sample(0, "x", "stop"), sample(1, "y", "stop"))]
    async with serving(FakeEngine(whole)) as client:
        body = (await client.post("/v1/completions", json={"prompt": ["Hi", "Ho"], "n": 2})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 4


async def test_completion_logprobs_and_echo_shapes() -> None:
    """Completions logprobs: tokens, token_logprobs, top_logprobs (every entry: the token and the
    top alternative) and text_offset; with echo the prompt's tokens lead, the first with no logprob."""
    prompt_lps = [None, position(PROMPT_IDS[1], "i", -3.0)]
    engine = FakeEngine([output(sample(0, "ok", "length", logprobs=True), prompt_logprobs=prompt_lps)])
    async with serving(engine) as client:
        body = (await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1, "echo": True})).json()
    params = engine.calls[-1][1]
    assert params is not None
    choice = body["choices"][0]
    assert choice["text"] == "Hiok"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "i", "o", "k"]
    assert lp["token_logprobs"] == [None, -3.0, -1.0, -2.0]
    assert lp["top_logprobs"] == [None, {"i": -3.0, "Z": -0.1}, {"o": -1.0, "Z": -0.1}, {"k": -2.0, "Z": -0.1}]
    assert lp["text_offset"] == [0, 1, 2, 3]
    async with serving(FakeEngine([output(sample(0, "ok", "length", logprobs=True))])) as client:
        body = (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0, "echo": True})).json()
    assert body["choices"][0]["text"] == "Hi" and body["choices"][0]["finish_reason"] == "length"


async def test_chat_logprobs_shape() -> None:
    """Chat logprobs: content entries {token, logprob, bytes, top_logprobs}, the top list the k best by rank."""
    async with serving(FakeEngine([output(sample(0, "ok", "stop", logprobs=True))])) as client:
        body = (await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["bytes"]) for e in content] == [("o", -1.0, [111]), ("k", -2.0, [107])]
    assert [e["top_logprobs"] for e in content] == [[{"token": "Z", "logprob": -0.1, "bytes": [90]}]] * 2


async def test_continuous_usage_stats() -> None:
    """stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    script = [output(sample(0, "a", None), finished=False), output(sample(0, "b", "length"))]
    async with serving(FakeEngine(script)) as client:
        resp = await client.post("/v1/completions", json={
            "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = events(resp.text)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)


async def test_generation_config_defaults_fill_unset_fields() -> None:
    """The model's generation-config defaults apply to the fields a request leaves unset, never over
    one it sets; chat's max_tokens default comes from max_new_tokens too."""
    engine = FakeEngine([output(sample(0, "a", "stop"))])
    engine.generation_defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_tokens": 7}
    async with serving(engine) as client:
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        await client.post("/v1/completions", json={"prompt": "x", "temperature": 0.2, "max_tokens": 3, "top_k": 0})
    (_, chat), (_, comp) = engine.calls
    assert chat is not None and comp is not None
    assert (chat.temperature, chat.top_k, chat.top_p, chat.max_tokens) == (0.6, 20, 0.9, 7)
    assert (comp.temperature, comp.top_k, comp.top_p, comp.max_tokens) == (0.2, 0, 0.9, 3)
    assert chat.output_kind is RequestOutputKind.FINAL_ONLY


async def test_unknown_fields_are_ignored_with_one_warning() -> None:
    """Fields the server does not know are served and named in one warning; the same set again
    is not warned about twice."""
    body = {"prompt": "x", "fancy_vendor_flag": 1, "stream_options": None, "another_one": {"a": 1}}
    async with serving(FakeEngine([output(sample(0, "a", "stop"))])) as client:
        with capture_logs() as logs:
            first = await client.post("/v1/completions", json=body)
            second = await client.post("/v1/completions", json=body)
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]})
    assert first.status_code == second.status_code == chat.status_code == 200
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [w["fields"] for w in warnings] == [["another_one", "fancy_vendor_flag"], ["messages[0].reasoning_content"]]


async def test_request_id_from_the_body() -> None:
    """Without an X-Request-Id header, the body's request_id is the engine request id, the response
    id and the echoed header."""
    engine = FakeEngine([output(sample(0, "a", "stop"))])
    async with serving(engine) as client:
        resp = await client.post("/v1/completions", json={"prompt": "x", "request_id": "mine-1"})
    assert resp.json()["id"] == "cmpl-mine-1" and resp.headers["x-request-id"] == "mine-1"
    assert engine.closed == []
