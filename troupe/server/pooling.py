"""The pooling endpoints of a server started with `--runner pooling`: `POST /v1/embeddings`,
`/pooling`, `/score` (and `/v1/score`), `/rerank` (and `/v1/rerank`).

1. Read and decode the body (`pooling_protocol`), check the model name (404) and that the engine
   pools: a generating engine answers 400 naming `runner` (`--runner pooling`).
2. Build `PoolingParams` (`dimensions`, `normalize`, `truncate_prompt_tokens`: a 400 naming the field
   the engine's pooler cannot honour, e.g. `dimensions` on a model without Matryoshka support).
3. One engine request per prompt (`AsyncLLM.encode`), all at once, raced against the client's
   disconnect (which cancels them, so their requests are aborted).
4. Answer in vLLM's shapes; `usage.prompt_tokens` counts every prompt's tokens.

Scores (`/score`, `/rerank`) are bi-encoder scores, as vLLM's for an embedding model: the cosine
similarity of the two texts' embeddings (each distinct text embedded once).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any, Protocol, cast

import anyio
from starlette.requests import Request
from starlette.responses import Response

from troupe.errors import InvalidInputError, single_error
from troupe.inputs import render_chat, tokenize
from troupe.limits import check_prompts
from troupe.pooling import PoolerConfig, PoolingParams, PoolingRequestOutput, cosine, score_pairs
from troupe.server.chat import conversation
from troupe.server.errors import bad_request
from troupe.server.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    encode_vector,
)
from troupe.server.serving import OFFLOAD_CHARS, json_response, offload, read_body, request_id, server_state
from troupe.server.sse import cancel_on_disconnect
from troupe.server.state import ServerState

_INPUT_FIELDS = {"prompt": "input", "prompt_token_ids": "input"}  # engine-side names -> the body's


class PoolingClient(Protocol):
    """What the pooling endpoints need of the engine beyond `EngineClient`: `AsyncLLM` is one."""

    @property
    def pooler_config(self) -> PoolerConfig | None: ...

    def encode(self, prompt: Any, pooling_params: PoolingParams | None = None, request_id: str | None = None, *,
               priority: int = 0) -> Any: ...


def pooling_engine(state: ServerState) -> PoolingClient:
    """The engine, if it pools; else a 400 naming the runner."""
    llm = state.engine()
    if getattr(llm.config, "runner", "generate") != "pooling":
        raise bad_request("runner", "this endpoint needs a pooling model: the server was started with the generate "
                                    "runner; start it with --runner pooling to serve embeddings, pooling, score "
                                    "and rerank")
    return cast(PoolingClient, llm)


async def _encode_all(request: Request, llm: PoolingClient, prompts: Sequence[Any], params: PoolingParams,
                      base_id: str, priority: int) -> list[PoolingRequestOutput] | None:
    """Every prompt's output in order, or None if the client went away first."""
    results: list[PoolingRequestOutput | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        async with aclosing(llm.encode(prompts[i], params, rid, priority=priority)) as outputs:
            async for out in outputs:
                results[i] = out

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope)
            async with anyio.create_task_group() as work:
                for i in range(len(prompts)):
                    work.start_soon(one, i)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        leaf = single_error(group)
        if isinstance(leaf, InvalidInputError) and leaf.field in _INPUT_FIELDS:
            raise bad_request(_INPUT_FIELDS[leaf.field], str(leaf)) from None
        raise leaf from None
    if any(r is None for r in results):
        return None
    return cast(list[PoolingRequestOutput], results)


def _plain_ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def _tokenized(llm: Any, req: EmbeddingRequest) -> list[Any]:
    """The engine prompts of `req`; with `add_special_tokens: false` its texts tokenized here (a long
    one in a worker thread), since the engine would add them."""
    prompts: list[Any] = req.prompts()
    if req.add_special_tokens is not False:
        return prompts
    tok = llm.get_tokenizer()
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            prompts[i] = {"prompt_token_ids": await offload(len(p), functools.partial(_plain_ids, tok, p))}
    return prompts


async def _chat_prompt(state: Any, llm: Any, req: EmbeddingRequest, messages: list[Any]) -> dict[str, list[int]]:
    """vLLM's chat form of an embedding request: the conversation through the chat template (the
    request's own where the server trusts it, else the server's `--chat-template` if given, else the
    model's), tokenized without the tokenizer's special tokens unless `add_special_tokens` (the
    template writes its own), in a worker thread when long or when the template is the request's."""
    if req.chat_template is not None and not state.settings.trust_request_chat_template:
        raise bad_request("chat_template", "a request's own chat_template needs `troupe serve "
                                           "--trust-request-chat-template`")
    template = req.chat_template if req.chat_template is not None else state.settings.chat_template
    tok = llm.get_tokenizer()
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    limits = state.engine().config.input_limits
    turns = conversation(messages)

    def ids() -> list[int]:
        text = render_chat(tok, turns, req.add_generation_prompt, template, limits=limits, **kwargs)
        return tokenize(tok, text, bool(req.add_special_tokens))

    size = OFFLOAD_CHARS + 1 if req.chat_template is not None else sum(len(str(m.get("content", ""))) for m in turns)
    return {"prompt_token_ids": await offload(size, ids)}


async def _pool_request(request: Request) -> tuple[EmbeddingRequest, str, list[PoolingRequestOutput] | None]:
    state = server_state(request)
    req = await read_body(request, EmbeddingRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    llm = pooling_engine(state)
    req.check_form()
    params = req.pooling_params(req.dimensions, req.normalize)
    if req.messages is not None:
        prompts = [await _chat_prompt(state, llm, req, req.messages)]
    else:
        check_prompts(req.input, state.engine().config.input_limits)
        prompts = await _tokenized(llm, req)
    outs = await _encode_all(request, llm, prompts, params, request_id(request, req.request_id), req.priority)
    return req, model, outs


def _usage(outs: Sequence[PoolingRequestOutput]) -> PoolingUsage:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


async def create_embedding(request: Request) -> Response:
    req, model, outs = await _pool_request(request)
    if outs is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    data = [EmbeddingData(index=i, embedding=encode_vector(o.outputs.data.tolist(), req.encoding_format))
            for i, o in enumerate(outs)]
    rid = request.scope["state"]["request_id"]
    return json_response(EmbeddingResponse(id=f"embd-{rid}", created=int(time.time()), model=model, data=data,
                                           usage=_usage(outs)))


async def create_pooling(request: Request) -> Response:
    req, model, outs = await _pool_request(request)
    if outs is None:
        return Response(status_code=499)
    data = [PoolingData(index=i, data=encode_vector(o.outputs.data.tolist(), req.encoding_format))
            for i, o in enumerate(outs)]
    rid = request.scope["state"]["request_id"]
    return json_response(PoolingResponse(id=f"pool-{rid}", created=int(time.time()), model=model, data=data,
                                         usage=_usage(outs)))


async def _scores(request: Request, req: ScoreRequest | RerankRequest, first: list[str], second: list[str],
                  names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list[float], int] | None:
    """Cosine scores of the pairs of `first` x `second` (vLLM's pairing) and the prompt tokens used;
    `names`: the body's fields of the two sides, for errors."""
    state = server_state(request)
    llm = pooling_engine(state)
    for name, texts in zip(names, (first, second), strict=True):
        check_prompts(texts, state.engine().config.input_limits)
        for i, text in enumerate(texts):
            if not text:
                raise bad_request(f"{name}[{i}]" if len(texts) > 1 else name, "must not be empty")
    pairs = score_pairs(len(first), len(second))
    texts = list(dict.fromkeys(first + second))  # each distinct text embedded once
    outs = await _encode_all(request, llm, texts, req.pooling_params(), request_id(request, req.request_id),
                             req.priority)
    if outs is None:
        return None
    vectors = {t: o.outputs.data.tolist() for t, o in zip(texts, outs, strict=True)}
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return [cosine(vectors[first[i]], vectors[second[j]]) for i, j in pairs], tokens


async def create_score(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, ScoreRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    result = await _scores(request, req, first, second)
    if result is None:
        return Response(status_code=499)
    scores, tokens = result
    rid = request.scope["state"]["request_id"]
    return json_response(ScoreResponse(id=f"score-{rid}", created=int(time.time()), model=model,
                                       data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                       usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))


async def create_rerank(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, RerankRequest, state.settings.max_body_bytes)
    model = state.check_model(req.model)
    if not req.documents:
        raise bad_request("documents", "must not be empty")
    result = await _scores(request, req, [req.query], req.documents, ("query", "documents"))
    if result is None:
        return Response(status_code=499)
    scores, tokens = result
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        ranked = ranked[:req.top_n]
    results = [RerankResult(index=i, document=RerankDocument(text=req.documents[i]), relevance_score=scores[i])
               for i in ranked]
    rid = request.scope["state"]["request_id"]
    return json_response(RerankResponse(id=f"rerank-{rid}", model=model, usage=RerankUsage(total_tokens=tokens),
                                         results=results))
