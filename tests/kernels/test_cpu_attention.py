"""The cpu kernel set's paged attention (`troupe.kernels.cpu.attention`) against the plain reference on
irregular shapes, for every pool dtype; the whole file also runs on the AVX2/FMA baseline build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from factories import random_block_tables

from troupe.kernels import reference
from troupe.kernels.base import AttentionMetadata
from troupe.kernels.cpu import attention, build

pytestmark = [pytest.mark.timeout(600),  # the first test of a process may build the C++ extensions
              pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                reason="no AVX2/FMA/F16C CPU or no C++ compiler here")]

# (tokens already cached, new tokens) per sequence: a one-token prompt, decodes at and just past block
# boundaries (16, 32), a long decode, whole prompts, chunks after cached context, one ending on a boundary
MIXED = [(0, 1), (15, 1), (16, 1), (31, 1), (32, 1), (100, 1), (0, 7), (13, 4), (2, 9), (16, 16), (40, 70)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 2e-5}  # the reference reads the same pool values


@pytest.fixture(autouse=True)
def one_thread():
    """The compiled kernels loaded (built once, then cached); one thread unless a test says otherwise (the
    machine is shared), restored afterwards."""
    from troupe.kernels.cpu import available

    assert available()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, kv_dtype, q_dtype=torch.float32, seed=0):
    """Random q, pools in the cpu layout (K (NB, KVH, D, BS), V (NB, KVH, BS, D)) full of random values
    (unused blocks too, so a wrong read shows), the step's metadata with shuffled, non-contiguous blocks,
    and the same pools in the reference layout (NB, BS, KVH, D)."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(seqs, block_size, g)
    k_pool = torch.randn(num_blocks, num_kv_heads, head_dim, block_size, generator=g).to(kv_dtype)
    v_pool = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(kv_dtype)
    T = sum(n for _, n in seqs)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(q_dtype)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(T, dtype=torch.long),  # unused by attention
        query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
    )
    return q, k_pool, v_pool, meta, (k_pool.permute(0, 3, 1, 2).float(), v_pool.transpose(1, 2).float())


def check(seqs, block_size, num_heads, num_kv_heads, head_dim, kv_dtype, q_dtype=torch.float32, seed=0, **features):
    """The kernel's output against the reference's; `features`: sliding_window / softcap for both."""
    q, kp, vp, meta, (kr, vr) = make_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, kv_dtype, q_dtype, seed)
    k_before, v_before = kp.clone(), vp.clone()
    scale = head_dim**-0.5
    out = attention.paged_attention(q, kp, vp, attention.CpuMetadata.of(meta), scale, **features)
    ref = reference.paged_attention(q.float(), kr, vr, meta, scale, **features)
    assert out.dtype == q_dtype and out.shape == q.shape
    tol = TOL[kv_dtype] if q_dtype == torch.float32 else 2e-2  # bf16 queries: bf16 rounding of q and out
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(kp, k_before) and torch.equal(vp, v_before)  # attention reads the pool, never writes it
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 1), (8, 8)])
def test_mixed_batch_matches_reference(kv_dtype, block_size, num_heads, num_kv_heads):
    """One call for a mixed step (decodes at and just past block boundaries, a context of 1, whole
    prompts, chunks after cached context) gives the reference's output for GQA 9/3 (the default model),
    MQA 4/1 and MHA 8/8, block sizes 1/4 (the copying path) and 16/32, each pool dtype."""
    check(MIXED, block_size, num_heads, num_kv_heads, 64, kv_dtype)


@pytest.mark.parametrize("head_dim", [8, 32, 72, 128, 256])
def test_head_dims(head_dim):
    """Head dims that are a multiple of 8 up to 256, including ones that are not a multiple of 16 (the
    AVX-512 path's half-vector tail)."""
    check(MIXED[:8], 16, 6, 2, head_dim, torch.float16, seed=head_dim)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_bfloat16_queries(kv_dtype):
    """bfloat16 activations (the model's dtype) with float32 / float16 pools: the output is bfloat16 and
    within its rounding of the reference."""
    check(MIXED, 16, 9, 3, 64, kv_dtype, q_dtype=torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_batches_of_1_and_64(batch):
    """Decode-only steps of 1 and 64 sequences with contexts spread over several blocks."""
    seqs = [((7 * s) % 61 + 1, 1) for s in range(batch)] if batch > 1 else [(150, 1)]
    check(seqs, 16, 9, 3, 64, torch.float16, seed=batch)


# decode contexts around the kernel's key tiles (32 keys with AVX2, 64 with AVX-512) and long ones, so the
# next tile's prefetch, the masked last tile and many tiles per item all run
LONG_DECODES = [(c - 1, 1) for c in (31, 32, 33, 63, 64, 65, 127, 128, 129, 500, 1000, 2049)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_long_decodes_match_reference(kv_dtype, block_size):
    """Decodes at contexts just around multiples of the key tile up to 2049 positions, in one call, give
    the reference's output for each pool dtype, on the in-place path (blocks of 16 / 32) and the copying
    one (4)."""
    check(LONG_DECODES, block_size, 9, 3, 64, kv_dtype, seed=block_size)


@pytest.mark.parametrize("head_dim", [72, 128])
def test_long_decodes_other_head_dims(head_dim):
    """Long decodes with head dims of two P x V blocks (128) and a half-vector tail (72)."""
    check(LONG_DECODES[6:], 16, 6, 2, head_dim, torch.float16, seed=head_dim)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ctx", [33, 64, 65, 200])
def test_split_k_matches_reference(monkeypatch, threads, ctx):
    """A batch-1 decode split over its context (split-K pieces and their merge, forced at small sizes)
    matches the reference on 1 and 2 threads, including pieces that end just past a block boundary."""
    monkeypatch.setattr(attention, "MIN_PARALLEL", 0)
    monkeypatch.setattr(attention, "MIN_SPLIT", 16)
    torch.set_num_threads(threads)
    q, kp, vp, meta, (kr, vr) = make_batch([(ctx - 1, 1)], 16, 9, 3, 64, torch.float16, seed=ctx)
    m = attention.CpuMetadata.of(meta)
    out = attention.paged_attention(q, kp, vp, m, 0.125)
    assert m.plan is not None
    if threads > 1:
        assert m.plan.merges.shape[0] == 3, "each kv head's context was split"
    torch.testing.assert_close(out, reference.paged_attention(q, kr, vr, meta, 0.125), atol=2e-5, rtol=2e-5)


def test_plan_is_built_once_and_serves_every_layer():
    """The first call builds the step's plan and output buffer; a second layer (other pools, other q)
    reuses both and is exact too. The returned tensor is the step's buffer (copy it to keep it)."""
    q, kp, vp, meta, (kr, vr) = make_batch(MIXED, 16, 9, 3, 64, torch.float16, seed=1)
    m = attention.CpuMetadata.of(meta)
    first = attention.paged_attention(q, kp, vp, m, 0.125).clone()
    plan = m.plan
    q2, kp2, vp2, _, (kr2, vr2) = make_batch(MIXED, 16, 9, 3, 64, torch.float16, seed=2)
    second = attention.paged_attention(q2, kp2, vp2, m, 0.125)
    assert m.plan is plan and second is plan.out
    torch.testing.assert_close(first, reference.paged_attention(q, kr, vr, meta, 0.125), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(second, reference.paged_attention(q2, kr2, vr2, meta, 0.125), atol=2e-5, rtol=2e-5)


# Sliding window and soft-capping: MIXED's contexts are 1, 16, 17, 32, 33, 101, 7, 17, 11, 32, 110, plus a
# long decode and a long chunk; windows of 1, 17 (equal to some contexts), 33 (one past a key tile of
# AVX2, equal to one context), 100 and 4096 (larger than every context)
FEATURE_SEQS = [*MIXED, (700, 1), (300, 90)]


@pytest.mark.parametrize(("window", "softcap"), [(w, c) for w in (None, 1, 17, 33, 100, 4096) for c in (None, 5.0)
                                                 if (w, c) != (None, None)])  # the plain case: tests above
@pytest.mark.parametrize(("kv_dtype", "block_size", "num_heads", "num_kv_heads"),
                         [(torch.float16, 16, 9, 3), (torch.float32, 4, 4, 1), (torch.bfloat16, 32, 8, 8)])
def test_window_and_softcap_match_reference(kv_dtype, block_size, num_heads, num_kv_heads, window, softcap):
    """A mixed step (decodes at block boundaries and a long one, prompts, chunks after cached context and a
    long chunk) with a sliding window smaller than, equal to and larger than the contexts and / or a cap
    gives the reference's output: in-place (16, 32) and copying (4) paths, GQA / MQA / MHA, each pool dtype."""
    check(FEATURE_SEQS, block_size, num_heads, num_kv_heads, 64, kv_dtype, seed=20, sliding_window=window,
          softcap=softcap)


@pytest.mark.parametrize("head_dim", [72, 128])
def test_window_and_softcap_other_head_dims(head_dim):
    """A window and a cap with head dims of two P x V blocks (128) and a half-vector tail (72)."""
    check(FEATURE_SEQS, 16, 6, 2, head_dim, torch.float16, seed=head_dim, sliding_window=40, softcap=3.0)


def test_window_and_softcap_through_the_kernel_set():
    """`CpuKernels.attention` takes the features as keywords; bfloat16 queries stay within bf16 rounding."""
    from troupe.kernels.cpu import CpuKernels

    q, kp, vp, meta, (kr, vr) = make_batch(FEATURE_SEQS, 16, 9, 3, 64, torch.float16, torch.bfloat16, seed=21)
    out = CpuKernels().attention(q, q, q, (kp, vp), attention.CpuMetadata.of(meta), 0.125, 0, sliding_window=50,
                                 softcap=2.0)
    ref = reference.paged_attention(q.float(), kr, vr, meta, 0.125, sliding_window=50, softcap=2.0)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("ctx", "window"), [(65, 20), (200, 64), (1000, 100), (1000, 333), (200, 4096)])
def test_split_k_with_window(monkeypatch, threads, ctx, window):
    """A batch-1 decode split over its window only (split-K pieces from the window's start, forced at small
    sizes) matches the reference, with and without a cap."""
    monkeypatch.setattr(attention, "MIN_PARALLEL", 0)
    monkeypatch.setattr(attention, "MIN_SPLIT", 16)
    torch.set_num_threads(threads)
    q, kp, vp, meta, (kr, vr) = make_batch([(ctx - 1, 1)], 16, 9, 3, 64, torch.float16, seed=ctx)
    for softcap in (None, 1.0):
        m = attention.CpuMetadata.of(meta)
        out = attention.paged_attention(q, kp, vp, m, 0.125, sliding_window=window, softcap=softcap)
        ref = reference.paged_attention(q, kr, vr, meta, 0.125, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        items = m.plans[window].items
        first = max(0, ctx - window) // 32 * 32  # the window's start, rounded down to the decode tile
        assert int(items[:, 3].min()) == first and int(items[:, 4].max()) == ctx  # nothing before it is read


def test_window_plans_serve_their_layers():
    """One step, layers with and without a window (Gemma's local / global layers): each window has its own
    plan and output buffer, built once; decode items start at their window and prefill items cost only
    their window; a window longer than every context gives the plain result bit for bit."""
    q, kp, vp, meta, (kr, vr) = make_batch(FEATURE_SEQS, 16, 9, 3, 64, torch.float16, seed=22)
    m = attention.CpuMetadata.of(meta)
    plain = attention.paged_attention(q, kp, vp, m, 0.125).clone()
    local = attention.paged_attention(q, kp, vp, m, 0.125, sliding_window=64).clone()
    assert m.plan is not None and set(m.plans) == {64} and m.plans[64].out is not m.plan.out
    plan = m.plans[64]
    assert torch.equal(attention.paged_attention(q, kp, vp, m, 0.125, sliding_window=64), local)
    assert m.plans[64] is plan
    decodes = plan.items[plan.items[:, 0] == 0]
    lens = meta.seq_lens[decodes[:, 1]]
    assert torch.equal(decodes[:, 3], (lens - 64).clamp(min=0) // 32 * 32)
    torch.testing.assert_close(local, reference.paged_attention(q, kr, vr, meta, 0.125, sliding_window=64),
                               atol=2e-5, rtol=2e-5)
    assert torch.equal(attention.paged_attention(q, kp, vp, m, 0.125, sliding_window=4096), plain)


def test_bad_shapes_are_refused():
    """A head dim that is not a multiple of 8, or pools in another layout, are errors naming the problem,
    not wrong answers."""
    q, kp, vp, meta, _ = make_batch([(3, 1)], 16, 4, 2, 20, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        attention.paged_attention(q, kp, vp, attention.CpuMetadata.of(meta), 0.2)
    q, kp, vp, meta, _ = make_batch([(3, 1)], 16, 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="num_blocks, KVH, D, block_size"):
        attention.paged_attention(q, vp, vp, attention.CpuMetadata.of(meta), 0.2)


def test_built_for_the_isa_asked_for():
    """The kernels under test are the build TROUPE_CPU_ISA asks for: the AVX2 baseline in the subprocess
    below, the native one (AVX-512 where the CPU has it) otherwise."""
    from troupe.kernels.cpu import available

    assert available()
    native = "avx512" if "avx512f" in build.cpu_flags() else "avx2"
    assert torch.ops.troupe_probe.isa() == ("avx2" if build.isa() == "avx2" else native)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # this file again on the AVX2 build, in a subprocess
@pytest.mark.skipif(os.environ.get("TROUPE_CPU_ISA") == "avx2", reason="this is the AVX2 run itself")
def test_avx2_baseline_passes_these_tests():
    """Every test of this file passes on the AVX2/FMA/F16C baseline build as well (what AVX2-only
    machines run), in a subprocess: an ISA's library can only be loaded once per process."""
    env = {**os.environ, "TROUPE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "1 skipped" in out.stdout
