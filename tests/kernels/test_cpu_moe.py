"""The cpu set's fused MoE op (`troupe.kernels.cpu.moe`, csrc/moe.cpp) against `reference_moe` in float64 on
the experts' dequantized values: GGUF block formats and dense experts, routings that leave experts idle or
send every token to one, decode-sized steps, 1 and 2 threads, the fused and the per-expert paths, and both
activation modes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from troupe.kernels.cpu import build
from troupe.kernels.moe import grouped_experts, reference_moe
from troupe.kernels.quant import QType, QuantizedTensor, Weight, dense, random_quantized

pytestmark = [
    pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                       reason="no AVX2/FMA/F16C CPU or no C++ compiler here"),
    pytest.mark.timeout(600),  # the first test of a process may build the C++ extensions
]

E, H, F = 4, 256, 256  # experts, hidden, intermediate (whole 256-value super-blocks for the K-quants)
FORMATS = [QType.Q8_0, QType.Q4_0, QType.Q4_K, QType.F32]
# (name, ids): experts left idle, one taking every token (16 > any build's fused limit), decode steps
ROUTINGS = {
    "decode_k2": [[2, 0]],
    "decode_k1": [[3]],
    "idle_experts": [[1, 2], [2, 1], [1, 2]],
    "one_takes_all": [[1, (0, 2, 3)[t % 3]] for t in range(16)],
    "mixed_sizes": [[0, 1]] * 4 + [[3, 0], [0, 3]],  # 6, 4 and 2 tokens
}


def experts(qtype: QType, seed: int) -> tuple[list[Weight], list[Weight]]:
    g = torch.Generator().manual_seed(seed)
    gate_up = [random_quantized(qtype, 2 * F, H, g) for _ in range(E)]
    down = [random_quantized(qtype, H, F, g) for _ in range(E)]
    return gate_up, down


def routing(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x (T, H), ids (T, k), weights (T, k)) with positive weights summing to 1 per token."""
    ids = torch.tensor(ROUTINGS[name], dtype=torch.int64)
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(ids.shape[0], H, generator=g)
    w = torch.rand(ids.shape, generator=g) + 0.1
    return x, ids, (w / w.sum(-1, keepdim=True)).float()


def own(w: Weight) -> Weight:
    """A dense weight copied (the eager projection's packing releases the tensor it is given)."""
    return w.clone() if isinstance(w, torch.Tensor) else w


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def sets() -> dict[bool, object]:
    from troupe.kernels.cpu import CpuKernels

    return {False: CpuKernels(), True: CpuKernels(quantize_activations=True)}


@pytest.fixture(scope="module", params=FORMATS, ids=lambda q: q.name)
def bound(request: pytest.FixtureRequest, sets: dict[bool, object]) -> Iterator[tuple]:
    """(qtype, the fused op and `grouped_experts` per activation mode, the float64 reference's output per
    routing) for one format."""
    from troupe.kernels.cpu.moe import FusedMoe

    qtype = request.param
    gate_up, down = experts(qtype, seed=int(qtype))
    ref_gu, ref_dn = [dense(w) for w in gate_up], [dense(w) for w in down]
    ops = {q8: s.moe(gate_up, down) for q8, s in sets.items()}  # type: ignore[attr-defined]
    assert all(isinstance(op, FusedMoe) for op in ops.values())
    grouped = {q8: grouped_experts([s.linear(own(w)) for w in gate_up], [s.linear(own(w)) for w in down],  # type: ignore[attr-defined]
                                   s.silu_and_mul) for q8, s in sets.items()}  # type: ignore[attr-defined]
    wants = {}
    for name in ROUTINGS:
        x, ids, w = routing(name)
        wants[name] = reference_moe(x.double(), ids, w, ref_gu, ref_dn)
    yield qtype, ops, grouped, wants


@pytest.fixture(scope="module", params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count for the tests that take it (module scope: tests are grouped by it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("fused_max_m", [-1, 0], ids=["fused", "per_expert"])
@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
def test_fused_moe_matches_reference(bound: tuple, threads: int, fused_max_m: int, q8: bool) -> None:
    """Every routing, on the fused path (work items split to one per thread: min_blocks 1) and with every expert
    on the per-expert projection calls: within float32 summation error of `grouped_experts` on the same
    kernel set (the same projection kernels), and of the float64 reference with float32 activations; with
    8-bit activations within twice a projection's q8 tolerance (tests/kernels/test_cpu_linear.py: two
    chained projections, each quantizing its input)."""
    qtype, ops, grouped, wants = bound
    op = ops[q8]
    op.fused_max_m, op.min_blocks = fused_max_m, 1
    tol = 4e-2 if q8 and qtype != QType.F32 else 2e-5
    try:
        for name in ROUTINGS:
            x, ids, w = routing(name)
            want = wants[name]
            got = op(x, ids, w)
            assert got.shape == x.shape and got.dtype == torch.float32
            assert rel_err(got, want) < tol, f"{qtype.name} {name}: {rel_err(got, want)}"
            if threads == 1:  # (the grouped op's many small parallel regions are slow on a loaded machine)
                assert rel_err(got, grouped[q8](x, ids, w)) < 2e-5, f"{qtype.name} {name}: differs from grouped"
    finally:
        op.fused_max_m, op.min_blocks = -1, -1


def test_dense_experts_and_fallback(sets: dict[bool, object]) -> None:
    """Dense float32 and bfloat16 experts compute on their own bytes (exact values); experts of mixed
    formats keep `grouped_experts`, with the same results; bfloat16 activations come back in bfloat16."""
    from troupe.kernels.cpu.moe import FusedMoe

    exact = sets[False]
    g = torch.Generator().manual_seed(7)
    gate_up = [torch.randn(2 * F, H, generator=g) * 0.05 for _ in range(E)]
    down = [torch.randn(H, F, generator=g) * 0.05 for _ in range(E)]
    x, ids, w = routing("mixed_sizes")
    for dtype in (torch.float32, torch.bfloat16):
        gu, dn = [t.to(dtype) for t in gate_up], [t.to(dtype) for t in down]
        op = exact.moe(gu, dn)  # type: ignore[attr-defined]
        assert isinstance(op, FusedMoe)
        want = reference_moe(x.double(), ids, w, [t.float() for t in gu], [t.float() for t in dn])
        assert rel_err(op(x, ids, w), want) < 2e-5
    y = op(x.bfloat16(), ids, w)
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < 2e-2

    q_gu, q_dn = experts(QType.Q8_0, seed=3)
    mixed_gu = [*q_gu[:-1], random_quantized(QType.Q4_0, 2 * F, H)]
    op = exact.moe(mixed_gu, q_dn)  # type: ignore[attr-defined]
    assert not isinstance(op, FusedMoe)
    want = reference_moe(x.double(), ids, w, [dense(t) for t in mixed_gu], [dense(t) for t in q_dn])
    assert rel_err(op(x, ids, w), want) < 2e-5


def test_bad_input_is_refused(sets: dict[bool, object]) -> None:
    """An expert id outside the layer's experts and a weight of the wrong byte shape are named errors."""
    from troupe.kernels.cpu.moe import FusedMoe

    gate_up, down = experts(QType.Q8_0, seed=1)
    op = sets[False].moe(gate_up, down)  # type: ignore[attr-defined]
    x, ids, w = routing("decode_k2")
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        op(x, torch.tensor([[4, 0]]), w)
    assert isinstance(gate_up[0], QuantizedTensor)
    half = gate_up[0].data[:F, :-1].contiguous()  # type: ignore[union-attr]
    bad = FusedMoe([half] * E, [half] * E, [d.data for d in down], int(QType.Q8_0), int(QType.Q8_0), False)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="every gate must be"):
        bad(x, ids, w)


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in build.cpu_flags() or build.isa() != "native",
                                reason="this CPU lacks avx512_bf16 (or TROUPE_CPU_ISA=avx2): no gguf-bf16 mode")
# every expert at <= 6 tokens (bf16_rows_max_m() >= 6)
DECODE = ("decode_k2", "decode_k1", "idle_experts", "mixed_sizes")


@needs_bf16
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0], ids=lambda q: q.name)
def test_bf16_mode_experts(qtype: QType) -> None:
    """The "gguf-bf16" set's op: decode-sized experts on the 16-bit rows path (the K-quants; csrc/rows_i16.h) or
    the float rows kernel (Q8_0), fused and per expert, within 1e-4 of the float64 reference (x rounded to 16 bits
    of its chunk's largest value) and of `grouped_experts` on the same set; an expert with 16 tokens takes the
    bf16 GEMM (linear_bf16), within bf16's rounding."""
    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cpu.moe import FusedMoe

    kset = CpuKernels(bf16=True)
    gate_up, down = experts(qtype, seed=11)
    op = kset.moe(gate_up, down)
    assert isinstance(op, FusedMoe) and op.bf16
    grouped = grouped_experts([kset.linear(w) for w in gate_up], [kset.linear(w) for w in down], kset.silu_and_mul)
    ref_gu, ref_dn = [dense(w) for w in gate_up], [dense(w) for w in down]
    for fused_max_m in (-1, 0):
        op.fused_max_m, op.min_blocks = fused_max_m, 1
        for name in ROUTINGS:
            x, ids, w = routing(name)
            want = reference_moe(x.double(), ids, w, ref_gu, ref_dn)
            got = op(x, ids, w)
            tol = 1e-4 if name in DECODE else 2e-2
            assert rel_err(got, want) < tol, f"{qtype.name} {name} fused_max_m={fused_max_m}: {rel_err(got, want)}"
            if name in DECODE:
                assert rel_err(got, grouped(x, ids, w)) < 2e-5, f"{qtype.name} {name}: differs from grouped"
    exact = CpuKernels().moe(gate_up, down)
    x, ids, w = routing("decode_k2")
    differs = not torch.equal(op(x, ids, w), exact(x, ids, w))
    assert differs == (qtype != QType.Q8_0)  # the 16-bit path is not the float one; Q8_0 keeps the float kernel
