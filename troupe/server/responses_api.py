"""The Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` (as vLLM's server).

A Responses request is translated into a chat completion request (`chat_request`) and run on the
chat path (`serving.start_chat`: model check, sampling parameters, chat template, structured
outputs, tool and reasoning parsers); only the answer's shape differs (`responses_output.py`).

1. Input: `input` as text (one user message) or a list of items: messages (`role` user, system,
   developer or assistant; `content` text or `input_text` / `output_text` parts), `function_call`
   items (an assistant's earlier calls) and `function_call_output` items (tool results); `reasoning`
   items are dropped (the chat template gets no reasoning). `instructions` is a leading system
   message. `previous_response_id` prepends a stored response's conversation and answer.
2. Fields: `max_output_tokens` (max_tokens), `temperature`, `top_p`, `text.format` (`json_schema`
   and `json_object` become chat's `response_format`, so structured outputs force them), function
   `tools` (flat: `{"type": "function", "name", "parameters", ...}`) with `tool_choice` (`auto`,
   `none`, `required`, `{"type": "function", "name"}`), `parallel_tool_calls`, `reasoning.effort`
   (the template's `reasoning_effort`), and vLLM's sampling extras (`top_k`, `min_p`, `seed`, ...).
   `include: ["message.output_text.logprobs"]` with `top_logprobs` (0..20) puts each generated
   token's logprob (and its top alternatives) on the `output_text` part and on each
   `response.output_text.delta`; every other `include` value, other tool types, `truncation="auto"`
   and `background=true` are a 400 naming the field.
3. Output items, in order: a `reasoning` item (with a reasoning parser, when the model reasoned),
   a `message` with one `output_text` part (when there is text, or no other item: an empty
   answer is an empty message), one `function_call` item per tool call. `status` is `completed`, or `incomplete` with
   `incomplete_details.reason = "max_output_tokens"` when the length limit cut it; `usage` counts
   input, output and reasoning tokens.
4. Streaming (`stream=true`): SSE `event:` / `data:` pairs, each with a `sequence_number`:
   `response.created`, `response.in_progress`, then per item `response.output_item.added`,
   `response.content_part.added`, `response.output_text.delta` (`response.reasoning_text.delta`;
   function calls: `response.function_call_arguments.delta`), the matching `.done` events,
   `response.content_part.done`, `response.output_item.done`, and last `response.completed` with the
   whole response (also when the length limit cut it: then its `status` is `incomplete`, as vLLM
   sends it; the openai SDK's `get_final_response` needs that event). No `[DONE]`.
5. `store` (default true, as OpenAI): the finished response is kept in `ResponseStore`, a bounded
   in-memory map (`troupe serve --responses-store-size`, oldest dropped first), for `GET` and
   `DELETE /v1/responses/{id}` and `previous_response_id`. It does not survive a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from troupe.server.chat import ChatCompletionRequest
from troupe.server.errors import APIError, bad_request
from troupe.server.protocol import Int64, NumLogprobs, PositiveInt
from troupe.server.responses_output import (
    ResponseShell,
    ResponsesStream,
    count_tokens,
    new_id,
    output_items,
    usage_body,
)
from troupe.server.serving import gather_finals, json_response, read_body, server_state, start_chat
from troupe.server.sse import EventStream

_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses` (see the module docstring)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: NumLogprobs | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool = False
    service_tier: str | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    priority: Int64 = 0
    request_id: str | None = None


# ---------------------------------------------------------------------- request -> chat


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{j}]", f"only input_text / output_text parts are supported, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (module docstring, step 1)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role", f"must be one of {list(_ROLES)}, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise bad_request(where, "a function_call item needs `name` and `arguments` (JSON text)")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id", "a function_call_output item needs `call_id`")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else msgspec.json.encode(output).decode()})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}.type", f"input items of type {kind!r} are not supported; troupe takes "
                                               "message, function_call, function_call_output and reasoning")
    return out


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}].type", f"only function tools are supported, got {tool.get('type')!r}")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name", "a function tool needs a `name`")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema is None:
        raise bad_request("text.format.schema", "type json_schema needs `schema`")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema,
                                                   "strict": fmt.strict}}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                              list[dict[str, Any]]]:
    """The chat completion request that answers `req`, and the conversation (without instructions)
    that a later `previous_response_id` continues."""
    if req.background:
        raise bad_request("background", "background responses are not supported by troupe")
    if req.truncation == "auto":
        raise bad_request("truncation", "only 'disabled' is supported: troupe does not drop input items to fit")
    for i, item in enumerate(req.include or []):
        if item != LOGPROBS_INCLUDE:
            raise bad_request(f"include[{i}]", f"only {LOGPROBS_INCLUDE!r} is supported, got {item!r}")
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    if req.top_logprobs and not logprobs:
        raise bad_request("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
    conversation = history + input_messages(req.input)
    if not conversation:
        raise bad_request("input", "must hold at least one message")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "stream": req.stream, "top_k": req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "seed": req.seed, "stop": req.stop,
        "priority": req.priority, "request_id": req.request_id,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "logprobs": logprobs or None, "top_logprobs": req.top_logprobs if logprobs else None,
    }
    # a value chat refuses (a msgspec.ValidationError naming the field) is a 400 like chat's
    chat = msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    return chat, conversation


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as chat messages, for `previous_response_id`."""
    out: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            out.extend(input_messages([item]))
    return out or [{"role": "assistant", "content": ""}]  # it only reasoned: an empty turn




# ---------------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # the input messages and the answer, for previous_response_id


@dataclass
class ResponseStore:
    """Finished responses with `store=true`, the `capacity` newest kept (module docstring, step 5)."""

    capacity: int
    _items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[body["id"]] = StoredResponse(body, conversation + assistant_messages(body["output"]))
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        found = self._items.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response with id {response_id!r} (store=true keeps the "
                                "newest --responses-store-size responses, in memory)",
                           param="response_id", code="response_not_found")
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def response_store(request: Request) -> ResponseStore:
    app_state = request.app.state
    store: ResponseStore | None = getattr(app_state, "responses_store", None)
    if store is None:
        store = app_state.responses_store = ResponseStore(server_state(request).settings.responses_store_size)
    return store


# ---------------------------------------------------------------------- endpoints


async def create_response(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    req = await read_body(request, ResponsesRequest, state.settings.max_body_bytes)
    store = response_store(request)
    history = store.get(req.previous_response_id).conversation if req.previous_response_id else []
    chat, conversation = chat_request(req, history)
    run = await start_chat(request, chat, arrival)
    shell = ResponseShell(new_id("resp"), run.model, int(time.time()), req)
    fmt = run.formatter(shell.id)

    def keep(body: dict[str, Any]) -> None:
        if req.store:
            store.put(body, conversation)

    if req.stream:
        return EventStream([run.source], ResponsesStream(shell, fmt, run.tokenizer, keep))
    finals = await gather_finals(request, [run.source])
    if finals is None:
        return Response(status_code=499)
    answer = fmt.response(finals[0])
    items, thought = output_items(answer)
    incomplete = answer.choices[0].finish_reason == "length"
    body = shell.body("incomplete" if incomplete else "completed", items,
                      usage_body(answer.usage.prompt_tokens, answer.usage.completion_tokens, count_tokens(run.tokenizer, thought)),
                      incomplete)
    keep(body)
    return json_response(body)


async def retrieve_response(request: Request) -> Response:
    return json_response(response_store(request).get(request.path_params["response_id"]).body)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    response_store(request).delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})
