"""A caller's own chat template renders as transformers renders it, within its bounds (troupe.chat_template):
a template that would run for hours or allocate gigabytes is refused in about its render deadline."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from troupe import AsyncLLM, SamplingParams
from troupe.errors import InvalidInputError
from troupe.inputs import render_chat
from troupe.limits import InputLimits
from troupe.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    """The default model's tokenizer and chat template (the tiny model carries them)."""
    return load_tokenizer(tiny_llama)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_bounded_render_equals_transformers(tokenizer: Any, messages: list[dict[str, str]],
                                                add_generation_prompt: bool) -> None:
    """The model's own template text, sent as a caller's template, renders exactly as transformers'
    `apply_chat_template` renders it (special tokens in scope, the generation prompt, a continued final
    message)."""
    source = tokenizer.chat_template
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert render_chat(tokenizer, messages, add_generation_prompt, source) == want
    cont = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert render_chat(tokenizer, messages, False, source, continue_final_message=True) == cont
    bos = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert render_chat(tokenizer, messages, True, bos) == tokenizer.bos_token + "".join(m["content"] for m in messages)


LIMITS = InputLimits(max_chat_template_render_ms=300, max_chat_template_output_chars=100_000)
HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "max_chat_template_render_ms"),
    "a huge string": ("{{ 'a' * 10**10 }}", "max_chat_template_output_chars"),
    "a huge list": ("{{ ([1] * 10**9) | length }}", "max_chat_template_output_chars"),
    "a huge power": ("{{ 7 ** 100000000 }}", "max_chat_template_output_chars"),
    "output from loops": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
                          "max_chat_template_output_chars"),
    "a long template": ("x" * 70_000, "max_chat_template_chars"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_refused_within_its_deadline(tokenizer: Any, name: str) -> None:
    """Each is an InvalidInputError naming chat_template and the limit it broke, within the 300 ms render
    deadline plus a margin (none of them allocates its result)."""
    source, limit = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match=f"chat_template.*input limit {limit}"):
        render_chat(tokenizer, CONVERSATIONS[0], True, source, limits=LIMITS)
    assert time.monotonic() - started < 2.0


async def test_the_engine_refuses_a_hostile_template_and_serves_the_next(tiny_llama: Path) -> None:
    """Through `AsyncLLM.chat`: the hostile template's request fails with the limit named; the engine
    then serves a chat with a plain caller's template."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    async with AsyncLLM(str(tiny_llama), dtype="float32", num_threads=1, log_stats_interval_s=None,
                        input_limits=InputLimits(max_chat_template_render_ms=300)) as llm:
        with pytest.raises(InvalidInputError, match="max_chat_template_render_ms"):
            async for _ in llm.chat(CONVERSATIONS[0], params, chat_template=HOSTILE["nested loops"][0]):
                pass
        outs = [o async for o in llm.chat(CONVERSATIONS[0], params,
                                          chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")]
        assert outs[-1].prompt == "Hello there" and len(outs[-1].outputs[0].token_ids) == 3
