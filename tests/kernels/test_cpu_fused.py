"""The cpu kernel set's fused elementwise ops (`troupe.kernels.cpu.fused`) against the plain references,
on odd sizes and both activation dtypes; the whole file also runs on the AVX2/FMA baseline build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from troupe.kernels import reference
from troupe.kernels.cpu import build, fused

pytestmark = [pytest.mark.timeout(600),  # the first test of a process may build the C++ extensions
              pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                reason="no AVX2/FMA/F16C CPU or no C++ compiler here")]

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 576), (7, 17), (64, 576), (300, 1000)]  # a decode row, an odd width, a batch, a prefill over threads


@pytest.fixture(autouse=True)
def loaded():
    """The compiled kernels loaded (built once, then cached)."""
    from troupe.kernels.cpu import available

    assert available()


def tol(dtype: torch.dtype) -> dict[str, float]:
    """float32: summation order only; bfloat16: one rounding of the output."""
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape):
    """`rms_norm` is the reference's x / rms(x) * weight, in a new tensor (x unchanged)."""
    x, w = randn(*shape, dtype=dtype, seed=0), randn(shape[1], dtype=dtype, seed=1)
    before = x.clone()
    out = fused.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-5), **tol(dtype))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_in_place(dtype, shape):
    """`add_rms_norm` returns (normed, summed) written into (x, residual): summed is residual + x exactly
    (one rounding in bfloat16), normed the reference norm of it."""
    x, r, w = (randn(*shape, dtype=dtype, seed=s) for s in (2, 3, 4))
    w = w[0]
    summed = r + x
    normed, out_sum = fused.add_rms_norm(x, r, w, 1e-6)
    assert normed is x and out_sum is r
    torch.testing.assert_close(out_sum, summed, atol=0, rtol=0)
    torch.testing.assert_close(normed, reference.rms_norm(summed, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul(dtype, shape):
    """`silu_and_mul` (T, 2f) -> (T, f) is the reference's silu(gate) * up, including large |gate|
    (the exp's clamps)."""
    x = randn(shape[0], 2 * shape[1], dtype=dtype, seed=5) * 4
    x[0, 0], x[-1, 1] = 100.0, -100.0
    torch.testing.assert_close(fused.silu_and_mul(x), reference.silu_and_mul(x), **tol(dtype))


def qkv_views(T, H, KVH, D, dtype, seed):
    """q, k, v as the model passes them: strided views into one fused qkv projection output."""
    qkv = randn(T, (H + 2 * KVH) * D, dtype=dtype, seed=seed)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    return q.view(T, H, D), k.view(T, KVH, D), v.reshape(T, KVH, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (4, 32), (1, 72), (32, 128)])
def test_rope_and_cache(dtype, kv_dtype, block_size, head_dim):
    """`rope_and_cache` rotates q and k in place (the reference's rotate-half from the model's table) and
    writes the rotated k and v at the slots, in the cpu layout (K transposed per block) and the pool's
    dtype; slot -1 writes nothing, and nothing else of the pool changes."""
    T, H, KVH, NB = 13, 9, 3, 16
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    table = reference.rope_cache(inv_freq, 100)
    q, k, v = qkv_views(T, H, KVH, head_dim, dtype, seed=head_dim)
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 100, (T,), generator=g)
    slots = torch.randperm(NB * block_size, generator=g)[:T]
    slots[3] = -1
    want_q, want_k = reference.rope(positions, q, table), reference.rope(positions, k, table)
    k_pool = torch.randn(NB, KVH, head_dim, block_size, generator=g).to(kv_dtype)  # garbage that must stay
    v_pool = torch.randn(NB, KVH, block_size, head_dim, generator=g).to(kv_dtype)
    k_ref, v_ref = k_pool.permute(0, 3, 1, 2).clone(), v_pool.transpose(1, 2).clone()  # (NB, BS, KVH, D)
    reference.write_kv(want_k.to(kv_dtype), v.to(kv_dtype), k_ref, v_ref, slots)
    out_q, out_k = fused.rope_and_cache(positions, q, k, v, table, (k_pool, v_pool), slots)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, want_q, **tol(dtype))
    torch.testing.assert_close(k, want_k, **tol(dtype))
    torch.testing.assert_close(k_pool.permute(0, 3, 1, 2), k_ref, atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(v_pool.transpose(1, 2), v_ref, atol=0, rtol=0)


def test_float16_pool_saturates():
    """A k or v beyond float16's range is stored as +-65504 (an inf would make attention NaN)."""
    q, k, v = qkv_views(1, 1, 1, 8, torch.float32, seed=0)
    v.fill_(1e6)
    v[0, 0, 1] = -1e6
    k_pool, v_pool = torch.zeros(1, 1, 8, 1, dtype=torch.float16), torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    table = reference.rope_cache(torch.ones(4, dtype=torch.float64), 4)
    fused.rope_and_cache(torch.tensor([0]), q, k, v, table, (k_pool, v_pool), torch.tensor([0]))
    assert v_pool[0, 0, 0, 0] == 65504 and v_pool[0, 0, 0, 1] == -65504


def test_bad_inputs_are_refused():
    """A position outside the rotary table or a slot outside the pool is an error, not a stray write."""
    q, k, v = qkv_views(2, 2, 1, 8, torch.float32, seed=0)
    table = reference.rope_cache(torch.ones(4, dtype=torch.float64), 10)
    pools = (torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 4, 8))
    with pytest.raises(RuntimeError, match="position 10"):
        fused.rope_and_cache(torch.tensor([0, 10]), q, k, v, table, pools, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="slot 8"):
        fused.rope_and_cache(torch.tensor([0, 1]), q, k, v, table, pools, torch.tensor([0, 8]))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # this file again on the AVX2 build, in a subprocess
@pytest.mark.skipif(os.environ.get("TROUPE_CPU_ISA") == "avx2", reason="this is the AVX2 run itself")
def test_avx2_baseline_passes_these_tests():
    """Every test of this file passes on the AVX2/FMA/F16C baseline build as well, in a subprocess (an
    ISA's library can only be loaded once per process)."""
    env = {**os.environ, "TROUPE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "1 skipped" in out.stdout
