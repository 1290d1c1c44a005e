"""Issue 14's server features through the official `openai` client against a real `troupe serve` on
the default model (SmolLM2-135M-Instruct, float32): n choices, top logprobs and an echoed prompt's
logprobs equal to transformers' log-softmax on the same weights and tokens, JSON-schema outputs that
validate every time, tool calls the client parses, and a request full of vLLM-only fields served,
each field's effect checked.

One server serves the module; transformers' model is loaded once, on the converted default folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ATOL = 2e-3  # float32 engine vs float32 transformers: different kernels and summation order
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(["--dtype", "float32", "--kv-cache-dtype", "float32", "--quantization", "gguf", "--max-model-len", "1024", "--served-model-name", "smol"],
                       tmp_path_factory.mktemp("openai-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers' model on the converted default folder, float32."""
    from transformers import AutoModelForCausalLM

    from troupe.models.default_model import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), torch_dtype=torch.float32)
    return model.eval()


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row i is the log-softmax of the next token after ids[: i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def test_n_choices(client: openai.OpenAI) -> None:
    """n=2 gives two choices (index 0 and 1) in completions and chat, streamed and not; with a seed
    the pair is reproducible, and the usage counts both choices' tokens."""
    kw: dict[str, Any] = dict(model="smol", max_tokens=8, temperature=1.0, seed=11, n=2,
                              extra_body={"ignore_eos": True})
    first = client.completions.create(prompt=PROMPT, **kw)
    again = client.completions.create(prompt=PROMPT, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # seed + i per child
    assert first.usage is not None and first.usage.completion_tokens == 16
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Name a color."}], **kw)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    streamed = ["", ""]
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in first.choices]


def test_completion_top_logprobs_match_transformers(client: openai.OpenAI, hf: Any, server: ServerProcess) -> None:
    """logprobs=5, greedy: each generated token's logprob and its 5 alternatives equal transformers'
    log-softmax at that position (token ids via return_tokens_as_token_ids), and the greedy token is
    the top one."""
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    resp = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=5,
                                     extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    generated = [token_id(t) for t in lp.tokens]
    ref = hf_logprobs(hf, prompt_ids + generated)[len(prompt_ids) - 1: -1]  # the rows predicting each token
    for step, (tid, value, top) in enumerate(zip(generated, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert value is not None and top is not None
        assert abs(value - ref[step, tid].item()) < ATOL
        assert tid == int(ref[step].argmax())
        best = torch.topk(ref[step], 5)
        assert len(top) in (5, 6)
        got = {token_id(t): v for t, v in top.items()}
        for t, v in got.items():
            assert abs(v - ref[step, t].item()) < ATOL
        assert set(best.indices.tolist()) <= set(got) or best.values[4] - ref[step].topk(6).values[5] < ATOL


def test_chat_top_logprobs_match_transformers(client: openai.OpenAI, hf: Any, server: ServerProcess) -> None:
    """Chat logprobs=true, top_logprobs=3: the content entries' logprobs and top lists (ranked) equal
    transformers' on the rendered conversation."""
    messages = [{"role": "user", "content": "Say hello."}]
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    resp = client.chat.completions.create(model="smol", messages=messages, max_tokens=5, temperature=0.0,  # type: ignore[arg-type]
                                          logprobs=True, top_logprobs=3,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    generated = [token_id(e.token) for e in content]
    ref = hf_logprobs(hf, prompt_ids + generated)[len(prompt_ids) - 1: -1]
    for step, entry in enumerate(content):
        assert abs(entry.logprob - ref[step, generated[step]].item()) < ATOL
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        for t in entry.top_logprobs:
            assert abs(t.logprob - ref[step, token_id(t.token)].item()) < ATOL
        assert abs(values[0] - ref[step].max().item()) < ATOL


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_prompt_logprobs(client: openai.OpenAI, hf: Any, server: ServerProcess, max_tokens: int) -> None:
    """echo=true with logprobs: the text starts with the prompt, the prompt's tokens lead the logprobs
    (the first has none) with transformers' values; max_tokens=0 returns the prompt alone."""
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    resp = client.completions.create(model="smol", prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, echo=True,
                                     logprobs=1, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    assert choice.text.startswith(PROMPT) and (choice.text == PROMPT) == (max_tokens == 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    ids = [token_id(t) for t in lp.tokens]
    assert ids[:len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + max_tokens
    assert lp.token_logprobs[0] is None
    ref = hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        value = lp.token_logprobs[i]
        assert value is not None and abs(value - ref[i - 1, ids[i]].item()) < ATOL


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "color": {"enum": ["red", "green", "blue"]},
                         "favorite": {"type": "boolean"}},
          "required": ["name", "color", "favorite"], "additionalProperties": False}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_schema_output_validates_every_time(client: openai.OpenAI, endpoint: str) -> None:
    """response_format json_schema, sampled at temperature 1 with 4 seeds: every answer is JSON that
    validates against the schema, and ends because the JSON did (finish_reason stop)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    answers = []
    for seed in range(4):
        if endpoint == "chat":
            resp = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Describe a person as JSON."}],
                max_tokens=80, temperature=1.0, seed=seed, response_format=fmt)  # type: ignore[arg-type]
            answers += [(c.message.content or "", c.finish_reason) for c in resp.choices]
        else:
            comp = client.completions.create(model="smol", prompt="A person as JSON:", max_tokens=80,
                                             temperature=1.0, seed=seed, extra_body={"response_format": fmt})
            answers += [(c.text, c.finish_reason) for c in comp.choices]
    assert len(answers) == 4 and len({text for text, _ in answers}) > 1  # sampled, not one answer four times
    for text, reason in answers:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_is_parsed_by_the_client(client: openai.OpenAI, choice: str) -> None:
    """tool_choice required / a named function: the model's answer is a tool call the openai client
    parses, whose arguments validate against the tool's parameters; then a tool message and a
    follow-up answer in the same conversation."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                          tool_choice=tool_choice, max_tokens=80, temperature=0.0)
    message = resp.choices[0].message
    assert message.tool_calls, message
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in message.tool_calls:
        name = call.function.name  # type: ignore[union-attr]
        assert name in tools and (choice == "required" or name == "get_weather")
        jsonschema.validate(json.loads(call.function.arguments), tools[name]["function"]["parameters"])  # type: ignore[union-attr, index]
    assert resp.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    first = message.tool_calls[0]
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.id, "content": "18 degrees and sunny"}]
    follow = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=10,
                                            temperature=0.0)
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


def test_vllm_only_fields_are_served(client: openai.OpenAI, server: ServerProcess) -> None:
    """A request carrying vLLM's extra fields (and one nobody knows) is served, and each field that
    changes the answer does: allowed_token_ids bounds every token, logit_bias forces a token,
    bad_words keeps a word out, guided_choice / guided_regex / structured_outputs / structural tags constrain
    the text,
    prompt_logprobs and return_token_ids come back."""
    tokenize = httpx.post(f"{server.url}/tokenize", json={"prompt": " blue green", "add_special_tokens": False}).json()
    blue, green = tokenize["tokens"][:2]
    extra: dict[str, Any] = {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                             "allowed_token_ids": [blue, green], "return_token_ids": True, "prompt_logprobs": 2,
                             "skip_special_tokens": True, "spaces_between_special_tokens": True,
                             "include_stop_str_in_output": False, "stop_token_ids": [2],
                             "some_future_vllm_field": {"x": 1}}
    resp = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                     presence_penalty=0.5, frequency_penalty=0.2, extra_body=extra)
    data = resp.choices[0].model_extra or {}
    assert set(data["token_ids"]) <= {blue, green} and len(data["token_ids"]) == 6
    assert data["prompt_token_ids"] and len(data["prompt_logprobs"]) == len(data["prompt_token_ids"])
    assert data["prompt_logprobs"][0] is None
    forced = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0.0,
                                       logit_bias={str(green): 100.0}, extra_body={"return_token_ids": True})
    assert (forced.choices[0].model_extra or {})["token_ids"] == [green] * 3
    free = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0.0)
    word = next(w for w in free.choices[0].text.split() if w.isalpha())
    banned = client.completions.create(model="smol", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                       extra_body={"bad_words": [word]})
    assert word not in banned.choices[0].text.split()
    chat: dict[str, Any] = dict(model="smol", messages=[{"role": "user", "content": "Pick a color."}], max_tokens=20,
                                temperature=1.0, seed=5)
    picked = client.chat.completions.create(**chat, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].message.content in ("red", "green", "blue")
    code = client.chat.completions.create(**chat, extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", code.choices[0].message.content or "")
    obj = client.chat.completions.create(**chat, extra_body={"structured_outputs": {"json": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}})
    assert isinstance(json.loads(obj.choices[0].message.content or "")["ok"], bool)
    any_json = client.chat.completions.create(**{**chat, "max_tokens": 60}, response_format={"type": "json_object"})
    if any_json.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(any_json.choices[0].message.content or ""), dict)
    # structural tags: response_format's "format" form, and structured_outputs.structural_tag as an object
    tag = {"type": "tag", "begin": "<code>", "end": "</code>", "content": {"type": "regex", "pattern": "[A-Z]{3}"}}
    for body in ({"response_format": {"type": "structural_tag", "format": tag}},
                 {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": tag}}}):
        tagged = client.chat.completions.create(**chat, extra_body=body)
        assert re.fullmatch(r"<code>[A-Z]{3}</code>", tagged.choices[0].message.content or ""), body


def test_models_and_tokenize_report_the_resolved_context(server: ServerProcess) -> None:
    """/v1/models and /tokenize report the context the engine serves (--max-model-len 1024)."""
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 1024
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 1024


def test_streamed_logprobs_and_tool_call_equal_the_whole_answer(client: openai.OpenAI) -> None:
    """Greedy: the logprobs of the streamed chunks, concatenated, equal the whole answer's (text
    offsets continuing across chunks), and a streamed named tool call assembles to the whole one."""
    kw: dict[str, Any] = dict(model="smol", prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2,
                              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
                offsets += c.logprobs.text_offset or []
    assert whole is not None and tokens == whole.tokens and offsets == whole.text_offset
    assert all(abs(a - b) < 1e-6 for a, b in zip(values, whole.token_logprobs or [], strict=True))  # type: ignore[operator]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    chat: dict[str, Any] = dict(model="smol", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[WEATHER], tool_choice=named, max_tokens=60, temperature=0.0)
    call = client.chat.completions.create(**chat).choices[0].message.tool_calls[0]  # type: ignore[index]
    args, names = "", []
    for chunk in client.chat.completions.create(stream=True, **chat):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function and tc.function.name else []
                args += tc.function.arguments or "" if tc.function else ""
    assert names == ["get_weather"] and args == call.function.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])  # type: ignore[index]


def test_parameters_that_leave_no_token_get_a_400_and_the_engine_serves_on(server: ServerProcess) -> None:
    """allowed_token_ids = [the token of " the"] with bad_words = [" the"] masks every token: the request
    gets a 400 naming the conflict (not a 500: its own parameters are at fault), and the next request is
    served."""
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": " the", "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": tokens, "bad_words": [" the"]}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "every token is masked" in error["message"]
    assert error["param"] == "sampling parameters"
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
