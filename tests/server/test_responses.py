"""The Responses API (`/v1/responses`) through the openai SDK against a real `troupe serve`.

One server for the module: the tiny random Llama (the default model's tokenizer) with a server-wide
`--chat-template` (a plain one, so the prompt each request should have is known: the oracle for
`usage.input_tokens` is that template rendered and tokenized by transformers) and
`--reasoning-parser deepseek_r1` (its split of a greedy answer is checked against the parser applied
to the same prompt's raw greedy completion). The model's text is random, so content is checked
through structured outputs (`text.format`, a named tool) and the rest by structure: items, the
event sequence, usage, the store. The stream formatter
is also fed a recorded reasoning + tool-call output, for the reasoning item and function-call events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from server_process import ServerProcess
from transformers import AutoTokenizer

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.server.chat_format import ChatFormat
from troupe.server.responses_api import ResponsesRequest, chat_request
from troupe.server.responses_output import ResponseShell, ResponsesStream, output_items
from troupe.tools.parsers import tool_parser
from troupe.tools.reasoning import reasoning_parser

pytestmark = [pytest.mark.timeout(300)]

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("responses")
    (folder / "template.jinja").write_text(TEMPLATE)
    args = [str(tiny_llama), "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny",
            "--chat-template", str(folder / "template.jinja"), "--responses-store-size", "2",
            "--reasoning-parser", "deepseek_r1"]
    with ServerProcess(args, folder) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama)


def prompt_tokens(tok: Any, messages: list[dict[str, Any]]) -> int:
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def reasoning_of(resp: Any) -> str:
    return "".join(c.text for item in resp.output if item.type == "reasoning" for c in item.content or [])


def check_usage(resp: Any, input_tokens: int, limit: int, tok: Any) -> None:
    usage = resp.usage
    assert usage.input_tokens == input_tokens
    assert 1 <= usage.output_tokens <= limit
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    thought = reasoning_of(resp)
    assert usage.output_tokens_details.reasoning_tokens == len(tok(thought, add_special_tokens=False)["input_ids"])
    if resp.status == "incomplete":  # cut by max_output_tokens; else the model stopped by itself
        assert usage.output_tokens == limit and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def check_text_items(resp: Any) -> None:
    """A reasoning item (when the model reasoned), then a message (when it answered, or nothing else)."""
    kinds = [item.type for item in resp.output]
    assert kinds in (["reasoning"], ["message"], ["reasoning", "message"])
    for item in resp.output:
        if item.type == "message":
            assert item.role == "assistant" and [p.type for p in item.content] == ["output_text"]
        else:
            assert [c.type for c in item.content] == ["reasoning_text"] and item.content[0].text


def test_text_input_with_instructions(client: openai.OpenAI, tok: Any) -> None:
    resp = client.responses.create(model="tiny", input="Hello there", instructions="Answer briefly.",
                                   max_output_tokens=6, temperature=0.5, top_p=0.9)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "tiny"
    assert (resp.instructions, resp.max_output_tokens, resp.temperature, resp.top_p) == \
        ("Answer briefly.", 6, 0.5, 0.9)
    check_text_items(resp)
    check_usage(resp, prompt_tokens(tok, [{"role": "system", "content": "Answer briefly."},
                                          {"role": "user", "content": "Hello there"}]), 6, tok)


def test_message_items_and_tool_results(client: openai.OpenAI, tok: Any) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "You check the weather."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                          {"type": "input_text", "text": "in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ]
    resp = client.responses.create(model="tiny", input=items, max_output_tokens=4, tools=[WEATHER],
                                   tool_choice="none")
    expected = [{"role": "developer", "content": "You check the weather."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather"}}]},
                {"role": "tool", "content": "21 C"}]
    check_usage(resp, prompt_tokens(tok, expected), 4, tok)
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "none"


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="Yes or no?", max_output_tokens=24,
                                   text={"format": {"type": "json_schema", "name": "yn", "schema": schema,
                                                    "strict": True}})
    assert resp.text.format.type == "json_schema"
    compact = re.sub(r"\s", "", resp.output_text)  # the grammar allows white space between tokens
    if resp.status == "completed":
        assert json.loads(resp.output_text)["answer"] in ("yes", "no")
    else:  # cut short: still a prefix of a document of the schema
        assert any(doc.startswith(compact) for doc in ('{"answer":"yes"}', '{"answer":"no"}')), compact


def test_logprobs_are_included_whole_and_streamed(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the `output_text` part carries
    every generated token's logprob and top alternatives, the chat path's for the same greedy request
    (a schema keeps the answer a message); streamed, the text deltas carry them in order and the
    `.done` event and the completed response carry the whole list. Without `include` it stays empty."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A number"}], max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=2, response_format={"type": "json_schema", "json_schema": {**fmt, "name": "n"}})
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    want = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert all(len(entry["top_logprobs"]) == 2 for entry in want)
    include: Any = ["message.output_text.logprobs"]
    kwargs: dict[str, Any] = dict(model="tiny", input="A number", max_output_tokens=10, temperature=0,
                                  text={"format": fmt})
    resp = client.responses.create(**kwargs, include=include, top_logprobs=2)
    part = next(item for item in resp.output if item.type == "message").content[0]
    assert part.text == chat.choices[0].message.content
    assert [entry.model_dump() for entry in part.logprobs] == want
    plain = client.responses.create(**kwargs)
    assert next(item for item in plain.output if item.type == "message").content[0].logprobs == []
    deltas: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    final: Any = None
    for event in client.responses.create(**kwargs, include=include, top_logprobs=2, stream=True):
        if event.type == "response.output_text.delta":
            deltas += [entry.model_dump() for entry in event.logprobs]
        elif event.type == "response.output_text.done":
            done = [entry.model_dump() for entry in event.logprobs]
        elif event.type == "response.completed":
            final = event.response
    assert deltas == want[:len(deltas)] and deltas and done == want
    streamed = next(item for item in final.output if item.type == "message").content[0]
    assert [entry.model_dump() for entry in streamed.logprobs] == want


def test_named_tool_choice(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER], max_output_tokens=48,
                                   tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    compact = re.sub(r"\s", "", call.arguments)
    if resp.status == "completed":
        assert json.loads(call.arguments)["unit"] in ("c", "f")
    else:
        assert any(doc.startswith(compact) for doc in ('{"unit":"c"}', '{"unit":"f"}')), compact


def expected_kinds(output: list[Any]) -> list[str]:
    """The event types a stream of these output items has, runs of deltas collapsed to one."""
    kinds = ["response.created", "response.in_progress"]
    for item in output:
        kinds.append("response.output_item.added")
        if item.type == "function_call":
            kinds += ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
        else:
            text = "reasoning_text" if item.type == "reasoning" else "output_text"
            kinds += ["response.content_part.added", f"response.{text}.delta", f"response.{text}.done",
                      "response.content_part.done"]
        kinds.append("response.output_item.done")
    return [*kinds, "response.completed"]


def collapse(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


@pytest.mark.parametrize("constrained", [False, True])
def test_stream_event_sequence(client: openai.OpenAI, tok: Any, constrained: bool) -> None:
    text = {"format": {"type": "json_object"}} if constrained else openai.NOT_GIVEN  # no reasoning split
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "Tell me"}],
                                 max_output_tokens=5, text=text) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert collapse(kinds) == expected_kinds(final.output)
    if constrained:
        assert [item.type for item in final.output] == ["message"]
    check_text_items(final)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    for index, item in enumerate(final.output):
        deltas = "".join(e.delta for e in events if e.type.endswith("_text.delta") and e.output_index == index)
        done = [e for e in events if e.type.endswith("_text.done") and e.output_index == index]
        assert [e.text for e in done] == [deltas] == [item.content[0].text]
        assert [e.item.id for e in events if e.type == "response.output_item.done" and e.output_index == index] \
            == [item.id]
    check_usage(final, prompt_tokens(tok, [{"role": "user", "content": "Tell me"}]), 5, tok)


def test_reasoning_split_matches_the_raw_output(client: openai.OpenAI, server: ServerProcess) -> None:
    """Greedy answers to one prompt: the raw completion, split by the parser here, is what chat
    (whole and streamed) and the Responses API answer with."""
    messages: list[Any] = [{"role": "user", "content": "Think first"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    raw = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text
    reasoning, content = reasoning_parser("deepseek_r1").split(raw)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    message = chat.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    hidden = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"include_reasoning": False}).choices[0].message
    assert (hidden.model_extra["reasoning_content"], hidden.content) == (None, content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == (content or "")
    resp = client.responses.create(model="tiny", input=messages, max_output_tokens=8, temperature=0)
    assert reasoning_of(resp) == (reasoning or "")
    assert resp.output_text == (content or "")


def test_store_get_delete_and_previous_response(client: openai.OpenAI, server: ServerProcess, tok: Any) -> None:
    first = client.responses.create(model="tiny", input="First question", max_output_tokens=3)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    follow = client.responses.create(model="tiny", input="Second question", previous_response_id=first.id,
                                     max_output_tokens=3)
    conversation = [{"role": "user", "content": "First question"},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Second question"}]
    check_usage(follow, prompt_tokens(tok, conversation), 3, tok)
    assert follow.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # the store keeps the 2 newest (--responses-store-size 2): follow is pushed out by two more
    client.responses.create(model="tiny", input="y", max_output_tokens=2)
    client.responses.create(model="tiny", input="z", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "top_k": -5}, "top_k"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice.function.name"),
])
def test_bad_requests_name_the_field(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_ids_are_404(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert httpx.delete(f"{server.url}/v1/responses/resp_nope", timeout=30).status_code == 404
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "model": "other"}, timeout=30)
    assert r.status_code == 404


# ---------------------------------------------------------------------- a recorded reasoning model's output

RECORDED = ('<think>\nThe user wants the weather.\n</think>\n\nChecking.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"unit": "c"}}\n</tool_call>')


def recorded_run(stream: bool) -> tuple[ResponsesRequest, ChatFormat, ResponseShell]:
    req = msgspec.convert({"input": "Weather?", "tools": [WEATHER], "stream": stream}, ResponsesRequest)
    chat, _ = chat_request(req, [])
    fmt = ChatFormat(chat, None, tool_parser("hermes"), "resp_1", "m", 0, reasoning_parser("deepseek_r1"))
    return req, fmt, ResponseShell("resp_1", "m", 0, req)


def test_recorded_reasoning_and_call_whole() -> None:
    _, fmt, _ = recorded_run(False)
    final = RequestOutput("r", None, [1, 2], [CompletionOutput(0, RECORDED, [5] * 20, finish_reason="stop")],
                          finished=True)
    items, thought = output_items(fmt.response(final))
    assert thought == "\nThe user wants the weather.\n"
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert items[1]["content"][0]["text"] == "\n\nChecking."
    assert (items[2]["name"], json.loads(items[2]["arguments"])) == ("get_weather", {"unit": "c"})


class _Tok:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [0] * len(text.split())}


@pytest.mark.parametrize("step", [1, 4])
def test_recorded_reasoning_and_call_streamed(step: int) -> None:
    _, fmt, shell = recorded_run(True)
    stored: list[dict[str, Any]] = []
    stream = ResponsesStream(shell, fmt, _Tok(), stored.append)
    parts = [RECORDED[i:i + step] for i in range(0, len(RECORDED), step)]
    events = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, part, [5], finish_reason="stop" if last else None)],
                            finished=last)
        events += stream.chunks(0, out)
    events += stream.tail()
    decoded = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in events]
    kinds = [d["type"] for d in decoded]
    assert all(e.startswith(f"event: {k}\n".encode()) for e, k in zip(events, kinds, strict=True))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for d in decoded] == list(range(len(decoded)))
    thought = "".join(d["delta"] for d in decoded if d["type"] == "response.reasoning_text.delta")
    assert thought == "\nThe user wants the weather.\n"
    final = decoded[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert json.loads(final["output"][2]["arguments"]) == {"unit": "c"}
    assert final["usage"]["output_tokens"] == len(parts)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len(thought.split())
    assert stored == [final]


def test_tokenize_uses_the_server_template(server: ServerProcess, tok: Any) -> None:
    messages = [{"role": "user", "content": "Count me"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == prompt_tokens(tok, messages)


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path: Path) -> None:
    from troupe.server.launcher import chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template(str(path)) == TEMPLATE
    assert chat_template(TEMPLATE) == TEMPLATE
    assert chat_template(None) is None
    with pytest.raises(SystemExit, match="--chat-template: 'missing.jinja' is neither a file nor a Jinja template"):
        chat_template("missing.jinja")
