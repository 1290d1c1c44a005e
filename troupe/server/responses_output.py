"""The Responses API's answers: output items, the response object, and its event stream.

- `ResponseShell.body`: the `response` object (status, output items, usage, the request's fields
  echoed); `output_items`: a whole chat answer's items (a `reasoning` item when the model reasoned,
  a `message` when it answered or nothing else, a `function_call` per tool call).
- `ResponsesStream`: the SSE formatter for `sse.EventStream` over `ChatFormat.step` (the chat
  path's deltas, reasoning and tool calls already parsed): `event: TYPE` / `data: {...}` pairs
  numbered by `sequence_number`, from `response.created` to `response.completed` (the order is in
  `responses_api`'s module docstring and docs/server.md).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from troupe.outputs import RequestOutput
from troupe.server.chat_format import ChatFormat
from troupe.server.responses import ChatCompletionResponse, ChatDelta, ChatLogprobs

if TYPE_CHECKING:
    from troupe.server.responses_api import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(prompt: int, output: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + output}


@dataclass
class ResponseShell:
    """The response object's fields that echo the request."""

    id: str
    model: str
    created_at: int
    req: ResponsesRequest

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             incomplete: bool = False) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        kind = fmt.type if fmt is not None else "text"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": msgspec.structs.asdict(fmt) if fmt is not None and kind == "json_schema"
                     else {"type": kind}},
            "previous_response_id": req.previous_response_id, "store": req.store, "metadata": req.metadata or {},
            "reasoning": msgspec.structs.asdict(req.reasoning) if req.reasoning is not None else None,
            "truncation": req.truncation or "disabled", "user": req.user, "background": False,
            "service_tier": req.service_tier or "auto", "top_logprobs": req.top_logprobs or 0,
        }


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def response_logprobs(logprobs: ChatLogprobs | None) -> list[dict[str, Any]]:
    """The chat path's token logprobs in the Responses shape (`token`, `logprob`, `bytes`,
    `top_logprobs`); empty when the request did not include them."""
    if logprobs is None or not logprobs.content:
        return []
    return [msgspec.to_builtins(entry) for entry in logprobs.content]


def _message_item(text: str | None, status: str = "completed", item_id: str | None = None,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(chat: ChatCompletionResponse) -> tuple[list[dict[str, Any]], str | None]:
    """A whole chat answer's output items (module docstring, step 3), and its reasoning text. The
    message's `output_text` carries every generated token's logprob when the request included them."""
    message = chat.choices[0].message
    items = []
    thought = message.reasoning_content if isinstance(message.reasoning_content, str) else None
    if thought:
        items.append(_reasoning_item(thought))
    calls = message.tool_calls if not isinstance(message.tool_calls, msgspec.UnsetType) else []
    if message.content is not None or not items and not calls:
        items.append(_message_item(message.content or "", logprobs=response_logprobs(chat.choices[0].logprobs)))
    items.extend(_call_item(c.id, c.function.name, c.function.arguments) for c in calls)
    return items, thought


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **payload}) + b"\n\n"


class ResponsesStream:
    """The SSE formatter of one streamed response (module docstring, step 4), over `ChatFormat.step`."""

    def __init__(self, shell: ResponseShell, chat: ChatFormat, tokenizer: Any,
                 on_done: Any = None) -> None:
        self.shell = shell
        self.chat = chat
        self._tok = tokenizer
        self._on_done = on_done
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []
        self._prompt_tokens = 0
        self._tokens = 0
        self._reasoning: list[str] = []
        self._logprobs: list[dict[str, Any]] = []  # every generated token's (when included), in order
        self._sent_logprobs = 0  # how many of them a text delta carried already
        self._finish: str | None = None
        self._started = False

    def _emit(self, kind: str, **payload: Any) -> bytes:
        event = _event(kind, {**payload, "sequence_number": self._seq})
        self._seq += 1
        return event

    def _close(self) -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self._output)
        text = "".join(self._text)
        self._text = []
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=text, name=item["name"]))
        else:
            part = ({"type": "reasoning_text", "text": text} if item["type"] == "reasoning"
                    else {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs})
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": self._logprobs}
            events.append(self._emit(done, item_id=item["id"], output_index=index, content_index=0, text=text,
                                     **extra))
            events.append(self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
            item["content"] = [part]
        item["status"] = "completed"
        events.append(self._emit("response.output_item.done", output_index=index, item=item))
        self._output.append(item)
        return events

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._open = item
        index = len(self._output)
        events.append(self._emit("response.output_item.added", output_index=index, item=dict(item)))
        if item["type"] == "reasoning":
            events.append(self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            events.append(self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                            "logprobs": []}))
        return events

    def _kind(self) -> str | None:
        return None if self._open is None else str(self._open["type"])

    def _delta_events(self, delta: ChatDelta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning_content:
            if self._kind() != "reasoning":
                events += self._open_item(_reasoning_item("", "in_progress"))
            self._text.append(delta.reasoning_content)
            self._reasoning.append(delta.reasoning_content)
            events.append(self._emit("response.reasoning_text.delta", item_id=self._open["id"],  # type: ignore[index]
                                     output_index=len(self._output), content_index=0,
                                     delta=delta.reasoning_content))
        if delta.content:
            if self._kind() != "message":
                events += self._open_item(_message_item(None, "in_progress"))
            self._text.append(delta.content)
            fresh, self._sent_logprobs = self._logprobs[self._sent_logprobs:], len(self._logprobs)
            events.append(self._emit("response.output_text.delta", item_id=self._open["id"],  # type: ignore[index]
                                     output_index=len(self._output), content_index=0, delta=delta.content,
                                     logprobs=fresh))
        for call in delta.tool_calls or []:
            fn = call.function
            if call.id is not None:  # a new call
                events += self._open_item(_call_item(call.id, fn.name if fn and fn.name else "", "", "in_progress"))
            if fn is not None and fn.arguments and self._kind() == "function_call":
                self._text.append(fn.arguments)
                events.append(self._emit("response.function_call_arguments.delta",
                                         item_id=self._open["id"],  # type: ignore[index]
                                         output_index=len(self._output), delta=fn.arguments))
        return events

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        events = []
        if not self._started:
            self._started = True
            self._prompt_tokens = len(out.prompt_token_ids or ())
            body = self.shell.body("in_progress", [], None)
            events.append(self._emit("response.created", response=body))
            events.append(self._emit("response.in_progress", response=body))
        for c in out.outputs:
            self._tokens += len(c.token_ids)
            self._logprobs += response_logprobs(self.chat.logprobs(c) if c.token_ids else None)
            delta, reason = self.chat.step(c)
            events += self._delta_events(delta)
            if reason is not None:
                self._finish = reason
        return events

    def tail(self) -> list[bytes]:
        events = self._close()
        if not self._output:  # nothing generated: an empty message, as a whole answer has
            events += self._open_item(_message_item(None, "in_progress"))
            events += self._close()
        incomplete = self._finish == "length"
        thought = "".join(self._reasoning)
        body = self.shell.body("incomplete" if incomplete else "completed", self._output,
                               usage_body(self._prompt_tokens, self._tokens, count_tokens(self._tok, thought)), incomplete)
        if self._on_done is not None:
            self._on_done(body)
        events.append(self._emit("response.completed", response=body))
        return events


def count_tokens(tokenizer: Any, text: str | None) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
