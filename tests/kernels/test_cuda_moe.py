"""The fused Triton MoE (`troupe.kernels.cuda.moe`, `CudaKernels.moe`) against the per-token float64
reference `troupe.kernels.moe.reference_moe`: routings where some experts get no token and one gets every
token (several blocks of one expert), a single decode token, T not a multiple of the block, k = 1 and 2,
float32 and bf16; the block alignment against a plain-Python grouping; the launcher's argument checks."""

from __future__ import annotations

import pytest
import torch

from troupe.kernels.cuda.checks import KernelArgumentError
from troupe.kernels.cuda.kernel_set import CudaKernels
from troupe.kernels.cuda.moe import fused_moe, fused_moe_meta, fused_moe_reference, moe_align_block_size
from troupe.kernels.moe import reference_moe

E, H, F_ = 6, 64, 48  # f = 48: partial column tiles (BLOCK_N 64) and a partial K step in the down GEMM
G = torch.Generator().manual_seed(0)
GATE_UP = [torch.randn(2 * F_, H, generator=G) * 0.2 for _ in range(E)]
DOWN = [torch.randn(H, F_, generator=G) * 0.2 for _ in range(E)]
X = torch.randn(40, H, generator=G)

ROUTINGS = {  # (T, k) expert ids, explicit: which experts are empty or full is by construction
    "spread, experts 4 and 5 empty, T=9": torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3], [2, 0],
                                                        [3, 1], [0, 3]]),
    "every token to expert 2, k=1, T=37": torch.tensor([[2]] * 37),  # three blocks of 16, the last partial
    "decode, T=1": torch.tensor([[5, 0]]),
    "k=1 mixed, T=5": torch.tensor([[4], [0], [4], [1], [4]]),
    "40 tokens over 3 experts, k=2": torch.tensor([[t % 3, (t + 1) % 3] for t in range(40)]),  # BLOCK_M 32
}


def weights_for(ids: torch.Tensor) -> torch.Tensor:
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) + 0.1
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_fused_moe_equals_the_reference(device: torch.device, routing: str, dtype: torch.dtype) -> None:
    ids = ROUTINGS[routing]
    T = ids.shape[0]
    x, w = X[:T].to(dtype), weights_for(ids)
    gate_up, down = [g.to(dtype) for g in GATE_UP], [d.to(dtype) for d in DOWN]
    got = fused_moe(x.to(device), ids.to(device), w.to(device), torch.stack(gate_up).to(device),
                    torch.stack(down).to(device))
    assert got.shape == (T, H) and got.dtype == dtype
    want = reference_moe(x, ids, w, gate_up, down)  # float64 on the same (rounded) weights
    tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: the intermediate and the output are rounded
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    if dtype == torch.float32:  # the module's own plain-torch reference agrees with the kernel set's
        torch.testing.assert_close(fused_moe_reference(x, ids, w, torch.stack(gate_up), torch.stack(down)), want,
                                   atol=1e-5, rtol=1e-5)


def test_one_expert_with_every_token_uses_several_blocks() -> None:
    """The routing above really spans blocks (so block boundaries inside one expert's group are tested)."""
    meta = fused_moe_meta(37, E, H, True, top_k=1, gated=True, mul_weight=False)
    assert meta["BLOCK_M"] == 16
    _, expert_ids, num_padded = moe_align_block_size(ROUTINGS["every token to expert 2, k=1, T=37"], E, 16)
    assert int(num_padded) == 48 and expert_ids[:3].tolist() == [2, 2, 2]
    assert fused_moe_meta(80, 3, H, True, top_k=2, gated=True, mul_weight=False)["BLOCK_M"] == 32


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_block_size_groups_pairs_by_expert(routing: str, block_m: int) -> None:
    """Against a plain-Python grouping: expert by expert (ascending), its pairs in token order, padded
    with the pad id to a multiple of block_m; each block names its expert; experts without a pair own
    no block; the buffers keep their fixed capacity past the used length."""
    ids = ROUTINGS[routing]
    n = ids.numel()
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, E, block_m)
    want_ids: list[int] = []
    want_experts: list[int] = []
    for e in range(E):
        pairs = [p for p, x in enumerate(ids.reshape(-1).tolist()) if x == e]
        if not pairs:
            continue
        blocks = -(-len(pairs) // block_m)
        want_ids += pairs + [n] * (blocks * block_m - len(pairs))
        want_experts += [e] * blocks
    used = int(num_padded)
    assert used == len(want_ids)
    assert sorted_ids[:used].tolist() == want_ids and expert_ids[: used // block_m].tolist() == want_experts
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= used
    assert bool((sorted_ids[used:] == n).all())
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_set_stacks_the_experts_once(device: torch.device, dtype: torch.dtype) -> None:
    """`CudaKernels.moe` binds float32 experts into stacked weights in the model dtype and runs the kernel."""
    ops = CudaKernels(device, dtype=dtype)
    moe = ops.moe([g.clone() for g in GATE_UP], [d.clone() for d in DOWN])
    ids = ROUTINGS["spread, experts 4 and 5 empty, T=9"]
    w = weights_for(ids)
    x = X[:9].to(dtype)
    got = moe(x.to(device), ids.to(device), w.to(device))
    want = reference_moe(x, ids, w, [g.to(dtype) for g in GATE_UP], [d.to(dtype) for d in DOWN])
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    assert moe(x[:0].to(device), ids[:0].to(device), w[:0].to(device)).shape == (0, H)


def test_the_cuda_set_refuses_experts_of_different_shapes(device: torch.device) -> None:
    with pytest.raises(KernelArgumentError, match=r"experts\[1\]: shape must be \(96, 64\)"):
        CudaKernels(device).moe([GATE_UP[0], GATE_UP[1][:10]], DOWN[:2])


@pytest.mark.parametrize("change,error", [
    (dict(weights=torch.ones(3, 2, dtype=torch.float64)), r"weights: must be float32"),
    (dict(ids=torch.zeros(3, 2)), r"ids: dtype must be int32 or int64"),
    (dict(ids=torch.zeros(4, 2, dtype=torch.int64)), r"ids: shape must be \(T=3, k\)"),
    (dict(w13=torch.zeros(E, 2 * F_, H, dtype=torch.bfloat16)), r"w13: dtype must be x's torch.float32"),
    (dict(w2=torch.zeros(E, H, F_ + 1)), r"w2: shape must be \(E=6, h=64, f=48\)"),
    (dict(w13=torch.zeros(E, 2 * F_, H + 1)), r"w13: shape must be \(E, 2f, h=64\)"),
])
def test_bad_arguments_are_refused(change: dict[str, torch.Tensor], error: str) -> None:
    args = dict(x=torch.zeros(3, H), ids=torch.zeros(3, 2, dtype=torch.int64), weights=torch.ones(3, 2),
                w13=torch.zeros(E, 2 * F_, H), w2=torch.zeros(E, H, F_))
    with pytest.raises(KernelArgumentError, match=error):
        fused_moe(**{**args, **change})
