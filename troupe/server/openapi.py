"""`openapi_document`: the server's OpenAPI 3.1 document (`GET /openapi.json`), as vLLM's server
publishes one.

The schemas are not written by hand: `msgspec.json.schema_components` derives them from the
request Structs the server decodes (`protocol.py`, strict: `additionalProperties: false`) and the
response Structs it encodes (`responses.py`), so the document cannot drift from the code. Each
operation lists the statuses it can answer; every error status carries an `ErrorResponse`
(`{"error": {"message", "type", "param", "code"}}`). Streams (`"stream": true`) answer
`text/event-stream`: `data:` events holding the chunk schema named in the description, then
`data: [DONE]`.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec

from troupe.server import chat, pooling_protocol, protocol, responses

_REF = "#/components/schemas/{name}"
_REQUESTS: list[type] = [protocol.CompletionRequest, chat.ChatCompletionRequest, chat.TokenizeRequest,
                         protocol.DetokenizeRequest]
_RESPONSES: list[type] = [responses.CompletionResponse, responses.CompletionChunk, responses.ChatCompletionResponse,
                          responses.ChatCompletionChunk, responses.ModelList, responses.TokenizeResponse,
                          responses.DetokenizeResponse, responses.VersionResponse, responses.ErrorResponse]
_POOLING: list[type] = [pooling_protocol.EmbeddingRequest, pooling_protocol.ScoreRequest, pooling_protocol.RerankRequest,
                        pooling_protocol.EmbeddingResponse, pooling_protocol.PoolingResponse,
                        pooling_protocol.ScoreResponse, pooling_protocol.RerankResponse]
_ERRORS = {
    400: "invalid request: a field has a wrong type or value (`param` names it)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "body too large",
    415: "body is not application/json",
    500: "this request failed in the engine (finish_reason \"error\"); the engine serves on",
    503: "the engine is dead, not started, or the server is shutting down",
}


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=kind.__name__)}


def _json(kind: type) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(kind)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": _ERRORS[s], "content": _json(responses.ErrorResponse)} for s in statuses}


# One server-sent event, as an SSE parser hands it over: before OpenAPI 3.2 (no `itemSchema`) the schema of an
# event-stream media type describes each event (schemathesis checks every event of a streamed answer so).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk's JSON, or [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _generation(op_id: str, summary: str, request: type, answer: type, chunk: type) -> dict[str, Any]:
    ok = {"description": f"a `{answer.__name__}`; with `\"stream\": true`, SSE `data:` events of "
                         f"`{chunk.__name__}` and then `data: [DONE]`",
          "content": {**_json(answer), "text/event-stream": {"schema": SSE_EVENT}}}
    return {"post": {"operationId": op_id, "summary": summary,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": ok, **_errors(400, 401, 404, 413, 415, 500, 503)}}}


def _post(op_id: str, summary: str, request: type, answer: type) -> dict[str, Any]:
    return {"post": {"operationId": op_id, "summary": summary,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": {"description": "OK", "content": _json(answer)},
                                   **_errors(400, 401, 404, 413, 415, 503)}}}


def _get(op_id: str, summary: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"get": {"operationId": op_id, "summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _pooling_paths() -> dict[str, Any]:
    """A pooling server's endpoints (`--runner pooling`, `pooling.py`) in place of generation's."""
    p = pooling_protocol
    paths = {
        "/v1/embeddings": _post("createEmbedding", "Embeddings of texts or token ids", p.EmbeddingRequest,
                                p.EmbeddingResponse),
        "/pooling": _post("createPooling", "Pooled hidden states (vLLM's /pooling)", p.EmbeddingRequest,
                          p.PoolingResponse),
    }
    for path, op in (("/score", "score"), ("/v1/score", "scoreV1")):
        paths[path] = _post(op, "Cosine similarity of text_1 and text_2's embeddings", p.ScoreRequest, p.ScoreResponse)
    for path, op in (("/rerank", "rerank"), ("/v1/rerank", "rerankV1")):
        paths[path] = _post(op, "Documents ranked by similarity to the query", p.RerankRequest, p.RerankResponse)
    return paths


def openapi_document(*, api_key: bool = False, tokenizer_info: bool = False,
                     model_names: list[str] | None = None, pooling: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every endpoint (`api_key`: Bearer auth on the /v1 paths, as vLLM;
    `tokenizer_info`: the server has `/tokenizer_info`; `model_names`: the served names, the ids
    `/v1/models/{model}` knows; `pooling`: the server runs `--runner pooling`, whose endpoints replace
    the generation ones)."""
    _, schemas = msgspec.json.schema_components([*_REQUESTS, *_RESPONSES, *(_POOLING if pooling else [])],
                                                ref_template=_REF)
    paths = {
        "/v1/completions": _generation("createCompletion", "Text completion", protocol.CompletionRequest,
                                       responses.CompletionResponse, responses.CompletionChunk),
        "/v1/chat/completions": _generation("createChatCompletion", "Chat completion through the chat template",
                                            chat.ChatCompletionRequest, responses.ChatCompletionResponse,
                                            responses.ChatCompletionChunk),
        "/tokenize": _post("tokenize", "Prompt or chat messages to token ids", chat.TokenizeRequest,
                           responses.TokenizeResponse),
        "/detokenize": _post("detokenize", "Token ids to text", protocol.DetokenizeRequest,
                             responses.DetokenizeResponse),
        "/v1/models": _get("listModels", "The served model names",
                           {"description": "OK", "content": _json(responses.ModelList)}, 401, 503),
        "/version": _get("version", "troupe's version",
                         {"description": "OK", "content": _json(responses.VersionResponse)}, 401),
        "/health": _get("health", "200 while the engine is alive and making progress",
                        {"description": "healthy (empty body)"}, 503),
        "/v1/models/{model}": _get("retrieveModel", "One served model name's card",
                                   {"description": "OK", "content": _json(responses.ModelCard)}, 401, 404, 503),
        "/ping": {**_get("ping", "vLLM's /ping: as /health", {"description": "healthy (empty body)"}, 503),
                  "post": {"operationId": "pingPost", "summary": "vLLM's /ping: as /health",
                           "responses": {"200": {"description": "healthy (empty body)"}, **_errors(503)}}},
        "/metrics": _get("metrics", "Prometheus metrics",
                         {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                         401),
        "/openapi.json": _get("openapi", "This document",
                              {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}},
                              401),
    }
    if pooling:
        del paths["/v1/completions"], paths["/v1/chat/completions"]
        paths.update(_pooling_paths())
    paths["/v1/models/{model}"]["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True,
         "schema": {"type": "string", **({"enum": model_names} if model_names else {})}}]
    if tokenizer_info:
        paths["/tokenizer_info"] = _get("tokenizerInfo", "The tokenizer's class, special tokens and chat template",
                                        {"description": "OK", "content": {"application/json": {
                                            "schema": {"type": "object"}}}}, 503)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "troupe OpenAI-compatible server", "version": importlib.metadata.version("troupe")},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in paths.items():
        for op in item.values():
            if api_key and path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
            else:  # open paths (and every path without a key) never answer 401
                op["responses"].pop("401", None)
    return doc
