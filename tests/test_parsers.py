"""The reasoning and tool-call parsers on recorded model outputs (hand-written in each model's format).

Each output is parsed whole and streamed in deltas of 1, 2, 3 and 7 characters (a token is rarely
more than that, and every tag is cut somewhere); the stream must give the same reasoning, content
and calls as the whole parse, and both must give the expected split. Then the chat formatter
(`ChatFormat`) is fed the same outputs as engine deltas: `reasoning_content` streamed and not,
`include_reasoning=false`, tools read after the reasoning.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from troupe.outputs import CompletionOutput, RequestOutput
from troupe.server.chat import ChatCompletionRequest
from troupe.server.chat_format import ChatFormat
from troupe.tools.hermes import ToolCall
from troupe.tools.parsers import TOOL_PARSERS, tool_parser
from troupe.tools.reasoning import REASONING_PARSERS, reasoning_parser

STEPS = (1, 2, 3, 7)
Calls = list[tuple[str, dict]]


def pieces(text: str, step: int) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


# ---------------------------------------------------------------------- reasoning

REASONING_CASES = [
    # (parser, output, reasoning, content)
    ("deepseek_r1", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("deepseek_r1", "The template opened <think>.</think>Paris.", "The template opened <think>.", "Paris."),
    ("deepseek_r1", "Still thinking when the length limit hit", "Still thinking when the length limit hit", None),
    ("deepseek_r1", "<think></think>Direct answer, < and </ inside.", None, "Direct answer, < and </ inside."),
    ("qwen3", "<think>\n2 + 2 = 4\n</think>\n\nThe answer is 4.", "\n2 + 2 = 4\n", "\n\nThe answer is 4."),
    ("qwen3", "  <think>plan</think>done", "plan", "done"),
    ("qwen3", "No thinking here: <think> mid-text is content.", None, "No thinking here: <think> mid-text is content."),
    ("qwen3", "<think>cut off while thinking", "cut off while thinking", None),
    ("qwen3", "<thin", None, "<thin"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_whole_and_streamed(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    parser = reasoning_parser(name)
    assert parser.split(text) == (reasoning, content)
    for step in STEPS:
        stream = parser.stream()
        got_r, got_c = "", ""
        for piece in pieces(text, step):
            r, c = stream.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = stream.finish()
        assert ((got_r + r) or None, (got_c + c) or None) == (reasoning, content), step


def test_reasoning_stream_releases_as_it_goes() -> None:
    """Reasoning is released before `</think>` arrives; only a possible tag start is held back."""
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<think>abc") == ("abc", "")
    assert stream.feed("</th") == ("", "")
    assert stream.feed("ink>ans") == ("", "ans")
    assert not stream.thinking


def test_unknown_reasoning_parser_named() -> None:
    with pytest.raises(ValueError, match="granite.*deepseek_r1"):
        reasoning_parser("granite")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


# ---------------------------------------------------------------------- tool calls

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME: tuple[str, dict] = ("get_time", {})
TOOL_CASES = [
    # (parser, output, content, calls)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', "Let me check.\n", [WEATHER]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [WEATHER, TIME]),
    ("hermes", "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {}}', None, [WEATHER, TIME]),
    ("llama3_json", "The weather in Paris is mild {usually}.", "The weather in Paris is mild {usually}.", []),
    ("llama3_json", '{"not_a_call": 1}', '{"not_a_call": 1}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [WEATHER, TIME]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{}', "Checking.", [WEATHER, TIME]),
    ("mistral", "Plain [TOOL answer", "Plain [TOOL answer", []),
    ("mistral", "[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time()]', None, [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', None, [WEATHER]),
    ("pythonic", "[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
    ("pythonic", "[get_weather(__import__('os').system('x'))]", "[get_weather(__import__('os').system('x'))]", []),
    ("pythonic", "Sure, here you go.", "Sure, here you go.", []),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>", "Let me check.\n", [WEATHER]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                    "celsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
                    "</tool_call>", None, [WEATHER, TIME]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", None, [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "Use <tool_call> like this: <function>", "Use <tool_call> like this: <function>", []),
    ("qwen3_coder", "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
]


def as_calls(calls: list) -> Calls:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), TOOL_CASES)
def test_tool_calls_whole_and_streamed(name: str, text: str, content: str | None, calls: Calls) -> None:
    parser = tool_parser(name)
    whole = parser.parse(text)
    assert as_calls(whole.tool_calls) == calls
    assert whole.content == (content if calls else text)
    for step in STEPS:
        stream = parser.stream()
        got_text, got_calls = "", list[ToolCall]()
        for piece in pieces(text, step):
            c, done = stream.feed(piece)
            got_text, got_calls = got_text + c, got_calls + done
        c, done = stream.finish()
        got_text, got_calls = got_text + c, got_calls + done
        assert as_calls(got_calls) == calls, step
        # (hermes streams the white space between blocks; the chat formatter drops it beside calls)
        assert (got_text.strip() if calls else got_text) == ((content or "").strip() if calls else text), step


CODER_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"}, "ratio": {"type": "number"},
    "dry_run": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": "string"}, "code": {"type": "string"}}}}}]
CODER_OUTPUT = ("<tool_call>\n<function=edit>\n<parameter=path>\n007.py\n</parameter>\n<parameter=line>\n12\n</parameter>\n"
                "<parameter=scale>\n2.0\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
                "<parameter=dry_run>\nfalse\n</parameter>\n<parameter=options>\n{'a': [1, 2]}\n</parameter>\n"
                "<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
                "<parameter=code>\ndef f():\n    return \"\\\\n\"\n\n</parameter>\n<parameter=extra>\n42\n</parameter>\n"
                "</function>\n</tool_call>")
CODER_ARGS = {"path": "007.py", "line": 12, "scale": 2.0, "ratio": 0.5, "dry_run": False, "options": {"a": [1, 2]},
              "tags": ["x", "y"], "note": None, "code": 'def f():\n    return "\\\\n"\n', "extra": "42"}


def test_qwen3_coder_values_typed_by_the_request_schema() -> None:
    """Raw-text values become what the tool's schema says (a string stays text even when it looks like a
    number; a Python-literal object is read without evaluation; a parameter not in the schema is text;
    one newline each side is the format's, the code value's own trailing newline and escapes are kept),
    whole and streamed; without the schema every value is text."""
    parser = tool_parser("qwen3_coder").for_tools(CODER_TOOLS)
    assert as_calls(parser.parse(CODER_OUTPUT).tool_calls) == [("edit", CODER_ARGS)]
    for step in STEPS:
        stream = parser.stream()
        calls = [c for piece in pieces(CODER_OUTPUT, step) for c in stream.feed(piece)[1]] + stream.finish()[1]
        assert as_calls(calls) == [("edit", CODER_ARGS)], step
    untyped = json.loads(tool_parser("qwen3_coder").parse(CODER_OUTPUT).tool_calls[0].arguments)
    assert untyped["line"] == "12" and untyped["dry_run"] == "false" and untyped["options"] == "{'a': [1, 2]}"
    assert tool_parser("hermes").for_tools(CODER_TOOLS) == tool_parser("hermes")


def test_plain_text_is_released_at_once() -> None:
    """Text that cannot start a call is content as it arrives, not at the end."""
    for name in TOOL_PARSERS:
        stream = tool_parser(name).stream()
        assert stream.feed("Hello")[0] == "Hello", name


def test_unknown_tool_parser_named() -> None:
    with pytest.raises(ValueError, match="granite.*hermes"):
        tool_parser("granite")


# ---------------------------------------------------------------------- through the chat formatter

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat_format(body: dict, tools: str | None = "hermes", reasoning: str | None = "qwen3") -> ChatFormat:
    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest)
    return ChatFormat(req, None, tool_parser(tools) if tools else None, "chatcmpl-1", "m", 0,
                      reasoning_parser(reasoning) if reasoning else None)


def outputs(text: str, step: int) -> list[RequestOutput]:
    parts = pieces(text, step)
    return [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, p, [7], finish_reason="stop" if i == len(parts) - 1
                                                                   else None)], finished=i == len(parts) - 1)
            for i, p in enumerate(parts)]


RECORDED = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')


def out_calls(calls: object) -> Calls:
    assert isinstance(calls, list)
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_chat_message_reasoning_then_tools() -> None:
    final = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, RECORDED, [7] * 9, finish_reason="stop")],
                          finished=True)
    message = chat_format({"tools": TOOLS}).response(final).choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.reasoning_content == "\nThe user wants the weather.\n"
    assert message.message.content is None
    assert out_calls(message.message.tool_calls) == [("get_weather", {"city": "Paris"})]
    hidden = chat_format({"tools": TOOLS, "include_reasoning": False}).response(final).choices[0].message
    assert hidden.reasoning_content is None
    assert out_calls(hidden.tool_calls) == out_calls(message.message.tool_calls)
    plain = chat_format({}, tools=None, reasoning=None).response(final).choices[0].message
    assert plain.content == RECORDED and "reasoning_content" not in msgspec.json.decode(msgspec.json.encode(plain))


@pytest.mark.parametrize("step", [1, 5])
def test_chat_stream_reasoning_then_tools(step: int) -> None:
    fmt = chat_format({"tools": TOOLS, "stream": True})
    events = [e for out in outputs(RECORDED, step) for e in fmt.chunks(0, out)] + fmt.tail()
    chunks = [json.loads(e[len(b"data: "):]) for e in events if e != b"data: [DONE]\n\n"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nThe user wants the weather.\n"
    assert all(not d.get("content", "").strip() for d in deltas)  # the white space before the call at most
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # reasoning is streamed as it comes: the first reasoning delta is before the last output
    first = next(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert first < len(deltas) - 1
    hidden = chat_format({"tools": TOOLS, "stream": True, "include_reasoning": False})
    hidden_events = [e for out in outputs(RECORDED, step) for e in hidden.chunks(0, out)]
    assert b"reasoning_content" not in b"".join(hidden_events)
