"""CUDA graphs of the decode step: `capture_sizes`, `graph_size_for`, `DecodeGraphs`.

A decode batch of a small model is bound by Python and launch overhead (about ten launches a layer),
not by the GPU; replaying a captured graph issues all of them at once. Graphs are captured at start-up
for batch sizes 1, 2, 4, 8 and then every 16 up to `max_num_seqs` (at most `MAX_GRAPH_BATCH`); a decode
step of n sequences is padded to the smallest captured size >= n (padding rows: `step_buffers`).

What a graph holds is static: its inputs are the fixed views of `StepBuffers` at that size (refilled by
every step before the replay), the KV pool, the weights, and the attention launcher's host bounds —
`max_seq_len` is the model's `max_model_len` for every graph, which fixes each graph's split count
(`attention.decode_splits`) while each sequence's split length still follows its own context. The
graph ends by copying the final hidden states into one shared `(rows, hidden)` buffer; the LM head and
sampling run after the replay, on the real rows only.

Capture, per size: a warm-up run (Triton compiles and loads the kernels outside the capture), then the
capture itself, into one memory pool shared by all graphs (they never run concurrently). The order is
`capture_order`: the sizes up to 8 first (single streams and small batches, whose latency the graphs
are for), then the others from the largest down (so each smaller graph reuses the pool memory of the
larger ones). Capture stops early, keeping the sizes already captured, once `budget_s` seconds or
`budget_bytes` of pool memory are spent: a batch is then padded to the next captured size up (or runs
eagerly if none is large enough).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from troupe.kernels.base import StepBatch

MAX_GRAPH_BATCH = 512
GRAPH_STEP = 16  # sizes past 8 go up in steps of this many sequences
CAPTURE_BUDGET_S = 60.0


def capture_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    """The batch sizes to capture, ascending: 1, 2, 4, 8, then every `GRAPH_STEP`, and the top itself."""
    top = max(1, min(max_num_seqs, limit))
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(GRAPH_STEP, top + 1, GRAPH_STEP)) | {top}
    return sorted(sizes)


def capture_order(sizes: Sequence[int]) -> list[int]:
    """The sizes up to 8 ascending, then the rest descending (see the module docstring)."""
    small = sorted(s for s in sizes if s <= 8)
    return small + sorted((s for s in sizes if s > 8), reverse=True)


def graph_size_for(num_seqs: int, sizes: Sequence[int]) -> int:
    """The smallest of `sizes` (ascending) that holds `num_seqs` rows; 0 if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else 0


@dataclass
class CaptureReport:
    """What `DecodeGraphs.capture` did: sizes captured and skipped, seconds, pool bytes."""

    captured: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    seconds: float = 0.0
    pool_bytes: int = 0
    stopped_by: str = ""  # "", "time" or "memory"


class DecodeGraphs:
    """One CUDA graph per decode batch size; `replay(batch)` runs the one `batch` was padded for.

    `make_batch(B)` fills the step buffers with a batch of B padding rows (graph layout) and returns it;
    `forward(batch)` runs the model over it and returns the final hidden states (B, hidden)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, max_rows: int) -> None:
        self.out = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)  # (rows, hidden)
        self.graphs: dict[int, Any] = {}  # size -> torch.cuda.CUDAGraph
        self.pool: Any = None  # one memory pool for every graph

    def record(self, fn: Callable[[], object]) -> Any:
        """Capture what `fn()` launches as one CUDA graph (in the shared pool); returns it (`.replay()`)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        return graph

    @property
    def sizes(self) -> list[int]:
        return sorted(self.graphs)

    def capture(self, sizes: Sequence[int], make_batch: Callable[[int], StepBatch],
                forward: Callable[[StepBatch], torch.Tensor], *, budget_s: float = CAPTURE_BUDGET_S,
                budget_bytes: int | None = None) -> CaptureReport:
        """Capture `sizes` in `capture_order`, within the time and memory budgets (module docstring)."""
        report = CaptureReport()
        started = time.monotonic()
        reserved = torch.cuda.memory_reserved()
        todo = capture_order(sizes)
        for i, B in enumerate(todo):
            batch = make_batch(B)
            forward(batch)  # warm-up: compiles / loads every kernel of this shape outside the capture
            torch.cuda.synchronize()

            def step(B: int = B, batch: StepBatch = batch) -> None:  # bound now, whenever it runs
                self.out[:B].copy_(forward(batch))

            self.graphs[B] = self.record(step)
            report.captured.append(B)
            report.pool_bytes = torch.cuda.memory_reserved() - reserved
            report.seconds = time.monotonic() - started
            over = "time" if report.seconds > budget_s else ""
            if budget_bytes is not None and report.pool_bytes > budget_bytes:
                over = "memory"
            if over and i + 1 < len(todo):
                report.stopped_by, report.skipped = over, todo[i + 1:]
                break
        torch.cuda.synchronize()
        report.captured.sort()
        return report

    def replay(self, batch: StepBatch) -> torch.Tensor:
        """Run the graph of `batch`'s padded size over the buffers `batch` filled: (real rows, hidden)."""
        meta = batch.meta
        size, n = meta.graph_size, meta.num_seqs  # type: ignore[attr-defined]
        self.graphs[size].replay()
        return self.out[:n]
