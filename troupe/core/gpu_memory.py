"""Sizing the KV pool from the GPU's memory (`EngineConfig.gpu_memory_utilization`, as vLLM does).

After the weights are on the GPU, `profile` runs one step of the largest size the scheduler can make
(`max_num_batched_tokens` tokens over up to `max_num_seqs` sequences, each asking for logits) through the
model, the LM head and the device sampler (top-p on every row: its full sort is the sampler's peak),
on a throw-away pool just large enough, and reads torch's allocator statistics. Then

    pool = utilization * total - (model + activations + graphs + other)

- `model`: what torch holds before the pool (weights, rotary table, step buffers);
- `activations`: the profiling step's peak above that (intermediates, logits, the sampler's sort);
- `graphs`: a reserve for the CUDA graphs' memory pool (0 with `enforce_eager`), estimated from the
  activations per token times the largest graph's rows, plus `GRAPH_RESERVE_BASE`;
- `other`: device memory outside torch's allocator (the CUDA context, cuBLAS, other processes).

`kv_pool_bytes` is the arithmetic alone (unit-tested with made-up figures); `profile` measures.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from troupe.core.batch import ScheduledSeq

GRAPH_RESERVE_BASE = 64 << 20
GiB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """Bytes, as measured at start-up (see the module docstring)."""

    total: int
    model: int
    activations: int
    graphs: int
    other: int

    def fields(self) -> dict[str, float]:
        """The figures in GiB, for the start-up log line."""
        return {f"{k}_gib": round(getattr(self, k) / GiB, 3) for k in ("total", "model", "activations", "graphs",
                                                                           "other")}


def kv_pool_bytes(mem: GpuMemory, utilization: float) -> int:
    """What the KV pool may take: `utilization * total` minus everything else (may be <= 0)."""
    return int(utilization * mem.total) - mem.model - mem.activations - mem.graphs - mem.other


def graph_reserve_bytes(activations: int, profile_tokens: int, graph_rows: int) -> int:
    """The CUDA graphs' pool reserve: the profiled activations scaled to the largest graph's rows."""
    per_token = activations / max(1, profile_tokens)
    return GRAPH_RESERVE_BASE + int(per_token * min(graph_rows, profile_tokens))


def profile_seqs(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> list[ScheduledSeq]:
    """The largest step: `max_tokens` tokens (at most `max_model_len` a sequence) over up to `max_seqs`
    sequences from position 0, each on its own fresh blocks, each asking for logits."""
    tokens = min(max_tokens, max_seqs * max_model_len)
    n = min(max_seqs, tokens)
    seqs, next_block = [], 0
    for i in range(n):
        length = tokens // n + (i < tokens % n)
        blocks = -(-length // block_size)
        seqs.append(ScheduledSeq(f"profile-{i}", [0] * length, 0, list(range(next_block, next_block + blocks)), True))
        next_block += blocks
    return seqs


def profile_peak(step: Callable[[], torch.Tensor], sample: Callable[[torch.Tensor], object]) -> int:
    """Peak bytes torch allocates during `step()` (-> logits) and `sample(logits)`, above what it held."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    logits = step()
    sample(logits)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del logits
    return peak


def device_usage() -> tuple[int, int]:
    """(total bytes of the device, bytes in use outside torch's allocator), after freeing its cache."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total, max(0, total - free - torch.cuda.memory_reserved())
