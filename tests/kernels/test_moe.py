"""The routed-experts op of every kernel set (`KernelSet.moe`, troupe.kernels.moe) against the per-token
float64 reference: routings where some experts get no token and one gets every token, single tokens,
float weights and GGUF blocks (the cpu set computes on Q8_0 / Q4_0 blocks; the reference uses their
dequantized values); and the router (softmax top-k, renormalized or not) against its definition."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from troupe.config import EngineConfig
from troupe.kernels import select_kernels
from troupe.kernels.cpu import available as cpu_available
from troupe.kernels.moe import reference_moe, route
from troupe.kernels.quant import QType, QuantizedTensor, dense

E, H, F_ = 8, 64, 32
G = torch.Generator().manual_seed(0)
GATE_UP = [torch.randn(2 * F_, H, generator=G) * 0.2 for _ in range(E)]
DOWN = [torch.randn(H, F_, generator=G) * 0.2 for _ in range(E)]
X = torch.randn(9, H, generator=G)


def routings() -> dict[str, torch.Tensor]:
    """(T, 2) expert ids: explicit, so which experts are empty or full is by construction."""
    return {
        "spread, experts 6 and 7 empty": torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [3, 2], [5, 4], [0, 2],
                                                        [1, 3], [4, 0]]),
        "every token to experts 3 and 5": torch.tensor([[3, 5]] * 9),
        "one expert per slot, mixed": torch.tensor([[7, 0]] * 4 + [[0, 7]] * 5),
    }


def weights_for(ids: torch.Tensor) -> torch.Tensor:
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) + 0.1
    return w / w.sum(-1, keepdim=True)


def kernel_sets() -> list[str]:
    return ["eager"] + (["cpu"] if cpu_available() else [])


@pytest.mark.parametrize("kernels", kernel_sets())
@pytest.mark.parametrize("routing", sorted(routings()))
def test_float_experts_equal_the_reference(kernels: str, routing: str) -> None:
    ops = select_kernels(EngineConfig(kernels=kernels))
    moe = ops.moe([w.clone() for w in GATE_UP], [w.clone() for w in DOWN])
    ids = routings()[routing]
    w = weights_for(ids)
    torch.testing.assert_close(moe(X, ids, w), reference_moe(X, ids, w, GATE_UP, DOWN), atol=1e-5, rtol=1e-5)
    one = moe(X[:1], ids[:1], w[:1])  # a single decode token
    torch.testing.assert_close(one, reference_moe(X[:1], ids[:1], w[:1], GATE_UP, DOWN), atol=1e-5, rtol=1e-5)


def blocks(w: torch.Tensor, qtype: QType) -> QuantizedTensor:
    data = gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType[qtype.name])
    return QuantizedTensor(qtype, torch.from_numpy(np.ascontiguousarray(data)), tuple(w.shape))  # type: ignore[arg-type]


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0])
@pytest.mark.parametrize("kernels", kernel_sets())
def test_experts_on_gguf_blocks_equal_the_reference_on_their_values(kernels: str, qtype: QType) -> None:
    ops = select_kernels(EngineConfig(kernels=kernels))
    gate_up = [blocks(w, qtype) for w in GATE_UP]
    down = [blocks(w, qtype) for w in DOWN]
    ids = routings()["spread, experts 6 and 7 empty"]
    w = weights_for(ids)
    want = reference_moe(X, ids, w, [dense(q) for q in gate_up], [dense(q) for q in down])
    torch.testing.assert_close(ops.moe(gate_up, down)(X, ids, w), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_router_is_softmax_top_k(normalize: bool) -> None:
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(2))
    weights, ids = route(logits, 2, normalize)
    probs = torch.softmax(logits.double(), -1)
    for t in range(5):
        top = sorted(range(E), key=lambda e: -float(probs[t, e]))[:2]
        assert ids[t].tolist() == top
        want = probs[t, top] / (probs[t, top].sum() if normalize else 1.0)
        torch.testing.assert_close(weights[t].double(), want, atol=1e-6, rtol=1e-6)


def test_the_cuda_set_runs_the_experts(device: torch.device) -> None:
    """The cuda set (on the CPU: the interpreter's device) binds each expert with its own projections."""
    from troupe.kernels.cuda.kernel_set import CudaKernels

    ops = CudaKernels(device)
    moe = ops.moe([w.clone().to(device) for w in GATE_UP], [w.clone().to(device) for w in DOWN])
    ids = routings()["spread, experts 6 and 7 empty"]
    w = weights_for(ids)
    got = moe(X.to(device), ids.to(device), w.to(device)).cpu()
    torch.testing.assert_close(got, reference_moe(X, ids, w, GATE_UP, DOWN), atol=1e-5, rtol=1e-5)
