"""`build_app`: the OpenAI-compatible Starlette app over an engine it is given.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (see `serving.py`), `POST /v1/responses`
with `GET` / `DELETE /v1/responses/{id}` (`responses_api.py`); with `--runner pooling`, `POST /v1/embeddings`,
`/pooling`, `/score`, `/v1/score`, `/rerank`, `/v1/rerank` (`pooling.py`; the other runner's endpoints
answer 400 naming the runner); `GET /v1/models`, `GET /v1/models/{id}`,
`GET /health`, `GET|POST /ping` (vLLM's, as /health), `GET /version`, `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info` (with `--enable-tokenizer-info-endpoint`), `GET /metrics` (`metrics.py`), and
`GET /openapi.json` (the OpenAPI 3.1 document of all of them, built from the request and response
Structs: `openapi.py`).

1. The lifespan enters `open_engine()` (normally `AsyncLLM(...)`) and holds it while the server runs;
   leaving it is the engine's usual shutdown cascade. The event-loop watchdog (`watchdog.py`) runs
   in the lifespan's task group.
2. Pure ASGI middleware, outermost first: `X-Request-Id` (validated, or a fresh id; echoed on
   every response), with `--allowed-hosts` the Host check, CORS (Starlette's `CORSMiddleware` with
   `--allowed-origins/-methods/-headers` and `--allow-credentials`, vLLM's defaults: any origin,
   no credentials), and, with an API key, vLLM's authentication: paths under `/v1` need
   `Authorization: Bearer <key>` (the scheme in any case; the key compared in constant time, by
   SHA-256 digests so its length does not show), everything else (`/health`, `/metrics`,
   `/tokenize`, ...) and CORS preflights (`OPTIONS`) are open. The HTTP edge below the app (header
   deadline, the protocol's own 400s) is `edge.py`.
3. Every error becomes an OpenAI error body through `errors.to_api_error`; unexpected ones are
   also re-raised to the server, which logs them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from troupe.errors import EngineDeadError, EngineGenerateError
from troupe.inputs import render_chat
from troupe.server import metrics as metrics_mod
from troupe.server.chat import TokenizeRequest, conversation, tool_dicts
from troupe.server.errors import APIError, bad_request, to_api_error
from troupe.server.openapi import openapi_document
from troupe.server.pooling import create_embedding, create_pooling, create_rerank, create_score
from troupe.server.protocol import DetokenizeRequest
from troupe.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from troupe.server.responses_api import create_response, delete_response, retrieve_response
from troupe.server.serving import (
    REQUEST_ID,
    create_chat_completion,
    create_completion,
    json_response,
    offload,
    read_body,
    server_state,
)
from troupe.server.state import EngineClient, ServerSettings, ServerState


def _error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status)


async def _send_error(send: Send, err: APIError) -> None:
    await _error_response(err)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class RequestIdMiddleware:
    """Use the client's `X-Request-Id` (or a fresh id) as the request id, and echo it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = dict(scope["headers"]).get(b"x-request-id")
        rid = raw.decode("latin-1") if raw is not None else uuid.uuid4().hex
        if not REQUEST_ID.fullmatch(rid):
            return await _send_error(send, bad_request("X-Request-Id", "must be 1 to 128 visible ASCII characters"))
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_from_header"] = rid, raw is not None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # the body's request_id may have replaced it
                header = (b"x-request-id", state["request_id"].encode("latin-1"))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BearerAuthMiddleware:
    """`Authorization: Bearer <api key>` on paths under `/v1` (vLLM's scope), the scheme in any case;
    401 otherwise. CORS preflights (`OPTIONS`) pass, as in vLLM."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = hashlib.sha256(api_key.encode()).digest()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.decode("latin-1").partition(" ")
        given = hashlib.sha256(key.strip().encode("latin-1")).digest()
        return secrets.compare_digest(given, self._expected) and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if (path == "/v1" or path.startswith("/v1/")) and \
                    not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                err = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
                return await _send_error(send, err)
        await self.app(scope, receive, send)


class AllowedHostsMiddleware:
    """With `--allowed-hosts`: a request whose Host header (less its port) is not one of them gets a 400
    naming `Host` (a DNS-rebinding page reaches a loopback server under its own host name)."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app = app
        self._hosts = {h.lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = host[:host.find("]") + 1] if host.startswith("[") else host.partition(":")[0]
            if name not in self._hosts:
                return await _send_error(send, bad_request("Host", f"this server answers Host {sorted(self._hosts)}, "
                                                                    f"not {host!r} (troupe serve --allowed-hosts)"))
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------- small endpoints


async def health(request: Request) -> Response:
    llm = server_state(request).engine()  # 503 while dead, not started or shutting down
    try:
        await llm.check_health()
    except EngineDeadError:
        raise
    except Exception as exc:  # e.g. EngineHungError: alive, but no progress
        raise APIError(503, f"the engine is unhealthy: {exc}", type="service_unavailable",
                       code="unhealthy") from exc
    return Response(status_code=200)


async def ping(request: Request) -> Response:
    """vLLM's `/ping` (GET and POST, for SageMaker): the same answer as /health."""
    return await health(request)


async def model_card(request: Request) -> Response:
    """`GET /v1/models/{id}`: one served name's card, or a 404 OpenAI error body."""
    state = server_state(request)
    name = state.check_model(request.path_params["model"])
    llm = state.engine()
    return json_response(ModelCard(id=name, created=state.created, owned_by="troupe", root=llm.config.model,
                                   max_model_len=llm.max_model_len))


async def tokenizer_info(request: Request) -> Response:
    """vLLM's `/tokenizer_info`: `tokenizer_class`, the tokenizer's init kwargs (its special tokens,
    `model_max_length`, ...: what a remote-tokenizer client such as lm-eval's reads) and the chat
    template, all as JSON."""
    llm = server_state(request).engine()
    tok = llm.get_tokenizer()
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    info.update(getattr(tok, "init_kwargs", {}) or {})
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        if value is not None:
            info[name] = str(value)
    info["chat_template"] = getattr(tok, "chat_template", None)
    info["model_max_length"] = llm.max_model_len
    return json_response(json.loads(json.dumps(info, default=str)))  # a tokenizer's odd values as text


async def version(request: Request) -> Response:
    return json_response(VersionResponse(version=importlib.metadata.version("troupe")))


async def models(request: Request) -> Response:
    state = server_state(request)
    llm = state.engine()
    data = [ModelCard(id=name, created=state.created, owned_by="troupe", root=llm.config.model,
                      max_model_len=llm.max_model_len)
            for name in state.settings.served_model_names]
    return json_response(ModelList(data=data))


async def openapi_endpoint(request: Request) -> Response:
    state = server_state(request)
    if state.openapi is None:  # built once, on first use
        state.openapi = msgspec.json.encode(openapi_document(
            api_key=bool(state.settings.api_key), tokenizer_info=state.settings.enable_tokenizer_info_endpoint,
            model_names=list(state.settings.served_model_names),
            pooling=state.llm is not None and getattr(state.llm.config, "runner", "generate") == "pooling"))
    return Response(state.openapi, media_type="application/json")


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=metrics_mod.CONTENT_TYPE)


async def tokenize_endpoint(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, TokenizeRequest, state.settings.max_body_bytes)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt", "give exactly one of `prompt` and `messages`")
    llm = state.engine()
    tok = llm.get_tokenizer()
    if req.messages is not None:
        text = render_chat(tok, conversation(req.messages), req.add_generation_prompt, state.settings.chat_template,
                           tools=tool_dicts(req.tools), limits=llm.config.input_limits)
        special = bool(req.add_special_tokens) if req.add_special_tokens is not None else False  # as chat does
    else:
        assert req.prompt is not None
        text, special = req.prompt, req.add_special_tokens is not False
    ids = await offload(len(text), lambda: list(tok(text, add_special_tokens=special)["input_ids"]))
    return json_response(TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=ids))


async def detokenize_endpoint(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, DetokenizeRequest, state.settings.max_body_bytes)
    state.check_model(req.model)
    llm = state.engine()
    bound = llm.config.input_limits.max_detokenize_tokens
    if len(req.tokens) > bound:
        raise bad_request("tokens", f"has {len(req.tokens)} ids; at most {bound} are accepted "
                                    "(input limit max_detokenize_tokens)")
    tok = llm.get_tokenizer()
    vocab = len(tok)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"tokens[{i}]", f"token id {t} is outside the vocabulary [0, {vocab})")
    text = await offload(len(req.tokens), lambda: str(tok.decode(req.tokens)))
    return json_response(DetokenizeResponse(prompt=text))


# ---------------------------------------------------------------------- errors


async def _handle_error(request: Request, exc: Exception) -> Response:
    return _error_response(to_api_error(exc))


async def _handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error_response(APIError(exc.status_code, str(exc.detail), code=None))


async def _handle_client_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # the client left while sending its body; nobody reads this


# ---------------------------------------------------------------------- the app


def build_app(settings: ServerSettings,
              open_engine: Callable[[], AbstractAsyncContextManager[EngineClient]]) -> Starlette:
    """The app; its lifespan runs `open_engine()` (see the module docstring)."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with open_engine() as llm, anyio.create_task_group() as tg:
            await tg.start(state.watchdog.run)
            state.metrics.configure(llm.max_model_len, getattr(llm.config, "data_parallel_size", 1))
            state.llm = llm
            try:
                yield
            finally:
                state.llm = None
                tg.cancel_scope.cancel()

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/embeddings", create_embedding, methods=["POST"]),
        Route("/pooling", create_pooling, methods=["POST"]),
        Route("/score", create_score, methods=["POST"]),
        Route("/v1/score", create_score, methods=["POST"]),
        Route("/rerank", create_rerank, methods=["POST"]),
        Route("/v1/rerank", create_rerank, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize_endpoint, methods=["POST"]),
        Route("/detokenize", detokenize_endpoint, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        # vLLM compatibility
        Route("/v1/models/{model:path}", model_card, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
    ]
    if settings.enable_tokenizer_info_endpoint:
        routes.append(Route("/tokenizer_info", tokenizer_info, methods=["GET"]))
    middleware = [Middleware(RequestIdMiddleware)]
    if settings.allowed_hosts:
        middleware.append(Middleware(AllowedHostsMiddleware, hosts=list(settings.allowed_hosts)))
    middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                                 allow_methods=list(settings.allowed_methods),
                                 allow_headers=list(settings.allowed_headers),
                                 allow_credentials=settings.allow_credentials))
    if settings.api_key:
        middleware.append(Middleware(BearerAuthMiddleware, api_key=settings.api_key))
    handlers: dict[Any, Callable[[Request, Exception], Any]] = {
        APIError: _handle_error,
        ValueError: _handle_error,  # InvalidInputError, msgspec errors
        msgspec.DecodeError: _handle_error,
        EngineDeadError: _handle_error,
        EngineGenerateError: _handle_error,  # one request failed (finish_reason "error"): 500, nothing to log twice
        HTTPException: _handle_http_exception,
        ClientDisconnect: _handle_client_disconnect,
        Exception: _handle_error,  # 500; the server also logs the traceback
    }
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.troupe = state
    return app
