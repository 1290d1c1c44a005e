"""Tool calling through the server app in-process, on a scripted fake engine: what the chat template
gets, how a model's hermes-style `<tool_call>` output becomes `tool_calls` (whole and streamed, read
back by the official openai client), and the constraint `required` / a named function put on the
request. The real model's forced tool calls are in test_server_openai.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from server_fakes import FakeEngine, FakeTokenizer, delta, make_app

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.tools import HermesStreamParser, parse_tool_calls, required_tools_schema, tool_calls_from_required

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@asynccontextmanager
async def openai_client(engine: FakeEngine, **settings: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    app = make_app(engine, **settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            yield openai.AsyncOpenAI(base_url="http://app/v1", api_key="x", http_client=http, max_retries=0)


def final(text: str, finish: str = "stop") -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, text, [7] * 5, finish_reason=finish)], finished=True)


def pieces(text: str, size: int) -> list[RequestOutput]:
    """`text` as DELTA outputs of `size` characters, the last one finished."""
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    return [delta(p, 7, "stop" if i == len(parts) - 1 else None) for i, p in enumerate(parts)]


async def test_auto_tool_call_is_parsed_into_tool_calls() -> None:
    """tool_choice auto (the default with tools): a <tool_call> block in the output becomes a tool
    call the openai client reads; the text before it is the content; finish_reason tool_calls."""
    async with openai_client(FakeEngine([final("Let me check. " + CALL)])) as client:
        resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME])  # type: ignore[list-item]
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


async def test_streamed_tool_call_deltas_assemble_to_the_call() -> None:
    """Streamed 3 characters at a time (the tag split across deltas): content deltas never show
    the tag, and the tool-call deltas the client accumulates give the same call as whole."""
    text = "Checking. " + CALL + "\n" + CALL.replace("Paris", "Rome")
    async with openai_client(FakeEngine(pieces(text, 3))) as client:
        stream = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], stream=True)  # type: ignore[list-item]
        content, calls, reasons = "", {}, []
        async for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                    entry["id"] = entry["id"] or tc.id
                    entry["name"] += tc.function.name or "" if tc.function else ""
                    entry["arguments"] += tc.function.arguments or "" if tc.function else ""
                if c.finish_reason:
                    reasons.append(c.finish_reason)
    assert content == "Checking. " and "<tool" not in content
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_weather"]
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Rome"]
    assert all(calls[i]["id"] for i in calls) and reasons == ["tool_calls"]


async def test_parallel_tool_calls_false_keeps_the_first() -> None:
    """parallel_tool_calls=false: only the first of several calls is returned."""
    async with openai_client(FakeEngine([final(CALL + CALL.replace("Paris", "Rome"))])) as client:
        resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                                    parallel_tool_calls=False)
    calls = resp.choices[0].message.tool_calls
    assert calls is not None and [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris"]  # type: ignore[union-attr]


async def test_tool_choice_none_and_a_broken_block_leave_the_text_alone() -> None:
    """tool_choice none: no parsing; a block that is not a call's JSON: no tool called, all text."""
    async with openai_client(FakeEngine([final(CALL)])) as client:
        resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], tool_choice="none")  # type: ignore[list-item]
    assert resp.choices[0].message.content == CALL and not resp.choices[0].message.tool_calls
    broken = "<tool_call>{not json}</tool_call>"
    async with openai_client(FakeEngine([final(broken)])) as client:
        resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    assert resp.choices[0].message.content == broken and resp.choices[0].finish_reason == "stop"


async def test_the_template_gets_tools_and_the_tool_conversation() -> None:
    """The chat template receives the tools, an assistant message's tool_calls (arguments parsed into
    an object, as HF templates expect) and the tool message's tool_call_id."""
    FakeTokenizer.rendered.clear()
    conversation = [*ASK,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    async with openai_client(FakeEngine([final("It is sunny.")])) as client:
        resp = await client.chat.completions.create(model="fake", messages=conversation, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert resp.choices[0].message.content == "It is sunny."
    messages, kwargs = FakeTokenizer.rendered[-1]
    assert kwargs["tools"] == [{"type": "function", "function": {**WEATHER["function"], "strict": None}}]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


async def test_named_tool_choice_forces_the_function_schema() -> None:
    """A named function: the request is constrained to its parameters' schema, and the output is
    that call's arguments (streamed: the call first, then argument pieces)."""
    args = '{"city": "Paris"}'
    engine = FakeEngine([final(args)])
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with openai_client(engine) as client:
        resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                                    tool_choice=named)  # type: ignore[arg-type]
    calls = resp.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather" and calls[0].function.arguments == args  # type: ignore[union-attr]
    assert resp.choices[0].message.content is None
    params = engine.calls[-1][1]
    assert params is not None and params.structured_outputs is not None  # type: ignore[attr-defined]
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]  # type: ignore[attr-defined]
    engine = FakeEngine(pieces(args, 4))
    async with openai_client(engine) as client:
        stream = await client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                                      tool_choice=named, stream=True)  # type: ignore[arg-type]
        deltas = [tc for chunk in [c async for c in stream] for ch in chunk.choices for tc in ch.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == args


async def test_required_tool_choice_forces_a_list_of_calls() -> None:
    """tool_choice required: the output schema is a non-empty array of {name, parameters} over the
    tools; the array becomes the tool calls (finish_reason tool_calls), streamed whole at the end."""
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    for stream in (False, True):
        engine = FakeEngine(pieces(out, 5) if stream else [final(out)])
        async with openai_client(engine) as client:
            kw: dict[str, Any] = dict(model="fake", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
            if stream:
                chunks = [c async for c in await client.chat.completions.create(stream=True, **kw)]
                deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
                got = [(d.function.name, json.loads(d.function.arguments or "")) for d in deltas if d.function]
                reason = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
            else:
                resp = await client.chat.completions.create(**kw)
                calls = resp.choices[0].message.tool_calls or []
                got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
                reason = [resp.choices[0].finish_reason]
        assert got == [("get_time", {}), ("get_weather", {"city": "Oslo"})] and reason == ["tool_calls"]
        params = engine.calls[-1][1]
        schema = params.structured_outputs.json  # type: ignore[union-attr, attr-defined]
        assert schema == required_tools_schema([("get_weather", WEATHER["function"]["parameters"]),  # type: ignore[arg-type]
                                                ("get_time", TIME["function"]["parameters"])])  # type: ignore[arg-type]


def test_hermes_parser_whole_and_streamed_agree() -> None:
    """The stream parser, fed one character at a time, finds the calls and content of the whole
    parser; an unclosed last block is parsed to the end; text that only looks like a tag start is content."""
    text = "Hi <tool_ <tool_call>" + '{"name": "a", "arguments": {"x": 1}}</tool_call> <tool_call>{"name": "b", "arguments": "{}"}'
    whole = parse_tool_calls(text)
    assert whole.content == "Hi <tool_ " and [(c.name, c.arguments) for c in whole.tool_calls] == [("a", '{"x": 1}'),
                                                                                                   ("b", "{}")]
    parser, content, calls = HermesStreamParser(), "", []
    for ch in text:
        piece, done = parser.feed(ch)
        content += piece
        calls += done
    rest, more = parser.finish()
    assert content + rest == "Hi <tool_  " and [(c.name, c.arguments) for c in calls + more] == [
        (c.name, c.arguments) for c in whole.tool_calls]
    assert parse_tool_calls("no tools here").tool_calls == []
    assert tool_calls_from_required('[{"name": "a", "parameters": {"x": 1}}]')[0].arguments == '{"x": 1}'  # type: ignore[index]
    assert tool_calls_from_required('[{"name": "a", "param') is None


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}}}}}
CODER_CALL = ("<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n<parameter=limit>\n5\n"
              "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
async def test_qwen3_coder_calls_typed_by_the_requests_tools(stream: bool) -> None:
    """`--tool-call-parser qwen3_coder`: the XML-style block becomes a call whose arguments are typed by the
    request's own tool schema (the query stays the string "42", the limit is the integer 5), read by the
    openai client whole and streamed."""
    outputs = pieces(CODER_CALL, 3) if stream else [final(CODER_CALL)]
    async with openai_client(FakeEngine(outputs), tool_call_parser="qwen3_coder") as client:
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="fake", messages=ASK, tools=[SEARCH], stream=True)]  # type: ignore[list-item]
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            resp = await client.chat.completions.create(model="fake", messages=ASK, tools=[SEARCH])  # type: ignore[list-item]
            calls, finish = list(resp.choices[0].message.tool_calls or []), resp.choices[0].finish_reason
    assert finish == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("search", {"query": "42", "limit": 5})]
