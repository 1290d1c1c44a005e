"""A caller's own chat template, rendered under bounds: `render_bounded`.

The model's chat template is the operator's (it came with the model). A template sent with a request
(`LLM.chat(chat_template=...)`, the server's `chat_template` field behind
`--trust-request-chat-template`) is the caller's code: a template with nested `range` loops renders
for hours, `'a' * 10**10` asks for 10 GB. Such a template is rendered here, in the same sandbox and with
the same helpers as transformers' (its compiled environment's globals, filters and extensions), by an
environment that also

- refuses a `*` or `**` whose result would be over the output bound, before computing it;
- checks the render deadline at every call the template makes (`range`, filters, methods) and at
  every piece of output;
- streams the output (`Template.generate`) and stops once it is over `max_chat_template_output_chars`.

Each breach is an `InvalidInputError` naming `chat_template` and the input limit. The render still
runs in the caller's thread: callers put it on a worker thread (the input processor and the server do).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from troupe.errors import InvalidInputError
from troupe.limits import InputLimits


class _TemplateOverBound(Exception):
    """Raised inside the render when a bound is crossed; `render_bounded` turns it into the 400."""


class _Bounds(threading.local):
    """The render running in this thread: its deadline (monotonic seconds) and output bound."""

    deadline = float("inf")
    max_chars = 1 << 62


_bounds = _Bounds()
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox plus the deadline and the size bound of the render in this thread (`_bounds`)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            size, times = (len(left), right) if isinstance(left, str | list | tuple) else \
                (len(right), left) if isinstance(right, str | list | tuple) else (0, 0)
            if isinstance(times, int) and size * times > _bounds.max_chars:
                raise _TemplateOverBound("max_chat_template_output_chars")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * math.log2(abs(left)) > 8 * _bounds.max_chars:  # bits of the result: printing it is quadratic
            raise _TemplateOverBound("max_chat_template_output_chars")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805  # jinja's names
        if time.monotonic() > _bounds.deadline:
            raise _TemplateOverBound("max_chat_template_render_ms")
        return super().call(__context, __obj, *args, **kwargs)


@lru_cache(maxsize=16)
def _compile(source: str) -> Template:
    """The template compiled by a bounded environment carrying transformers' chat-template helpers."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # transformers' helpers are the same for every template: take them from an empty one (compiling the
    # caller's template there would fold its constants, `'a' * 10**10` included, with no bound)
    base = _compile_jinja_template("").environment
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[type(ext) for ext in base.extensions.values()])
    env.filters.update(base.filters)
    env.globals.update(base.globals)
    return env.from_string(source)


def render_bounded(tokenizer: Any, source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                   tools: Sequence[Mapping[str, Any]] | None, limits: InputLimits, **template_kwargs: Any) -> str:
    """`messages` through the caller's template `source`, as transformers renders a chat template (the
    tokenizer's special tokens, `tools`, `add_generation_prompt` and `template_kwargs` in scope), within
    `limits`' template size, output size and render time."""
    if len(source) > limits.max_chat_template_chars:
        raise InvalidInputError("chat_template", f"is {len(source)} characters long; at most "
                                f"{limits.max_chat_template_chars} are accepted (input limit max_chat_template_chars)")
    template = _compile(source)
    conversation = [dict(m) for m in messages]
    cont = bool(template_kwargs.pop("continue_final_message", False))
    if cont:  # as transformers: mark the final message's end, render, cut the text there
        conversation[-1]["content"] = str(conversation[-1].get("content", "")) + _CONTINUE_TAG
    scope = {**getattr(tokenizer, "special_tokens_map", {}), **template_kwargs,
             "messages": conversation, "tools": [dict(t) for t in tools] if tools else None,
             "add_generation_prompt": add_generation_prompt}
    _bounds.deadline = time.monotonic() + limits.max_chat_template_render_ms / 1000
    _bounds.max_chars = limits.max_chat_template_output_chars
    parts: list[str] = []
    size = 0
    try:
        for piece in template.generate(**scope):
            size += len(piece)
            if size > limits.max_chat_template_output_chars:
                raise _TemplateOverBound("max_chat_template_output_chars")
            if time.monotonic() > _bounds.deadline:
                raise _TemplateOverBound("max_chat_template_render_ms")
            parts.append(piece)
    except _TemplateOverBound as over:
        name = str(over)
        what = (f"renders more than {limits.max_chat_template_output_chars} characters"
                if name == "max_chat_template_output_chars"
                else f"takes longer than {limits.max_chat_template_render_ms} ms to render")
        raise InvalidInputError("chat_template", f"{what} (input limit {name})") from None
    text = "".join(parts)
    if cont:
        if _CONTINUE_TAG not in text:
            raise InvalidInputError("chat_template", "continue_final_message is set but the template does not render "
                                    "the final message's content")
        text = text[:text.rindex(_CONTINUE_TAG)]
    return text
