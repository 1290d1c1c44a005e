"""The `cuda` kernel set: the model's heavy ops as Triton kernels on a GPU, projections on cuBLAS.

- Weights: every projection is `F.linear` on the weight in the model dtype on the GPU (bf16 by default);
  a quantized weight (`troupe.kernels.quant.QuantizedTensor`, GGUF blocks) is expanded to the model
  dtype once, when it is bound (`dense_on`).
- KV pool: `(num_blocks, num_kv_heads, block_size, head_dim)` per layer (`cache_write.kv_cache_shape`).
- Per step: `prepare` fills fixed pinned host buffers and copies them to fixed device buffers without a
  host sync (`step_buffers.StepBuffers`); a decode step whose size has a captured CUDA graph
  (`graph_sizes`, set once the graphs are captured: `graphs.DecodeGraphs`) is padded to that size in the
  graphs' fixed layout, with `max_seq_len` = `graph_max_seq_len`.
- Per layer: `rms_norm` / `fused_add_rms_norm` (in place), `rotary_embedding` (in place on the q / k
  views of the fused qkv output) then `reshape_and_cache`, `paged_attention`, `silu_and_mul`; the routed
  experts of an MoE layer as the fused Triton MoE (`moe.fused_moe`, experts stacked once at bind time).

TEST-ONLY: `CudaKernels(device="cpu")` runs the same code on CPU tensors under the Triton interpreter,
allowed only when `TRITON_INTERPRET=1` was set before `troupe.kernels.cuda` was imported
(`interpreter_active`); CI checks the whole path this way (no graphs, no pinned memory there).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from troupe.errors import InvalidInputError
from troupe.kernels.base import (
    ATTENTION_FEATURES,
    EmbeddingOp,
    KernelSet,
    KVSpec,
    LayerKV,
    LinearOp,
    ScheduledSeq,
    StepBatch,
    flatten_step,
)
from troupe.kernels.cuda import cache_write
from troupe.kernels.cuda.activation import silu_and_mul
from troupe.kernels.cuda.attention import paged_attention
from troupe.kernels.cuda.graphs import graph_size_for
from troupe.kernels.cuda.moe import fused_moe, stack_experts
from troupe.kernels.cuda.norm import fused_add_rms_norm, rms_norm
from troupe.kernels.cuda.rotary import rotary_embedding
from troupe.kernels.cuda.step_buffers import CudaMetadata, StepBuffers
from troupe.kernels.moe import MoeOp


def interpreter_active() -> bool:
    """Whether the Triton kernels of this package run under the interpreter (CPU tensors work)."""
    interpreted = type(cache_write.reshape_and_cache_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET") == "1" and interpreted


def dense_on(weight: Any, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """`weight` as a dense contiguous tensor on `device`: a quantized weight (anything with
    `dequantize(dtype)`, e.g. `troupe.kernels.quant.QuantizedTensor`) is expanded to `dtype` first; a list
    of row parts (an expert's [gate, up]) is expanded part by part and stacked."""
    if isinstance(weight, list):
        return torch.cat([dense_on(w, device, dtype) for w in weight])
    if not isinstance(weight, torch.Tensor):
        weight = weight.dequantize(dtype or torch.bfloat16)
    return weight.detach().to(device=device).contiguous()


class CudaKernels(KernelSet):
    """See the module docstring. `dtype`: the model's dtype (what quantized weights expand to; None: the
    weights' own); `max_num_seqs` / `max_num_batched_tokens` size the step buffers."""

    name = "cuda"
    dequantizes_to_model_dtype = True  # `dense_on`: a GGUF's blocks become bf16 (or the model's dtype) on the GPU
    attention_features = ATTENTION_FEATURES

    def __init__(self, device: torch.device | str = "cuda", *, dtype: torch.dtype | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024) -> None:
        device = torch.device(device)
        if device.type == "cpu" and not interpreter_active():
            raise InvalidInputError("kernels", "'cuda' on the CPU is test-only: it needs TRITON_INTERPRET=1 set "
                                    "before troupe.kernels.cuda is imported (the Triton interpreter)")
        if device.type not in ("cpu", "cuda"):
            raise InvalidInputError("device", f"the cuda kernel set runs on 'cuda', got {device}")
        super().__init__(device)
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.buffers: StepBuffers | None = None
        self.graph_sizes: list[int] = []  # decode batch sizes with a captured graph, ascending
        self.graph_max_seq_len = 0  # the `max_seq_len` every graph was captured with

    # ------------------------------------------------------------------ weights

    def linear(self, weight: Any, bias: torch.Tensor | None = None) -> LinearOp:
        w = dense_on(weight, self.device, self.dtype)  # (N, K)
        b = None if bias is None else dense_on(bias, self.device, self.dtype)  # (N,)

        def project(x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N), cuBLAS
            return F.linear(x, w, b)

        return project

    def moe(self, gate_up: Sequence[Any], down: Sequence[Any]) -> MoeOp:
        """The fused Triton MoE (`moe.fused_moe`): the experts stacked once here into `w13` (E, 2f, h) and
        `w2` (E, h, f) in the model dtype (a quantized expert expanded first, as `linear` does)."""
        w13 = stack_experts((dense_on(w, self.device, self.dtype) for w in gate_up), len(gate_up), self.device,
                            self.dtype)
        w2 = stack_experts((dense_on(w, self.device, self.dtype) for w in down), len(down), self.device,
                           self.dtype)

        def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return fused_moe(x, ids, weights, w13, w2)

        return experts

    def embedding(self, table: Any) -> EmbeddingOp:
        t = dense_on(table, self.device, self.dtype)  # (V, hidden)
        return lambda ids: F.embedding(ids, t)

    # ------------------------------------------------------------------ the KV pool

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return cache_write.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def allocate_kv(self, spec: KVSpec) -> list[LayerKV]:
        """The pool, and the step buffers sized for `spec` (tables of `max_model_len` positions)."""
        self.buffers = None  # a pool allocated again (after profiling) gets fresh buffers
        pools = super().allocate_kv(spec)
        self.buffers = StepBuffers(self.max_num_batched_tokens, max(self.max_num_seqs, spec.max_num_seqs),
                                   -(-spec.max_model_len // spec.block_size), graph_rows=spec.max_num_seqs,
                                   device=self.device)
        return pools

    # ------------------------------------------------------------------ per step

    def decode_graph_size(self, seqs: Sequence[ScheduledSeq]) -> int:
        """The captured graph size this step pads to: every seq one token and sampled, and a graph large
        enough; else 0 (eager)."""
        if not self.graph_sizes or not all(len(s.token_ids) == 1 and s.needs_logits for s in seqs):
            return 0
        return graph_size_for(len(seqs), self.graph_sizes)

    def prepare(self, seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
        size = self.decode_graph_size(seqs)
        batch = None
        if self.buffers is not None:
            batch = self.buffers.fill(seqs, block_size, pad_to=size,
                                      max_seq_len=self.graph_max_seq_len if size else 0)
        if batch is None:  # no buffers yet, or a step larger than they were sized for
            batch = self._unbuffered(seqs, block_size)
        return batch

    def padding_batch(self, size: int, block_size: int) -> StepBatch:
        """A step of `size` padding rows in the graph layout (what a graph is captured on)."""
        assert self.buffers is not None, "allocate_kv first"
        batch = self.buffers.fill([], block_size, pad_to=size, max_seq_len=self.graph_max_seq_len)
        assert batch is not None, f"graph size {size} past the buffers' {self.buffers.graph_rows} rows"
        return batch

    def _unbuffered(self, seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
        flat = flatten_step(seqs, block_size)
        m = flat.meta

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        meta = CudaMetadata(dev(m.slot_mapping), dev(m.query_start_loc), dev(m.seq_lens), dev(m.block_tables),
                            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, num_seqs=len(seqs))
        return StepBatch(dev(flat.input_ids), dev(flat.positions), meta, dev(flat.logits_indices))

    # ------------------------------------------------------------------ per layer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        fused_add_rms_norm(x, residual, weight, eps)  # residual += x; x = rms_norm(residual)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope_cache: torch.Tensor, kv: LayerKV, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_embedding(positions, q, k, rope_cache)  # in place (HF rotate-half)
        cache_write.reshape_and_cache(k, v, kv[0], kv[1], meta.slot_mapping)
        return q, k

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: Any,
                  scale: float, layer: int, *, sliding_window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, H, D)
        return paged_attention(q, kv[0], kv[1], out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale, meta.max_query_len, meta.max_seq_len, sliding_window=sliding_window,
                               softcap=softcap)
