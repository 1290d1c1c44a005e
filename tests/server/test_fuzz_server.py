"""`troupe serve` fuzzed against its own OpenAPI document with schemathesis (the real default model).

One real server (`troupe serve`, the default model, its engine in its own process, on loopback)
serves the module. Its `/openapi.json` is loaded as published; schemathesis draws requests for
every operation from it: bodies that fit the schema (positive) and bodies that break it
(negative: wrong types, missing fields, wrong content; unknown fields are ignored with a warning,
as vLLM's server does). The schema covers every field: n, logprobs, echo, penalties, logit_bias,
allowed_token_ids, bad_words, structured outputs (response_format, structured_outputs, guided_*),
tools and tool_choice. Generation stays cheap: any `max_tokens` / `max_completion_tokens` is capped
at `MAX_TOKENS` before the call (a chat without one gets it), which changes no case's validity since
the schema puts no bound on them, and `n` in the schema's range is capped at `MAX_N`.

For every response: schemathesis' conformance checks (a documented status, content type and
headers; a body that matches the documented schema); no 5xx at all (a 503 would mean the engine
died, a 500 a request failing on its own, neither of which a client can cause); every 4xx an
OpenAI error body `{"error": {"message", "type", "param", "code"}}`, whose `param` is set for a
400 about a body that was a JSON object. `/health` stays 200 (checked every `HEALTH_EVERY` cases and
at the end) and the engine never dies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import ServerProcess

from troupe.server.protocol import MAX_N as SCHEMA_MAX_N

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # hundreds of requests to a real server

MAX_TOKENS = 8
MAX_N = 3  # choices: each is an engine request
EXAMPLES = 300
GET_EXAMPLES = 5  # an operation without input: little to vary
HEALTH_EVERY = 25
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "256"], tmp_path_factory.mktemp("fuzz-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> Any:
    raw = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    loaded = schemathesis.openapi.from_dict(raw)
    loaded.config.update(base_url=server.url)
    return loaded


def test_the_document_covers_every_route(server: ServerProcess) -> None:
    """/openapi.json is an OpenAPI 3.1 document of every route, with the request and response
    schemas (strict request bodies) and an OpenAI error body for every error status."""
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                 "/v1/models", "/version", "/health", "/metrics", "/openapi.json",
                                 "/v1/models/{model}", "/ping"}
    schemas = doc["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert "additionalProperties" not in schemas["CompletionRequest"]  # unknown fields: ignored with a warning
    assert {"max_tokens", "n", "logprobs", "echo", "logit_bias", "response_format", "structured_outputs",
            "guided_json", "allowed_token_ids", "bad_words", "prompt_logprobs", "stream_options"} <= set(completion)
    assert {"tools", "tool_choice", "top_logprobs", "max_completion_tokens", "parallel_tool_calls"} <= set(chat)
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]
    assert "tool_calls" in schemas["ChatMessageOut"]["properties"]
    assert {"tokens", "token_logprobs", "top_logprobs", "text_offset"} <= set(schemas["CompletionLogprobs"]["properties"])
    assert set(schemas["ErrorInfo"]["required"]) == {"message", "type", "param", "code"}
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    event = post["responses"]["200"]["content"]["text/event-stream"]["schema"]  # one event (no itemSchema < 3.2)
    assert event["type"] == "object" and event["required"] == ["data"]


def cap_tokens(case: Any) -> None:
    """Keep generation short: cap what the schema leaves unbounded (see the module docstring)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap, top in (("max_tokens", MAX_TOKENS, None), ("max_completion_tokens", MAX_TOKENS, None),
                          ("n", MAX_N, SCHEMA_MAX_N)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap and (top is None or value <= top):
            body[key] = cap
    if case.path in ("/v1/chat/completions", "/v1/completions"):
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS


def check_error_body(case: Any, resp: Any) -> None:
    """Every 4xx: an OpenAI error body; a 400 about a JSON-object body names the field."""
    if not 400 <= resp.status_code < 500:
        return
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    sent_json = "application/json" in resp.request.headers.get("content-type", "")
    if resp.status_code == 400 and sent_json and isinstance(case.body, dict) and "not valid JSON" not in error["message"]:
        param = error["param"]
        assert isinstance(param, str) and (param or "" in case.body), error


class Tally:
    cases = 0
    by_mode: dict[str, int] = {}
    by_status: dict[int, int] = {}
    by_path: dict[str, int] = {}
    served_fields: dict[str, int] = {}  # top-level fields of generation requests answered 200


# Fields troupe accepts only at their neutral value (a 400 otherwise), the model name (a 404 unless
# it is the served one), priority (a 400 unless 0 under fcfs), a request's own chat template (a 400
# unless trusted), and the fields that must agree with others to be valid (one output constraint;
# tool_choice needs tools).
ONLY_NEUTRAL = ("best_of", "suffix", "use_beam_search", "length_penalty", "logprob_token_ids", "prompt_embeds",
                "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
                "thinking_token_budget", "stream_interval", "watermarking", "routed_experts_prompt_start",
                "truncation_side", "functions", "function_call", "modalities", "audio", "prediction",
                "logits_processors", "mm_processor_kwargs", "media_io_kwargs", "truncate_prompt_tokens", "service_tier", "guided_decoding_backend", "priority", "model", "chat_template", "request_id",
                "continue_final_message", "structured_outputs", "response_format", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "structural_tag", "guided_whitespace_pattern", "tool_choice", "top_logprobs",
                "prompt_logprobs", "stream_options")


VOCAB = 49152
ROLES = ("system", "developer", "user", "assistant", "tool")


MESSAGE_EXTRAS = ("name", "refusal", "annotations", "audio", "function_call", "tool_calls", "tool_call_id")


def _ints(value: Any) -> Any:
    """Integral floats as ints, all the way down: JSON Schema calls 448.0 an integer, the server
    (strict, as documented) does not."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return value


def steer(case: Any, data: st.DataObject) -> None:
    """Steer a positive case towards acceptance where the schema cannot say what is accepted
    (each step but the first with probability 1/2): integral floats as ints; drop the fields
    above; token ids into the vocabulary; chat messages to plain text ones of a known role."""
    if not isinstance(case.body, dict):
        return
    body = case.body = _ints(case.body)
    for key in ONLY_NEUTRAL:
        if key in body and data.draw(st.booleans(), label=f"drop {key}"):
            del body[key]
    for key in ("allowed_token_ids", "stop_token_ids"):
        value = body.get(key)
        if isinstance(value, list) and data.draw(st.booleans(), label=f"{key} in vocab"):
            body[key] = [t % VOCAB if isinstance(t, int) else t for t in value]
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and data.draw(st.booleans(), label="logit_bias keys"):
        body["logit_bias"] = {str(i % VOCAB): v for i, v in enumerate(bias.values())}
    for key in ("prompt", "tokens"):
        value = body.get(key)
        if isinstance(value, list) and data.draw(st.booleans(), label=f"{key} in vocab"):
            body[key] = [[t % VOCAB for t in x] if isinstance(x, list) else x % VOCAB if isinstance(x, int) else x
                         for x in value]
    messages = body.get("messages")
    if isinstance(messages, list) and data.draw(st.booleans(), label="plain messages"):
        for m in messages:
            if isinstance(m, dict):
                if m.get("role") not in ROLES:
                    m["role"] = "user"
                if not isinstance(m.get("content"), str):
                    m["content"] = "Hi!"
                for key in MESSAGE_EXTRAS:
                    m.pop(key, None)


def _fuzz(server: ServerProcess, strategy: Any, mode: GenerationMode, data: st.DataObject) -> None:
    case = data.draw(strategy, label="case")
    if mode is GenerationMode.POSITIVE:
        steer(case, data)
    cap_tokens(case)
    Tally.by_mode[mode.value] = Tally.by_mode.get(mode.value, 0) + 1
    resp = case.call(base_url=server.url, timeout=120)
    Tally.cases += 1
    Tally.by_status[resp.status_code] = Tally.by_status.get(resp.status_code, 0) + 1
    Tally.by_path[case.path] = Tally.by_path.get(case.path, 0) + 1
    assert resp.status_code < 500, (resp.status_code, resp.text, case.body)
    if resp.status_code == 200 and case.path.startswith("/v1/") and isinstance(case.body, dict):
        for key, value in case.body.items():
            if value is not None:
                Tally.served_fields[key] = Tally.served_fields.get(key, 0) + 1
    check_error_body(case, resp)
    case.validate_response(resp, checks=CHECKS)
    if Tally.cases % HEALTH_EVERY == 0:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def plan(schema: Any) -> list[tuple[Any, GenerationMode, int]]:
    """Every operation of the document, in both modes where it takes input (an operation without
    parameters or body has no negative case): (operation, mode, examples). The operations come
    from the document, not from a draw, so each is exercised by construction; operations without
    input get GET_EXAMPLES, the EXAMPLES left are shared by the others, a third of them negative."""
    operations = sorted((r.ok() for r in schema.get_all_operations()), key=lambda op: op.label)
    with_input = [op for op in operations if op.body or any(True for _ in op.iter_parameters())]
    each = (EXAMPLES - GET_EXAMPLES * (len(operations) - len(with_input))) // max(1, len(with_input))
    runs = []
    for op in operations:
        if op in with_input:
            runs += [(op, GenerationMode.POSITIVE, each - each // 3), (op, GenerationMode.NEGATIVE, each // 3)]
        else:
            runs.append((op, GenerationMode.POSITIVE, GET_EXAMPLES))
    return runs


def test_schemathesis_finds_no_5xx_and_no_engine_death(server: ServerProcess, schema: Any) -> None:
    """About EXAMPLES cases drawn from the published document: every operation, positive cases and,
    for those that take input, negative ones (`plan`); each passes the checks in the module
    docstring; the engine is alive at the end."""
    started = time.monotonic()
    runs = plan(schema)
    assert {op.path for op, _, _ in runs} == set(httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"])
    for op, mode, examples in runs:
        fuzz = settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=True,
                        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
            given(data=st.data())(_fuzz))
        fuzz(server, op.as_strategy(generation_mode=mode), mode)
    print(f"\nschemathesis: {Tally.cases} cases ({Tally.by_mode}) in {time.monotonic() - started:.1f} s, "
          f"statuses {Tally.by_status}, paths {Tally.by_path}, served fields {sorted(Tally.served_fields.items())}")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert server.proc is not None and server.proc.poll() is None


# ---------------------------------------------------------------------- issue 14's fields, combined

FEATURE_EXAMPLES = 80
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
           {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
           {"type": "string", "maxLength": 4}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMAS[0]}}
CONSTRAINTS = st.sampled_from([
    {}, {}, {}, {}, {}, {"response_format": {"type": "json_object"}},
    *({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}} for s in SCHEMAS),
    {"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_regex": "[a-c]{1,3}"}, {"guided_choice": ["up", "down"]},
    {"structured_outputs": {"grammar": 'root ::= "ok" | "no"'}},
    {"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                              "content": {"type": "regex", "pattern": "[xy]{1,3}"}}}},
    {"structured_outputs": {"structural_tag": json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMAS[0],
                                                                          "end": "</f>"}], "triggers": ["<f"]})}}])
TOKEN = st.integers(0, VOCAB - 1)


@st.composite
def feature_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A generation request combining issue 14's fields, drawn mostly valid."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, MAX_TOKENS)), "temperature": draw(st.sampled_from([0.0, 0.8])),
                            "seed": draw(st.integers(0, 9)), "n": draw(st.sampled_from([1, 1, 2]))}
    if body["temperature"] == 0.0:
        body["n"] = 1
    optional = {
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
        "allowed_token_ids": st.lists(TOKEN, min_size=1, max_size=4), "bad_words": st.lists(st.sampled_from(["the", " a", "x"]), max_size=2),
        "top_k": st.integers(-1, 50), "min_p": st.floats(0, 0.5), "min_tokens": st.integers(0, 2),
        "prompt_logprobs": st.integers(0, 3), "return_token_ids": st.booleans(), "stream": st.booleans(),
        "some_unknown_field": st.integers()}
    for key, strategy in optional.items():
        if draw(st.integers(0, 3)) == 0:
            body[key] = draw(strategy)
    if body.get("stream"):
        body.pop("prompt_logprobs", None)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": draw(st.booleans())}
    body.update(draw(CONSTRAINTS))
    forced = any(k in body for k in ("response_format", "structured_outputs", "guided_regex", "guided_choice"))
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["Hi", "Name a color", "JSON please"]))}]
        if draw(st.booleans()):
            body["logprobs"], body["top_logprobs"] = True, draw(st.integers(0, 5))
        if not forced and draw(st.booleans()):
            body["tools"] = [TOOL]
            body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]))
            forced = body["tool_choice"] not in ("auto", "none")
    if forced:  # token bans against a grammar can leave no token to sample: that request fails alone (a 500)
        for key in ("allowed_token_ids", "bad_words", "min_tokens"):
            body.pop(key, None)
    if chat:
        return "/v1/chat/completions", body
    body["prompt"] = draw(st.sampled_from(["Hello", ["One", "Two"], [1, 2, 3]]))
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    body["echo"] = draw(st.booleans())
    return "/v1/completions", body


def check_served(path: str, body: dict[str, Any], resp: httpx.Response) -> None:
    """What a 200 must hold: n choices per prompt with their indices, logprobs aligned with the
    tokens, usage adding up; a 400 names a field the request sent."""
    if resp.status_code == 400:
        param = resp.json()["error"]["param"] or ""
        assert param.split(".")[0].split("[")[0] in body, (param, body)
        return
    assert resp.status_code == 200, (resp.status_code, resp.text, json.dumps(body))
    prompts = 2 if body.get("prompt") == ["One", "Two"] else 1
    if body.get("stream"):
        events = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e and e != "data: [DONE]"]
        assert all("error" not in e for e in events), (events[-1], json.dumps(body))
        indices = {c["index"] for e in events for c in e["choices"]}
        assert indices == set(range(prompts * body["n"])), (indices, body)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0
        return
    data = resp.json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(prompts * body["n"]))
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for c in choices:
        lp = c.get("logprobs")
        if path == "/v1/completions" and body.get("logprobs") is not None:
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
            assert all(v is None or v <= 0 for v in lp["token_logprobs"])
        if path == "/v1/chat/completions" and body.get("logprobs"):
            assert all(len(e["top_logprobs"]) == body["top_logprobs"] for e in lp["content"])
        if body.get("return_token_ids"):
            assert len(c["token_ids"]) <= body["max_tokens"]
        if "allowed_token_ids" in body and body.get("return_token_ids") and not body.get("echo"):
            assert set(c["token_ids"]) <= set(body["allowed_token_ids"])


@settings(max_examples=FEATURE_EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(request=feature_request())
def _fuzz_features(server: ServerProcess, served: dict[str, int], request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    check_served(path, body, resp)
    served[str(resp.status_code)] = served.get(str(resp.status_code), 0) + 1


def test_issue_14_fields_combined(server: ServerProcess) -> None:
    """FEATURE_EXAMPLES requests drawing issue 14's fields together (n, logprobs, echo, penalties,
    logit_bias, allowed_token_ids, bad_words, prompt logprobs, every structured-output spelling, tools
    and each tool_choice, streaming with continuous usage, an unknown field): each is served with
    the shape its fields promise (`check_served`) or refused with a 400 naming one of them; the
    engine stays healthy. That each field is served at all is `test_each_field_served`'s, by
    construction, not a count of what was drawn here."""
    served: dict[str, int] = {}
    _fuzz_features(server, served)
    print(f"\nissue-14 fields: {sorted(served.items())}")
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
# One request per field (or value) that the combined fuzz draws, each served (a 200) on its own.
EACH_FIELD: dict[str, tuple[str, dict[str, Any]]] = {
    "n>1": (COMPLETIONS, {"prompt": "Hello", "n": 2, "temperature": 0.8, "seed": 3}),
    "logprobs+echo": (COMPLETIONS, {"prompt": ["One", "Two"], "logprobs": 3, "echo": True}),
    "chat logprobs": (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 2}),
    "penalties": (COMPLETIONS, {"prompt": [1, 2, 3], "presence_penalty": 1.5, "frequency_penalty": -1.0,
                                "repetition_penalty": 1.3}),
    "logit_bias": (COMPLETIONS, {"prompt": "Hello", "logit_bias": {"28": 50.0, "30": -100}}),
    "allowed_token_ids": (COMPLETIONS, {"prompt": "Hello", "allowed_token_ids": [28, 30, 260],
                                        "return_token_ids": True}),
    "bad_words": (COMPLETIONS, {"prompt": "Hello", "bad_words": ["the", " a"]}),
    "top_k+min_p+min_tokens": (COMPLETIONS, {"prompt": "Hello", "top_k": 5, "min_p": 0.1, "min_tokens": 2,
                                             "temperature": 0.8, "seed": 1}),
    "prompt_logprobs": (COMPLETIONS, {"prompt": "Hello", "prompt_logprobs": 2}),
    "stream": (COMPLETIONS, {"prompt": ["One", "Two"], "stream": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "chat stream": (CHAT, {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}),
    "unknown field": (COMPLETIONS, {"prompt": "Hello", "some_unknown_field": 7}),
    **{f"response_format[{i}]": (CHAT, {"messages": HI, **c}) for i, c in enumerate([
        {"response_format": {"type": "json_object"}},
        *({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}} for s in SCHEMAS),
        {"response_format": {"type": "structural_tag", "format": {
            "type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "regex", "pattern": "[xy]{1,3}"}}}}])},
    "structured_outputs.choice": (COMPLETIONS, {"prompt": "Hello", "structured_outputs": {"choice": ["yes", "no"]}}),
    "structured_outputs.grammar": (COMPLETIONS, {"prompt": "Hello",
                                                 "structured_outputs": {"grammar": 'root ::= "ok" | "no"'}}),
    "structured_outputs.structural_tag": (CHAT, {"messages": HI, "structured_outputs": {"structural_tag": json.dumps(
        {"structures": [{"begin": "<f>", "schema": SCHEMAS[0], "end": "</f>"}], "triggers": ["<f"]})}}),
    "guided_regex": (COMPLETIONS, {"prompt": "Hello", "guided_regex": "[a-c]{1,3}"}),
    "guided_choice": (CHAT, {"messages": HI, "guided_choice": ["up", "down"]}),
    **{f"tool_choice={name}": (CHAT, {"messages": HI, "tools": [TOOL], "tool_choice": choice})
       for name, choice in (("auto", "auto"), ("none", "none"), ("required", "required"),
                            ("named", {"type": "function", "function": {"name": "f"}}))},
}


@pytest.mark.parametrize("name", list(EACH_FIELD))
def test_each_field_served(server: ServerProcess, name: str) -> None:
    """Each field the combined fuzz draws, on its own request built for it: served (a 200) with the
    shape its fields promise (`check_served`)."""
    path, body = EACH_FIELD[name]
    body = {"max_tokens": MAX_TOKENS, "n": 1, **body}
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    check_served(path, body, resp)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
