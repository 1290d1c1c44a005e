"""Mixture-of-experts: the routed experts of one layer, run on the tokens routed to each.

`grouped_experts(gate_up, down, silu_and_mul)` takes each expert's projections already bound by a kernel
set (`KernelSet.linear`: float, or GGUF blocks on the cpu set) and returns the layer's expert op:

    moe(x (T, h), ids (T, k) int64, weights (T, k) float32) -> (T, h)

`out[t] = sum_j weights[t, j] * down[e](silu(gate[e] x[t]) * up[e] x[t])` with `e = ids[t, j]`. The step's
(token, slot) pairs are sorted by expert once; each expert with tokens runs its two projections on its rows
only (as a batch), its rows are scaled by their routing weights and added into the output in float32, in
expert order (transformers' order). Experts without a token cost nothing; one expert with every token runs
one batch of T rows.

An expert's gate|up comes as one (2f, h) weight or as its two row parts `[gate (f, h), up (f, h)]`
(`ExpertGateUp`): a GGUF's experts come as parts, views of the file's blocks that a stack would copy
(`troupe.models.layer_loading`). `linear_rows` binds either through a set's `linear` (the parts' outputs
concatenated), `gate_up_parts` splits a whole one into row views (no copy).

`reference_moe` is the plain per-token torch definition the grouped op and every kernel set are tested
against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from troupe.kernels.quant import QuantizedTensor, Weight

LinearOp = Callable[[torch.Tensor], torch.Tensor]
MoeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ExpertGateUp = Weight | list[Weight]  # (2f, h), or [gate (f, h), up (f, h)]


def linear_rows(linear: Callable[[Weight], LinearOp], weight: ExpertGateUp) -> LinearOp:
    """`linear(weight)`; for row parts, one projection per part and their outputs concatenated (M, 2f)."""
    if not isinstance(weight, list):
        return linear(weight)
    projections = [linear(w) for w in weight]
    return lambda x: torch.cat([f(x) for f in projections], dim=-1)


def gate_up_parts(weight: ExpertGateUp) -> tuple[Weight, Weight] | None:
    """(gate (f, h), up (f, h)) of an expert's gate|up: its two parts, or a whole one's two row halves as
    views; None where the parts are not two of one shape."""
    if isinstance(weight, list):
        if len(weight) != 2 or tuple(weight[0].shape) != tuple(weight[1].shape):
            return None
        return weight[0], weight[1]
    f, h = weight.shape[0] // 2, weight.shape[1]
    if weight.shape[0] != 2 * f:
        return None
    if isinstance(weight, QuantizedTensor):
        return (QuantizedTensor(weight.qtype, weight.data[:f], (f, h)),
                QuantizedTensor(weight.qtype, weight.data[f:], (f, h)))
    return weight[:f], weight[f:]


def grouped_experts(gate_up: Sequence[LinearOp], down: Sequence[LinearOp],
                    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> MoeOp:
    """The expert op over bound projections (see the module docstring); `silu_and_mul` is the set's."""

    def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)  # (T, h)
        flat = ids.reshape(-1)  # (T*k,)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
        counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]  # (n,) indices into the flattened (token, slot) pairs
            start += n
            rows = pairs // k  # (n,) tokens
            y = down[expert](silu_and_mul(gate_up[expert](x[rows])))  # (n, h)
            out.index_add_(0, rows, y.float() * weights.reshape(-1)[pairs, None])
        return out.to(x.dtype)

    return moe


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, ids (T, k) int64): softmax over all experts in float32, the top k, renormalized
    to sum 1 when `normalize` (Mixtral always; Qwen MoE with `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights, ids = probs.topk(top_k, dim=-1)  # (T, k) each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Sequence[torch.Tensor],
                  down: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per token, in float64: `sum_j w[t, j] * down_e(silu(gate_e x) * up_e x)` (gate_up[e] (2f, h), down[e] (h, f))."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (F.silu(g) * u))
    return out.to(x.dtype)
