"""The `cpu` kernel set: the model's heavy ops as compiled C++ kernels (`csrc/`, built by `build`).

Compiled: projections and the embedding lookup on GGUF blocks (`linear`, csrc/qmatmul*.cpp; with
`quantize_activations`, 8-bit activations; with `bf16`, batches in bfloat16 on CPUs with avx512_bf16;
dense weights keep the eager set's packed float32
projection), paged attention over the pool in place (`attention`), RMSNorm, residual add + RMSNorm,
SiLU x up, and rotary + the KV write (`fused`), a MoE layer's routed experts (`moe`). The class extends `EagerKernels` for what the compiled
ops do not replace. No decode row cache: attention reads the pool where it is.

The KV pool is the set's own. Layout: V `(num_blocks, KVH, block_size, D)` (`kv_cache_shape`), K
`(num_blocks, KVH, D, block_size)` (`k_cache_shape`): a block's keys of one kv head stored transposed, so
one vector load brings one dimension of W consecutive keys and attention scores are broadcast-FMAs
(csrc/attention_decode.cpp). Dtype from `EngineConfig.kv_cache_dtype`:
"auto" is float16 (half the memory and the bandwidth of float32, converted on load with F16C; the
greedy-equality suite holds with it, docs/kernels.md has the figures), or "float32" / "float16" /
"bfloat16" explicitly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from troupe.kernels.base import (
    DecoderStack,
    EmbeddingOp,
    KVSpec,
    LayerKV,
    LayerWeights,
    LinearOp,
    ScheduledSeq,
    StepBatch,
    flatten_step,
    zeros,
)
from troupe.kernels.cpu import build, fused, prebuild, stack
from troupe.kernels.cpu import linear as qlinear
from troupe.kernels.cpu import moe as cmoe
from troupe.kernels.cpu.arena import WeightArena
from troupe.kernels.cpu.attention import CpuMetadata, paged_attention
from troupe.kernels.cpu.build import BuildError, load_ops
from troupe.kernels.eager import EagerKernels
from troupe.kernels.moe import ExpertGateUp, MoeOp
from troupe.kernels.quant import Weight

EXTENSIONS: dict[str, tuple[str, ...]] = {  # extension name -> its csrc/ sources
    "probe": ("probe.cpp",),
    "qmm": qlinear.SOURCES,
    "attention": ("attention.cpp", "attention_decode.cpp", "attention_prefill.cpp"),
    "fused": ("fused.cpp",),
    "moe": cmoe.SOURCES,  # calls qmm's and fused's ops through the dispatcher
    "stack": stack.SOURCES,  # loads last: its op calls the others' through the dispatcher
}
KV_DTYPES = {"auto": torch.float16, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


DENSE_EXTENSIONS = {name: sources for name, sources in EXTENSIONS.items() if name != "moe"}  # what a dense model loads


def available(moe: bool = False) -> bool:
    """Whether the compiled extensions that a dense model uses (with `moe`, the experts' op too) build and
    load here. Built once, then cached: a first use compiles every missing source in one pool of compiler
    processes, one per core this process may run on, after a precompiled header (`prebuild.prebuild`), then
    loads each library; a build in progress elsewhere is waited for."""
    wanted = EXTENSIONS if moe else DENSE_EXTENSIONS
    _build_missing(tuple(wanted))
    return all(load_ops(name, sources) for name, sources in wanted.items())


@functools.cache
def _build_missing(names: tuple[str, ...]) -> None:
    """`prebuild.prebuild` of those of `names` not in the cache, once a process; a problem (no compiler, a
    bad TROUPE_CPU_ISA, a source that fails) is left for `load_ops` to report."""
    try:
        target = build.isa()
        missing = {n: EXTENSIONS[n] for n in names if not (build.build_folder(n, EXTENSIONS[n], target) / "built").exists()}
    except BuildError:
        return
    if missing:
        prebuild.prebuild(missing, (target,), jobs=len(os.sched_getaffinity(0)))


def bf16_built() -> bool:
    """Whether the loaded kernels hold the avx512_bf16 path (a compiler that does not target it leaves
    it out); call after `available()`."""
    return bool(torch.ops.troupe_qmm.bf16_kernels())


def bf16_runs() -> bool:
    """Whether `CpuKernels(bf16=True)` ("gguf-bf16") runs here: the CPU and the build ISA have
    avx512_bf16, the set builds, and the build holds the bf16 path."""
    return qlinear.bf16_unsupported() is None and available() and bf16_built()


class Bf16Unsupported(BuildError):
    """The "gguf-bf16" mode cannot run here; the message says what the CPU or the build lacks."""


class CpuKernels(EagerKernels):
    """See the module docstring. `kv_cache_dtype`: a key of `KV_DTYPES`; `quantize_activations`
    ("gguf-q8"): 8-bit activations for the projections on quantized weights; `bf16` ("gguf-bf16"): those
    projections compute batches in bfloat16 (a `Bf16Unsupported` error where the CPU cannot; the MoE
    experts, attention and the fused ops stay float32)."""

    name = "cpu"

    def __init__(self, kv_cache_dtype: str = "auto", quantize_activations: bool = False, bf16: bool = False) -> None:
        if bf16 and (reason := qlinear.bf16_unsupported()) is not None:
            raise Bf16Unsupported(reason)
        if not available():
            raise BuildError("the compiled CPU kernels cannot be built here (see the warning logged above)")
        if bf16 and not bf16_built():
            raise Bf16Unsupported("the compiled kernels were built without avx512_bf16 (the compiler does not "
                                  "target it)")
        super().__init__(decode_row_cache_bytes=0)
        self.kv_dtype = KV_DTYPES[kv_cache_dtype]
        self.quantize_activations = quantize_activations
        self.bf16 = bf16
        self.arena = WeightArena()  # the blocks of every quantized projection (arena.py)

    # ------------------------------------------------------------------ weights

    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> LinearOp:
        return qlinear.linear(weight, bias, self.quantize_activations, self.arena, self.bf16)

    def embedding(self, table: Weight) -> EmbeddingOp:
        return qlinear.embedding(table)

    def moe(self, gate_up: Sequence[ExpertGateUp], down: Sequence[Weight]) -> MoeOp:
        """The experts in one compiled call on their blocks, where they are (`moe.py`: not moved into the
        arena, so a GGUF's stay mapped); `grouped_experts` where it does not apply (experts of mixed formats,
        rows that are not whole blocks) or its library does not build (`available` logs why). The library
        is built and loaded here, at a MoE model's first layer: a dense model does without it."""
        op = cmoe.fused_moe(gate_up, down, self.quantize_activations, self.bf16) if available(moe=True) else None
        return op if op is not None else super().moe(gate_up, down)

    # ------------------------------------------------------------------ the KV pool

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.kv_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The V pool's shape (K's is `k_cache_shape`)."""
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def k_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, head_dim, block_size)

    def allocate_kv(self, spec: KVSpec) -> list[LayerKV]:
        """Zero-filled (K, V) pools per layer in the set's layout (committed lazily: `base.zeros`); no row
        cache."""
        args = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        k_shape, v_shape = self.k_cache_shape(*args), self.kv_cache_shape(*args)
        return [(zeros(k_shape, self.kv_dtype), zeros(v_shape, self.kv_dtype)) for _ in range(spec.num_layers)]

    def decoder_stack(self, layers: Sequence[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int,
                      eps: float, scale: float) -> DecoderStack | None:
        """Every layer in one compiled call where the projections all compute on GGUF blocks (`stack`)."""
        return stack.decoder_stack(layers, num_heads, num_kv_heads, head_dim, eps, scale)

    # ------------------------------------------------------------------ per step / per layer

    def prepare(self, seqs: Sequence[ScheduledSeq], block_size: int) -> StepBatch:
        batch = flatten_step(seqs, block_size)
        batch.meta = CpuMetadata.of(batch.meta)
        return batch

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(x)

    def rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope_cache: torch.Tensor, kv: LayerKV, meta: CpuMetadata,  # type: ignore[override]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.rope_and_cache(positions, q, k, v, rope_cache, kv, meta.slot_mapping)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                  meta: CpuMetadata, scale: float, layer: int, *,  # type: ignore[override]
                  sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return paged_attention(q, kv[0], kv[1], meta, scale, sliding_window=sliding_window, softcap=softcap)
