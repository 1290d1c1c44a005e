"""What a client written for vLLM's server expects of `troupe serve` (issue 40, items 3 to 5).

One real server (a tiny random Llama with the default model's tokenizer, its engine in its own
process) serves the module, started the way a vLLM deployment would start it: an API key, a
served name with a slash, a CORS origin list and `/tokenizer_info`. The clients are the openai SDK
and httpx; `/metrics` is read with prometheus_client's own parser. Requests use `ignore_eos`, so a
request of `max_tokens` k produces exactly k tokens whatever the random weights favour.

- metrics: vLLM's names, types, labels and buckets (unit tests on `ServerMetrics`, no server), and
  their values moving by exactly what the served requests' `usage` reported;
- auth and CORS: the key guards `/v1` only, the Bearer scheme in any case, preflights answered;
- small endpoints and fields: `/ping`, `/v1/models/{id}`, `/tokenizer_info`, integral floats,
  `store`, `truncate_prompt_tokens` (against the same prompt cut by hand), vLLM fields troupe does
  not honour refused by name, `multi_modal_data` refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

from troupe.errors import InvalidInputError
from troupe.inputs import ModelLimits, build_request, split_prompt
from troupe.messages import SchedulerStats
from troupe.sampling_params import SamplingParams
from troupe.server import metrics as metrics_mod
from troupe.server.metrics import ServerMetrics

KEY = "s3cret-key"
MODEL = "org/tiny"
MAX_MODEL_LEN = 256
ORIGIN = "http://ui.example"
ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
        "--enable-tokenizer-info-endpoint", "--allowed-origins", f'["{ORIGIN}"]']
EXACT = {"temperature": 0.0, "ignore_eos": True}  # greedy, and exactly max_tokens tokens


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess([str(tiny_llama), *ARGS], tmp_path_factory.mktemp("vllm-compat"), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels less model_name and engine) -> value; checks those two labels are there."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine", "le")))
            if "le" not in s.labels:
                out[(s.name, rest)] = s.value
    return out


# ---------------------------------------------------------------------- metric definitions (no server)

# vLLM's v1 PrometheusStatLogger: name -> type
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0]


def bucket_bounds(family: Any) -> list[float]:
    """The finite bucket bounds of engine 0's series."""
    return [float(s.labels["le"]) for s in family.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf" and s.labels["engine"] == "0"]


def test_metric_names_types_labels_and_buckets() -> None:
    """Every exported vLLM metric has vLLM's type, labels (model_name, engine; finished_reason on
    request_success, all four reasons at 0 from the start) and buckets (TTFT as vLLM lists them;
    token counts 1-2-5 up to max_model_len); the engine gauges are read at scrape time per engine."""
    stats = {0: SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=40,
                               prefix_cache_hits=16, num_preemptions=1),
             1: SchedulerStats(num_running=1)}
    m = ServerMetrics("m", lambda: stats)
    m.configure(max_model_len=300, num_engines=2)
    fams = families(m.render().decode())
    assert {name: fams[name].type for name in VLLM_TYPES} == VLLM_TYPES
    assert not [n for n in fams if not n.startswith(("vllm:", "troupe:"))]
    for name in VLLM_TYPES:
        for s in fams[name].samples:
            keys = set(s.labels) - {"le"}
            assert keys == ({"model_name", "engine", "finished_reason"} if name == "vllm:request_success"
                            else {"model_name", "engine"}), (name, s.labels)
    assert {s.labels["engine"] for s in fams["vllm:num_requests_running"].samples} == {"0", "1"}
    assert {(s.labels["engine"], s.labels["finished_reason"]) for s in fams["vllm:request_success"].samples
            if s.name.endswith("_total")} == {(e, r) for e in "01" for r in ("stop", "length", "abort", "error")}
    gauges = {(s.name, s.labels["engine"]): s.value for n in VLLM_TYPES if n.startswith("vllm:") for s in fams[n].samples}
    assert gauges[("vllm:num_requests_running", "0")] == 3 and gauges[("vllm:num_requests_waiting", "0")] == 2
    assert gauges[("vllm:kv_cache_usage_perc", "0")] == 0.25
    assert gauges[("vllm:prefix_cache_queries_total", "0")] == 40 and gauges[("vllm:prefix_cache_hits_total", "0")] == 16
    assert gauges[("vllm:num_preemptions_total", "0")] == 1 and gauges[("vllm:num_requests_running", "1")] == 1
    assert bucket_bounds(fams["vllm:time_to_first_token_seconds"]) == VLLM_TTFT
    assert bucket_bounds(fams["vllm:request_prompt_tokens"]) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert bucket_bounds(fams["vllm:request_params_n"]) == [1, 2, 5, 10, 20]
    assert bucket_bounds(fams["vllm:e2e_request_latency_seconds"]) == list(metrics_mod.REQUEST_LATENCY_BUCKETS)
    assert metrics_mod.buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


# ---------------------------------------------------------------------- metrics of served requests


def test_metrics_move_by_what_was_served(client: openai.OpenAI, server: ServerProcess) -> None:
    """Three engine requests (a completion, one with n=2, a streamed chat): request counts, token
    totals and every histogram's count and sum move by exactly what the responses' usage and the
    requests' parameters say. /metrics is scraped without the key (vLLM guards /v1 only)."""
    before = samples(httpx.get(f"{server.url}/metrics", timeout=30).text)
    usages, lengths, ns, max_tokens = [], [], [], []
    for n, k in ((1, 3), (2, 4)):
        resp = client.completions.create(model=MODEL, prompt=f"count to {k}", max_tokens=k, n=n,
                                         temperature=1.0 if n > 1 else 0.0, extra_body={"ignore_eos": True})
        usages.append(resp.usage)
        lengths.append([k] * n)
        ns.append(n)
        max_tokens.append(k)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                 temperature=0.0, extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    lengths.append([5])
    ns.append(1)
    max_tokens.append(5)
    after = samples(httpx.get(f"{server.url}/metrics", timeout=30).text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    prompt = sum(u.prompt_tokens for u in usages if u)
    completion = sum(u.completion_tokens for u in usages if u)
    assert completion == sum(sum(x) for x in lengths) == 3 + 8 + 5
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == completion
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion
    assert delta("vllm:request_max_num_generation_tokens_sum") == sum(max(x) for x in lengths)
    assert delta("vllm:request_params_n_sum") == sum(ns)
    assert delta("vllm:request_params_max_tokens_sum") == sum(max_tokens)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_params_n"):
        assert delta(f"vllm:{name}_count") == 3, name
    intervals = sum(k - 1 for x in lengths for k in x)
    assert delta("vllm:inter_token_latency_seconds_count") == intervals
    assert delta("vllm:time_per_output_token_seconds_count") == intervals
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum") > 0
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:num_requests_waiting", ())] == 0
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", ())] <= 1.0
    assert after[("vllm:prefix_cache_queries_total", ())] >= after[("vllm:prefix_cache_hits_total", ())]


# ---------------------------------------------------------------------- auth and CORS


def test_the_key_guards_v1_only_with_any_case_of_bearer(server: ServerProcess) -> None:
    """As vLLM's AuthenticationMiddleware: /v1 paths need the key, other paths are open; the scheme
    is case-insensitive; a wrong key, another scheme or no header is a 401 OpenAI error body."""
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path in ("/health", "/ping", "/metrics", "/version"):
            assert anon.get(path).status_code == 200, path
        assert anon.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        for header in (None, f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer"):
            resp = anon.get("/v1/models", headers={"Authorization": header} if header else {})
            assert resp.status_code == 401, header
            assert resp.json()["error"]["code"] == "invalid_api_key"
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert anon.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200, scheme


def test_cors_preflight_and_origin_headers(server: ServerProcess) -> None:
    """--allowed-origins '["http://ui.example"]': a preflight from it is answered without the key
    (as vLLM lets OPTIONS through), a response to it carries Access-Control-Allow-Origin; another
    origin's preflight is refused and its responses carry no CORS header."""
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        ok = anon.options("/v1/chat/completions", headers={"Origin": ORIGIN, **pre})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in ok.headers["access-control-allow-methods"]
        bad = anon.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        resp = anon.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN
        assert "access-control-allow-origin" not in anon.get("/health", headers={"Origin": "http://evil.example"}).headers


# ---------------------------------------------------------------------- small endpoints


def test_ping_model_card_and_tokenizer_info(client: openai.OpenAI, http: httpx.Client, tiny_llama: Path) -> None:
    """/ping answers GET and POST as /health; /v1/models/{id} (a name with a slash) is its card and an
    unknown id a 404 OpenAI error; /tokenizer_info names the tokenizer, its special tokens, chat
    template and folder (what lm-eval's remote tokenizer and `--tokenizer` options need)."""
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())  # the folder's own files: the oracle
    template_file = tiny_llama / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else config["chat_template"]
    info = http.get("/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (config["bos_token"], config["eos_token"],
                                                                         config["pad_token"])
    assert info["chat_template"] == template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert Path(info["name_or_path"]).resolve() == tiny_llama.resolve()


# ---------------------------------------------------------------------- request fields


def test_integral_floats_and_store_are_accepted(http: httpx.Client) -> None:
    """As vLLM's pydantic models: 5.0 for an integer field is 5, 5.5 stays a 400 naming the field;
    `store` is accepted (nothing is stored; the answer is the same)."""
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5.0, "n": 1.0, "top_k": 3.0, **EXACT})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    for field in ("max_tokens", "n", "logprobs"):
        bad = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: 2.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "store": True, "top_logprobs": 2.0, "logprobs": True, **EXACT})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client) -> None:
    """truncate_prompt_tokens=k serves the prompt's last k tokens: the same greedy answer and usage
    as sending those k ids; -1 is max_model_len (a short prompt unchanged); 0 and more than
    max_model_len are 400s naming the field; chat truncates its rendered prompt too."""
    ids = list(range(100, 120))

    def complete(body: dict[str, Any]) -> httpx.Response:
        return http.post("/v1/completions", json={"max_tokens": 4, **EXACT, **body})

    cut = complete({"prompt": ids, "truncate_prompt_tokens": 5}).json()
    by_hand = complete({"prompt": ids[-5:]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == by_hand["choices"][0]["text"]
    assert complete({"prompt": ids, "truncate_prompt_tokens": -1}).json()["usage"]["prompt_tokens"] == len(ids)
    echoed = complete({"prompt": ids, "truncate_prompt_tokens": 5, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echoed["text"] == by_hand_echo(http, ids[-5:])
    assert len(echoed["logprobs"]["tokens"]) == 5 + 4
    for k in (0, MAX_MODEL_LEN + 1):
        resp = complete({"prompt": ids, "truncate_prompt_tokens": k})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", resp.text
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a long question " * 8}],
                                                   "max_tokens": 2, "truncate_prompt_tokens": 7, **EXACT})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 7


def by_hand_echo(http: httpx.Client, ids: list[int]) -> str:
    """The echoed text of `ids` sent as the whole prompt."""
    resp = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "echo": True, **EXACT})
    text: str = resp.json()["choices"][0]["text"]
    return text


@pytest.mark.parametrize(("field", "value"), [
    ("mm_processor_kwargs", {"num_crops": 4}), ("logits_processors", ["my.Processor"]),
    ("media_io_kwargs", {"video": {"num_frames": 8}}), ("best_of", 2), ("use_beam_search", True),
])
def test_vllm_fields_troupe_does_not_honour_are_refused(http: httpx.Client, field: str, value: Any) -> None:
    """A vLLM request field troupe cannot honour is a 400 naming it, never ignored."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text


def test_multimodal_prompts_are_refused() -> None:
    """LLM / AsyncLLM prompts: a dict with `multi_modal_data` (or vLLM's other non-text keys) is an
    InvalidInputError naming the key, not a text-only answer."""
    for key in ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds"):
        with pytest.raises(InvalidInputError) as err:
            split_prompt({"prompt": "describe", key: {"image": b"..."}})
        assert err.value.field == key
    assert split_prompt({"prompt": "hi", "multi_modal_data": None}) == ("hi", None)


def test_sampling_params_truncate_prompt_tokens() -> None:
    """SamplingParams(truncate_prompt_tokens=k) keeps the last k prompt ids at submission, as vLLM;
    -1 is max_model_len; 0, < -1, and more than max_model_len are refused naming the field."""
    limits = ModelLimits(vocab_size=1000, max_model_len=64, eos_token_ids=(2,))
    ids = list(range(10, 40))
    req = build_request(prompt_token_ids=ids, params=SamplingParams(truncate_prompt_tokens=4), limits=limits,
                        external_id="x")
    assert req.prompt_token_ids == ids[-4:] and req.max_tokens == 16
    assert build_request(prompt_token_ids=ids, params=SamplingParams(truncate_prompt_tokens=-1), limits=limits,
                         external_id="x").prompt_token_ids == ids
    for bad in (0, -2):
        with pytest.raises(InvalidInputError) as err:
            SamplingParams(truncate_prompt_tokens=bad)
        assert err.value.field == "truncate_prompt_tokens"
    with pytest.raises(InvalidInputError) as err:
        build_request(prompt_token_ids=ids, params=SamplingParams(truncate_prompt_tokens=65), limits=limits,
                      external_id="x")
    assert err.value.field == "truncate_prompt_tokens"
