"""`POST /v1/chat/completions` and `/tokenize` request bodies: messages, tools, tool choice.

The conversation goes to the chat template as transformers takes it (`ChatCompletionRequest.template_inputs`):
text content (content parts joined), `name`, an assistant's `tool_calls` (their JSON `arguments`
parsed into objects, as HF templates expect) and a tool message's `tool_call_id`; the request's `tools`
as the template's `tools`; `documents`, `reasoning_effort` and `chat_template_kwargs` as template
variables. A template that ignores tools (the default model's) shows the model none of them.

Tool choice (`tool_mode`): `none` (no parsing), `auto` (hermes-style calls parsed from the output, when
the server's tool parser is on), `required` and a named function (the output is forced into the call's
JSON with structured outputs: `troupe.tools.schema`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from troupe.server.errors import bad_request
from troupe.server.protocol import GenerationRequest, NumLogprobs, PositiveInt
from troupe.tools.schema import function_schema, required_tools_schema

_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # what SDKs echo back for assistant messages; must be empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (see the module docstring)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in _ROLES:
            raise bad_request(f"{where}.role", f"must be one of {list(_ROLES)}, got {m.role!r}")
        for field in ("audio", "function_call", "refusal"):
            if getattr(m, field) is not None:
                raise bad_request(f"{where}.{field}", f"`{field}` in messages is not supported by troupe")
        if m.annotations:
            raise bad_request(f"{where}.annotations", "`annotations` in messages are not supported")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise bad_request(f"{where}.tool_call_id", "only tool messages carry tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"{where}.content", "content is required")
        msg: dict[str, Any] = {"role": m.role, "content": _text_of(m.content, where)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    if not out:
        raise bad_request("messages", "must be a non-empty list of messages")
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]", "only {'type': 'text', 'text': str} content parts are "
                                                       f"supported, got type {part.get('type')!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def tool_dicts(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": msgspec.structs.asdict(t.function)} for t in tools]


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    """`POST /v1/chat/completions`: a conversation rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # no reasoning parser: there is no reasoning to leave out
    metadata: dict[str, str] | None = None
    # declared so that neutral values pass (fields.UNSUPPORTED)
    functions: list[Any] | None = None
    function_call: Any | None = None
    modalities: list[str] | None = None
    audio: Any | None = None
    prediction: Any | None = None
    store: bool | None = None  # OpenAI's stored completions: nothing is stored, the answer is the same
    service_tier: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def default_max_tokens(self) -> int | None:
        return None  # up to the context

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message", "cannot be combined with add_generation_prompt=true")
        if self.tools == []:
            raise bad_request("tools", "must not be empty; leave it out instead")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice", "needs `tools`")
        if isinstance(self.tool_choice, NamedToolChoice):
            self.named_tool()

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (see the module docstring)."""
        if not self.tools:
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    def named_tool(self) -> FunctionDef:
        assert isinstance(self.tool_choice, NamedToolChoice) and self.tools
        name = self.tool_choice.function.name
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function
        raise bad_request("tool_choice.function.name", f"no tool named {name!r} in `tools`")

    def extra_constraint(self) -> dict[str, Any] | None:
        mode = self.tool_mode
        if mode == "named":
            return function_schema(self.named_tool().parameters)
        if mode == "required":
            assert self.tools
            return required_tools_schema([(t.function.name, t.function.parameters) for t in self.tools])
        return None

    def template_inputs(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, keyword arguments) for `render_chat`."""
        kwargs: dict[str, Any] = dict(self.chat_template_kwargs or {})
        kwargs.update(add_generation_prompt=self.add_generation_prompt, chat_template=self.chat_template,
                      tools=tool_dicts(self.tools))
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return conversation(self.messages), kwargs

    def echo_prefix(self) -> str:
        """vLLM's chat `echo`: the last message's text when it is the assistant's (being continued)."""
        last = self.messages[-1]
        if self.echo and last.role == "assistant":
            return _text_of(last.content, f"messages[{len(self.messages) - 1}]")
        return ""


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or chat messages rendered by the chat template (with `tools`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as chat)
    add_generation_prompt: bool = True
