"""`troupe serve --runner pooling` through real clients: the openai SDK's `embeddings.create` (float
and base64, text and token-id inputs) and httpx for `/pooling`, `/score`, `/rerank` (and their `/v1`
forms), each vector or score checked against transformers' pooled hidden states (float32
`AutoModel` on the same tiny random Llama; the server's pooler set by `--pooler-config` to mean
pooling, normalized); bad input
is a 400 naming the field, and each runner's endpoints answer the other runner with a 400 naming it.

One pooling server serves the module; the generate-runner side runs in-process on a fake engine.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from pooling_oracle import hf_model, hf_pooled
from server_fakes import FakeEngine, serving
from server_process import ServerProcess

from troupe.models.loader import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ATOL = 1e-4
KIND = "MEAN"  # the server's pooler: --pooler-config over the default (last token), still normalized
TEXTS = ["The cat sat on the mat.", "Vectors let a search compare meaning.", "Hi"]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_llama), "--runner", "pooling", "--dtype", "float32", "--kv-cache-dtype", "float32",
            "--max-model-len", "64", "--num-threads", "1", "--in-process", "--served-model-name", "emb",
            "--pooler-config", '{"pooling_type": "mean"}', "--trust-request-chat-template"]
    with ServerProcess(args, tmp_path_factory.mktemp("pooling-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> dict[str, Any]:
    """transformers' vectors of TEXTS (tokenized as the server does: with the tokenizer's special tokens)."""
    hf = hf_model(tiny_llama)
    tok = load_tokenizer(tiny_llama)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    return {"ids": ids, "vectors": [hf_pooled(hf, p, KIND, True) for p in ids],
            "raw": hf_pooled(hf, ids[0], KIND, False), "cut": hf_pooled(hf, ids[1][-2:], KIND, True),
            "cut_0": hf_pooled(hf, ids[0][-2:], KIND, True)}


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=ATOL, rtol=0)


def test_openai_embeddings_float_and_base64(client: openai.OpenAI, http: httpx.Client, expected: dict[str, Any]) -> None:
    """The SDK's embeddings.create: float, and its default (base64, decoded by the SDK), equal to
    transformers'; usage.prompt_tokens counts every prompt; the raw base64 is little-endian float32."""
    floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model="emb", input=TEXTS)
    n_tokens = sum(len(p) for p in expected["ids"])
    for resp in (floats, b64):
        assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == "emb" and resp.object == "list"
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == n_tokens
        for d, want in zip(resp.data, expected["vectors"], strict=True):
            assert d.object == "embedding"
            close(d.embedding, want)
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), expected["vectors"][0])


def test_token_id_inputs_and_request_options(client: openai.OpenAI, expected: dict[str, Any]) -> None:
    """input as one id list and as a list of id lists; vLLM's normalize, truncate_prompt_tokens and
    add_special_tokens (extra_body) each change the result as transformers says."""
    ids = expected["ids"]
    one = client.embeddings.create(model="emb", input=ids[0], encoding_format="float")
    assert len(one.data) == 1
    close(one.data[0].embedding, expected["vectors"][0])
    many = client.embeddings.create(model="emb", input=ids[:2], encoding_format="float")
    for d, want in zip(many.data, expected["vectors"][:2], strict=True):
        close(d.embedding, want)
    raw = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float", extra_body={"normalize": False})
    close(raw.data[0].embedding, expected["raw"])
    cut = client.embeddings.create(model="emb", input=TEXTS[1], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    close(cut.data[0].embedding, expected["cut"])
    plain = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float",
                                     extra_body={"add_special_tokens": False}, user="someone")
    assert plain.usage.prompt_tokens == len(load_tokenizer_ids_without_specials(client, TEXTS[0], expected))


def load_tokenizer_ids_without_specials(client: openai.OpenAI, text: str, expected: dict[str, Any]) -> list[int]:
    """The server's own /tokenize of `text` without special tokens (the tiny model's tokenizer adds none
    or some: either way the count must match)."""
    base = str(client.base_url).removesuffix("/v1/")
    ids: list[int] = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return ids


def test_pooling_score_and_rerank(http: httpx.Client, expected: dict[str, Any]) -> None:
    """/pooling returns the vectors; /score and /rerank (and the /v1 forms) the cosine similarities of
    transformers' embeddings, rerank sorted best first and cut to top_n."""
    vec = expected["vectors"]
    pool = http.post("/pooling", json={"model": "emb", "input": TEXTS[:2]}).json()
    assert pool["object"] == "list" and [d["object"] for d in pool["data"]] == ["pooling", "pooling"]
    for d, want in zip(pool["data"], vec[:2], strict=True):
        close(d["data"], want)
    packed = base64.b64decode(http.post("/pooling", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
                              ["data"][0]["data"])
    close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), vec[0])
    cosines = [float(vec[0] @ v) for v in vec]
    cut = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1], "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["data"][0]["score"] == pytest.approx(float(expected["cut_0"] @ expected["cut"]), abs=ATOL)
    cut_rank = http.post("/rerank", json={"query": TEXTS[0], "documents": [TEXTS[1]], "truncate_prompt_tokens": 2,
                                          "user": "someone"}).json()
    assert cut_rank["usage"]["total_tokens"] == 4
    assert cut_rank["results"][0]["relevance_score"] == pytest.approx(cut["data"][0]["score"], abs=1e-6)
    for path in ("/score", "/v1/score"):
        score = http.post(path, json={"model": "emb", "text_1": TEXTS[0], "text_2": TEXTS}).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2]
        assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=ATOL)
        assert score["usage"]["prompt_tokens"] == sum(len(p) for p in expected["ids"])  # TEXTS[0] embedded once
    pairwise = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([float(vec[0] @ vec[1]), float(vec[1] @ vec[2])],
                                                                   abs=ATOL)
    order = sorted(range(3), key=lambda i: -cosines[i])
    for path in ("/rerank", "/v1/rerank"):
        rerank = http.post(path, json={"model": "emb", "query": TEXTS[0], "documents": TEXTS, "top_n": 2}).json()
        assert [r["index"] for r in rerank["results"]] == order[:2]
        assert [r["document"]["text"] for r in rerank["results"]] == [TEXTS[i] for i in order[:2]]
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([cosines[i] for i in order[:2]],
                                                                                  abs=ATOL)
    every = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS}).json()
    assert len(every["results"]) == 3


def test_openapi_lists_the_pooling_endpoints(http: httpx.Client) -> None:
    """A pooling server's /openapi.json has its endpoints and their schemas instead of generation's."""
    doc = http.get("/openapi.json").json()
    assert {"/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank"} <= set(doc["paths"])
    assert "/v1/completions" not in doc["paths"]
    assert {"input", "encoding_format", "dimensions"} <= set(doc["components"]["schemas"]["EmbeddingRequest"]["properties"])


def test_chat_messages_embed_the_rendered_conversation(http: httpx.Client, tiny_llama: Path) -> None:
    """vLLM's chat form of `/v1/embeddings` and `/pooling`: `messages` is one prompt, the conversation
    through the model's chat template without the tokenizer's special tokens and without a generation
    prompt unless asked; its vector equals transformers' for the ids of `apply_chat_template`, and
    usage counts those ids. A request's own `chat_template` (the server trusts them here) renders it."""
    tok = load_tokenizer(tiny_llama)
    hf = hf_model(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    lengths = {}
    for path, generation_prompt in (("/v1/embeddings", False), ("/pooling", True)):
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        resp = http.post(path, json={"model": "emb", "messages": messages, "encoding_format": "float",
                                     "add_generation_prompt": generation_prompt})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        vector = body["data"][0]["embedding" if path == "/v1/embeddings" else "data"]
        close(vector, hf_pooled(hf, ids, KIND, True))
        assert len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == len(ids)
        lengths[generation_prompt] = len(ids)
    assert lengths[True] > lengths[False]
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # the request's own template
    ids = tok("system: Be brief.\nuser: Name a colour.\n", add_special_tokens=False)["input_ids"]
    resp = http.post("/v1/embeddings", json={"messages": messages, "chat_template": own, "encoding_format": "float"})
    assert resp.status_code == 200, resp.text
    close(resp.json()["data"][0]["embedding"], hf_pooled(hf, ids, KIND, True))
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2], [99999999]]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "priority": 1}, "priority"),  # passed on: the server schedules fcfs
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {}, "input"),  # neither input nor messages
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),  # both
    ("/v1/embeddings", {"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/pooling", {"input": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ("/v1/embeddings", {"input": "x", "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                        "continue_final_message": True}, "continue_final_message"),
    ("/v1/embeddings", {"messages": []}, "messages"),
    ("/v1/embeddings", {"input": [[5] * 65]}, "input"),
    ("/pooling", {"input": "x", "normalize": "yes"}, "normalize"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/completions", {"prompt": "x"}, "runner"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "runner"),
    ("/v1/responses", {"input": "x"}, "runner"),
])
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    """Each bad field (or a generation endpoint on the pooling runner) is a 400 naming it."""
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_ids_and_model_names(http: httpx.Client) -> None:
    """The body's request_id names the answer (`embd-`, `pool-`, `score-`, `rerank-`) and is echoed in
    X-Request-Id; an unknown model is a 404 naming `model`."""
    for path, body, prefix in [("/v1/embeddings", {"input": "x"}, "embd"), ("/pooling", {"input": "x"}, "pool"),
                               ("/score", {"text_1": "a", "text_2": "b"}, "score"),
                               ("/rerank", {"query": "a", "documents": ["b"]}, "rerank")]:
        resp = http.post(path, json={**body, "request_id": "mine-1"})
        assert resp.json()["id"] == f"{prefix}-mine-1" and resp.headers["x-request-id"] == "mine-1"
        missing = http.post(path, json={**body, "model": "other"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_dimensions_refused_through_the_sdk(client: openai.OpenAI) -> None:
    """The SDK's `dimensions` on a model without Matryoshka support: BadRequestError naming it."""
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="emb", input="x", dimensions=8)
    assert "Matryoshka" in str(err.value) and err.value.body["param"] == "dimensions"  # type: ignore[index]


@pytest.mark.parametrize(("argv", "message"), [
    (["--pooler-config", "{"], "not JSON"), (["--pooler-config", "[1]"], "must be a JSON object"),
    (["--runner", "embed"], "invalid choice"),
])
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--pooler-config must be a JSON object and --runner one of the runners: argparse names the flag."""
    from troupe.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert message in err and argv[0] in err


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank"])
async def test_generate_runner_refuses_pooling_endpoints(path: str) -> None:
    """A server on the generate runner answers every pooling endpoint with a 400 naming the runner
    and the flag that would serve it."""
    body = {"input": "x", "text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
    async with serving(FakeEngine([])) as http:
        resp = await http.post(path, json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "runner" and "--runner pooling" in error["message"]
