"""Shared test factories: scheduler-side `Request`s, wire `AddRequest`s, the tiny
engine's options, random block tables for attention tests, and the check that a graph holds no request state. Importable from every test
folder (`pythonpath = ["tests"]`)."""

from __future__ import annotations

import itertools
import os
from typing import Any

import anyio
import torch

from troupe.core.request import Request
from troupe.messages import AddRequest
from troupe.sampling_params import SamplingParams

# Torch threads for a test's engine or model: the cores this process may run on, at most 2. Under
# pytest-xdist each worker holds one core (tests/conftest.py), and two threads on it only wait on each other.
CORES = min(2, len(os.sched_getaffinity(0)))

EOS = 2
_ids = itertools.count()

# a small engine for the tiny random Llama (`tiny_llama`): fast to build, room for 64 sequences
TINY_ENGINE: dict[str, Any] = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=256,
                                   num_kv_blocks=512, block_size=16)


def make_request(prompt: list[int] | int = 8, *, max_tokens: int = 16, eos: list[int] | None = [EOS],  # noqa: B006
                 arrival: float | None = None, rid: str | None = None, priority: int = 0,
                 **params: Any) -> Request:
    """A scheduler `Request`; an int prompt means that many tokens unique to this request (no
    accidental prefix hits). `arrival` defaults to the creation order."""
    n = next(_ids)
    tokens = [10_000 * (n + 1) + i for i in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(rid or f"r{n}", tokens, SamplingParams(max_tokens=max_tokens, **params), max_tokens, eos,
                   float(n) if arrival is None else arrival, priority)


def add_request(rid: str, prompt: list[int] | None = None, *, max_tokens: int = 4, external_id: str | None = None,
                rank: int | None = None, **params: Any) -> AddRequest:
    """A wire `AddRequest` (prompt [1, 2, 3] unless given); `params` are `SamplingParams` fields."""
    return AddRequest(rid, [1, 2, 3] if prompt is None else prompt, SamplingParams(max_tokens=max_tokens, **params),
                      max_tokens, external_id=rid if external_id is None else external_id,
                      data_parallel_rank=rank)


async def assert_idle(llm: Any) -> None:
    """No request state is left anywhere in the graph of `llm` (an AsyncLLM), the engine included."""
    graph = llm._graph
    assert graph is not None
    with anyio.fail_after(10):
        while True:
            stats = await llm.get_stats()
            # the published stats (what /metrics shows) come back to idle too, aborts included: the
            # engine publishes them right after it answers a utility call of the same batch
            published = all(st.num_running == 0 and st.num_waiting == 0 for st in llm.engine_stats.values())
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and published:
                break
            await anyio.sleep(0.01)
    assert graph.num_unfinished == 0
    assert not graph._table.processor.has_unfinished_requests()


def random_block_tables(seqs: list[tuple[int, int]], block_size: int, g: torch.Generator
                        ) -> tuple[list[list[int]], int]:
    """Block tables for sequences of (cached, new) tokens: each gets the blocks its context needs, drawn
    from a random permutation of a pool with 3 spare blocks, so the tables are shuffled and non-contiguous
    and a kernel that reads a wrong block reads another sequence's or a spare one. Returns (tables,
    num_blocks)."""
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    return tables, num_blocks


def engine_greedy(config: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy `new_tokens` for every prompt, all added at once to one `EngineCore(config)` and stepped to
    the end (the scheduler batches them as it does any requests): [tokens of each prompt]."""
    from troupe.core.engine_core import EngineCore
    from troupe.messages import AddRequest
    from troupe.sampling_params import SamplingParams

    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", p, params, new_tokens))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


def transformers_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `new_tokens` for each prompt alone (`model.generate`, no sampling, no eos stop)."""
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out
