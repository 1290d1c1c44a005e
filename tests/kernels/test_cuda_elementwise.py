"""KV write, rotary, RMSNorm (+ fused add) and silu_and_mul kernels against their torch references
(and, where troupe has one, the CPU model's own op), at small irregular shapes, float32 / fp16 / bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_cases import TOLERANCE, assert_close

from troupe.kernels import reference
from troupe.kernels.cuda.activation import silu_and_mul, silu_and_mul_reference
from troupe.kernels.cuda.cache_write import kv_cache_shape, reshape_and_cache, reshape_and_cache_reference
from troupe.kernels.cuda.checks import KernelArgumentError
from troupe.kernels.cuda.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from troupe.kernels.cuda.rotary import cos_sin_table, rotary_embedding, rotary_embedding_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------------------ reshape_and_cache


@pytest.mark.parametrize("KVH,D,BS", [(3, 64, 16), (1, 32, 32), (8, 32, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache(device: torch.device, KVH: int, D: int, BS: int, dtype: torch.dtype,
                           index_dtype: torch.dtype) -> None:
    """Tokens land at their slots (in different blocks, offsets 0 and BS - 1 included), slot -1 skips
    its token, and every other slot of the pool is left as it was: bit-exact against the reference."""
    NB, T = 5, 7
    key, value = randn(T, KVH, D, dtype=dtype, seed=1), randn(T, KVH, D, dtype=dtype, seed=2)
    slots = torch.tensor([0, BS - 1, -1, 3 * BS + 5, BS, -1, NB * BS - 1], dtype=index_dtype)
    k_ref = randn(*kv_cache_shape(NB, BS, KVH, D), dtype=dtype, seed=3)
    v_ref = randn(*kv_cache_shape(NB, BS, KVH, D), dtype=dtype, seed=4)
    k_cache, v_cache = k_ref.to(device, copy=True), v_ref.to(device, copy=True)  # never aliased
    reshape_and_cache(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    before = k_ref.clone()
    reshape_and_cache_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)
    assert torch.equal(k_ref[3, :, 5], key[3]) and not torch.equal(k_ref, before)  # the reference did write


def test_reshape_and_cache_strided_inputs(device: torch.device) -> None:
    """key / value as head slices of a fused qkv output (strided rows) are read correctly."""
    T, H, KVH, D, BS = 6, 9, 3, 64, 16
    qkv = randn(T, H + 2 * KVH, D, seed=5).to(device)
    key, value = qkv[:, H : H + KVH], qkv[:, H + KVH :]
    k_cache = torch.zeros(kv_cache_shape(4, BS, KVH, D), device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, 8, 20, 21, 40, 63])
    reshape_and_cache(key, value, k_cache, v_cache, slots.to(device))
    k_ref, v_ref = torch.zeros_like(k_cache.cpu()), torch.zeros_like(v_cache.cpu())
    reshape_and_cache_reference(key.cpu(), value.cpu(), k_ref, v_ref, slots)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


def test_reshape_and_cache_bad_pool_shape() -> None:
    """A pool in the CPU layout (NB, BS, KVH, D) is refused with the expected layout named."""
    key = torch.zeros(2, 3, 64)
    pool = torch.zeros(4, 16, 3, 64)
    with pytest.raises(KernelArgumentError, match=r"k_cache: shape must be \(num_blocks, 3, block_size, 64\)"):
        reshape_and_cache(key, key, pool, pool, torch.tensor([0, 1]))


# ------------------------------------------------------------------------------------ rotary_embedding


@pytest.mark.parametrize("H,KVH,D,R,is_neox", [
    (9, 3, 64, 64, True), (4, 1, 32, 32, True), (8, 8, 32, 32, False), (4, 2, 64, 32, True),
], ids=["9-3-d64-neox", "4-1-d32-neox", "8-8-d32-gptj", "4-2-d64-partial32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(device: torch.device, H: int, KVH: int, D: int, R: int, is_neox: bool,
                          dtype: torch.dtype) -> None:
    """Query and key rotated in place, as strided views of a fused qkv buffer, match the reference;
    the v heads next to them are untouched."""
    T = 7
    inv_freq = 1.0 / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    table = cos_sin_table(inv_freq, 300)
    positions = torch.tensor([0, 1, 2, 17, 255, 299, 5])
    qkv = randn(T, H + 2 * KVH, D, dtype=dtype, seed=6)
    dev = qkv.to(device, copy=True)
    rotary_embedding(positions.to(device), dev[:, :H], dev[:, H : H + KVH], table.to(device), is_neox)
    ref = qkv.clone()
    rotary_embedding_reference(positions, ref[:, :H], ref[:, H : H + KVH], table, is_neox)
    assert_close(dev.cpu(), ref)
    assert torch.equal(dev[:, H + KVH :].cpu(), qkv[:, H + KVH :])


def test_rotary_matches_kernel_set_reference(device: torch.device) -> None:
    """The kernel (neox) agrees with the kernel-set reference `troupe.kernels.reference.rope` (what every
    CPU set is tested against) on the model's cos | sin table."""
    T, H, D = 5, 9, 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    positions = torch.tensor([0, 3, 64, 100, 511])
    table = reference.rope_cache(inv_freq, 512)
    q, k = randn(T, H, D, seed=7), randn(T, 3, D, seed=8)
    expected_q, expected_k = reference.rope(positions, q, table), reference.rope(positions, k, table)
    qd, kd = q.to(device, copy=True), k.to(device, copy=True)
    rotary_embedding(positions.to(device), qd, kd, cos_sin_table(inv_freq, 512).to(device))
    assert_close(qd.cpu(), expected_q)
    assert_close(kd.cpu(), expected_k)


# ------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("T,h", [(7, 576), (3, 100), (1, 2048)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device: torch.device, T: int, h: int, dtype: torch.dtype) -> None:
    """rms_norm matches the float32 reference and a float64 formula; rows may be strided."""
    wide = randn(T, h + 8, dtype=dtype, seed=9)
    x, w = wide[:, 3 : 3 + h], randn(h, dtype=dtype, seed=10)
    out = rms_norm(x.to(device), w.to(device), 1e-5)
    assert out.shape == (T, h) and out.dtype == dtype
    assert_close(out, rms_norm_reference(x, w, 1e-5))
    x64 = x.double()
    formula = x64 * (x64.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w.double()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), formula, atol=max(atol, 1e-5), rtol=rtol)


@pytest.mark.parametrize("T,h", [(7, 576), (3, 100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device: torch.device, T: int, h: int, dtype: torch.dtype) -> None:
    """In place: residual becomes x + residual (rounded to the dtype as a torch add would) and x its
    norm; equal to the unfused `residual + x` then rms_norm."""
    x, r, w = randn(T, h, dtype=dtype, seed=11), randn(T, h, dtype=dtype, seed=12), randn(h, dtype=dtype, seed=13)
    xd, rd = x.to(device, copy=True), r.to(device, copy=True)
    fused_add_rms_norm(xd, rd, w.to(device), 1e-6)
    x_ref, r_ref = x.clone(), r.clone()
    fused_add_rms_norm_reference(x_ref, r_ref, w, 1e-6)
    assert_close(rd, r_ref)
    assert_close(xd, x_ref)
    if dtype != torch.bfloat16:  # bf16: the interpreter's truncating cast can differ from torch's add by 1 ulp
        assert torch.equal(rd.cpu(), r + x)


# ------------------------------------------------------------------------------------ silu_and_mul


@pytest.mark.parametrize("T,f", [(7, 1536), (3, 100), (1, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device: torch.device, T: int, f: int, dtype: torch.dtype) -> None:
    """silu(gate) * up over a fused (T, 2f) gate/up row, f not a multiple of the tile (1024) included."""
    x = randn(T, 2 * f, dtype=dtype, seed=14)
    out = silu_and_mul(x.to(device))
    assert out.shape == (T, f)
    assert_close(out, silu_and_mul_reference(x))
    assert_close(out, (F.silu(x[:, :f].double()) * x[:, f:].double()).to(dtype))


def test_bad_arguments_name_the_field() -> None:
    """Wrong dtypes and shapes are refused with the argument's name."""
    with pytest.raises(KernelArgumentError, match="x: last dimension must be even"):
        silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(KernelArgumentError, match="weight: shape must be"):
        rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(KernelArgumentError, match="residual: dtype"):
        fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16), torch.zeros(8), 1e-5)
    with pytest.raises(KernelArgumentError, match="cos_sin_cache: dtype must be float32"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4, 8), torch.zeros(2, 1, 8),
                         torch.zeros(16, 8, dtype=torch.float16))
    with pytest.raises(KernelArgumentError, match="x: dtype must be"):
        rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64), 1e-5)
