"""`LLM`'s pooling methods (an engine started with `runner="pooling"`, docs/pooling.md): `encode`,
`embed` and `score`, with vLLM's signatures and outputs.

1. The prompts' `PoolingParams` are resolved (one for all, or one per prompt; `truncate_prompt_tokens`
   applied to each), then one coroutine runs in `LLM`'s portal (`_call`).
2. It starts one task per prompt on `AsyncLLM.encode`, all at once (the scheduler batches them), and
   gathers the outputs in input order; a tqdm bar counts prompts and prompt tokens/s.
3. A bad prompt raises its `InvalidInputError` (the other tasks are cancelled, so their requests are
   aborted), never an `ExceptionGroup`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from troupe.errors import InvalidInputError, single_error
from troupe.inputs import PromptType, per_prompt
from troupe.pooling import (
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    score_pairs,
)

if TYPE_CHECKING:
    from troupe.facades.async_llm import AsyncLLM


class PoolingMethods:
    """Mixed into `LLM`, which provides `_engine` (its `AsyncLLM`) and `_call` (run a coroutine function
    in the portal, Ctrl-C aware)."""

    _engine: AsyncLLM

    def _call(self, fn: Any, *args: Any) -> Any:
        raise NotImplementedError

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooled vector of every prompt (`outputs.data`, a float32 tensor), in input order.
        `truncate_prompt_tokens` (keep each prompt's last k tokens) overrides the params'; `pooling_task`:
        None or "embed" (the one task troupe's pooler runs)."""
        if pooling_task not in (None, "embed"):
            raise InvalidInputError("pooling_task", f"must be 'embed' (or None), got {pooling_task!r}")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = per_prompt(pooling_params, len(prompts), PoolingParams, "pooling_params", PoolingParams)
        if truncate_prompt_tokens is not None:
            params = [PoolingParams(dimensions=p.dimensions, normalize=p.normalize,
                                    truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        result: list[PoolingRequestOutput] = self._call(self._run_pooling, prompts, params, use_tqdm)
        return result

    def embed(self, prompts: PromptType | Sequence[PromptType], *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """`encode`, as vLLM's embeddings: `outputs.embedding` is a list of floats."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Bi-encoder scores: the cosine similarity of the embeddings of each pair (one `data_1` with
        every `data_2`, or two lists of the same length index by index, as vLLM pairs them)."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        try:
            pairs = score_pairs(len(first), len(second))
        except InvalidInputError as exc:  # the offline names of text_1 / text_2
            raise InvalidInputError(exc.field.replace("text_", "data_"), str(exc).partition(": ")[2]) from None
        outs = self.encode(first + second, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm)
        left, right = outs[:len(first)], outs[len(first):]
        return [ScoringRequestOutput(f"score-{k}", ScoringOutput(cosine(left[i].outputs.data.tolist(),
                                                                          right[j].outputs.data.tolist())),
                                     left[i].prompt_token_ids + right[j].prompt_token_ids)
                for k, (i, j) in enumerate(pairs)]

    async def _run_pooling(self, prompts: list[PromptType], params: list[PoolingParams],
                           use_tqdm: bool) -> list[PoolingRequestOutput]:
        results: list[PoolingRequestOutput | None] = [None] * len(prompts)
        bar = _TokenBar(len(prompts)) if use_tqdm else None

        async def one(i: int) -> None:
            async with contextlib.aclosing(self._engine.encode(prompts[i], params[i])) as outputs:
                async for out in outputs:
                    results[i] = out
                    if bar is not None:
                        bar.update(len(out.prompt_token_ids))

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        except BaseExceptionGroup as group:
            leaf = single_error(group)
            raise leaf from leaf.__cause__
        finally:
            if bar is not None:
                bar.close()
        assert all(r is not None for r in results), "a pooling request ended without its vector"
        return results  # type: ignore[return-value]



class _TokenBar:
    """tqdm over the prompts, with prompt tokens/s."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self._start = time.perf_counter()
        self._tokens = 0

    def update(self, prompt_tokens: int) -> None:
        self._tokens += prompt_tokens
        elapsed = max(time.perf_counter() - self._start, 1e-6)
        self._bar.set_postfix_str(f"in: {self._tokens / elapsed:.0f} tok/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
