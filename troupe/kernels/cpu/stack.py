"""The `cpu` set's decoder stack: every layer of a Llama-family model in one compiled call (`csrc/stack.cpp`).

The C++ op makes, layer by layer, the same calls to the same compiled kernels as
`troupe.models.llama.DecoderLayer.forward` does from Python, so its results are the loop's bit for bit;
what it saves is the Python around ~300 op calls a step (argument parsing and boxing on every call),
a large share of a single-stream decode step and a small one of a batched step (docs/kernels.md).

It applies when every projection of every layer computes on GGUF blocks (`QuantizedLinear`, one format per
projection) with the same activation mode and the model computes in float32; otherwise (a Hugging Face
folder's dense weights, a projection split into runs of several formats, bfloat16 activations) the model
keeps its loop. `TROUPE_DECODER_STACK=0` turns it off (to compare the two paths).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from troupe.kernels.base import AttentionMetadata, DecoderStack, LayerKV, LayerWeights
from troupe.kernels.cpu.attention import CpuMetadata, step_plan
from troupe.kernels.cpu.linear import QuantizedLinear

SOURCES = ("stack.cpp",)


def enabled() -> bool:
    """`TROUPE_DECODER_STACK` is not "0"."""
    return os.environ.get("TROUPE_DECODER_STACK", "1") != "0"


def decoder_stack(layers: Sequence[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                  scale: float) -> DecoderStack | None:
    """The stack of `layers` (see the module docstring), or None where it does not apply."""
    projections = [p for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    if not enabled() or not layers or not all(isinstance(p, QuantizedLinear) for p in projections):
        return None
    linears: list[QuantizedLinear] = projections  # type: ignore[assignment]
    if len({p.mode for p in linears}) != 1:
        return None
    if any(layer.input_norm.dtype != torch.float32 or layer.post_norm.dtype != torch.float32 for layer in layers):
        return None
    weights = [p.data for p in linears]
    qtypes = [p.qtype for p in linears]
    biases = [p.bias for p in linears]
    input_norms = [layer.input_norm.detach() for layer in layers]
    post_norms = [layer.post_norm.detach() for layer in layers]
    mode = linears[0].mode

    def run(x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, kv_caches: Sequence[LayerKV],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(meta, CpuMetadata), "the cpu set's step metadata (CpuKernels.prepare)"
        # the step's attention plan, as the first layer's attention call would build it (for q's shape)
        plan = meta.plan or step_plan(meta, x.new_empty((x.shape[0], num_heads, head_dim)), kv_caches[0][0])
        out, residual = torch.ops.troupe_stack.decoder_stack(
            x, positions, rope, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, plan.items, plan.merges, plan.scratch, plan.out,
            scale, plan.threads, input_norms, post_norms, weights, qtypes, biases, mode, eps, num_heads, num_kv_heads,
            head_dim)
        return out, residual

    return run
