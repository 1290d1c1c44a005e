"""The CUDA kernels on a real GPU at realistic sizes (skipped without one; marked `gpu`).

Same references as the interpreter tests, at the default model's and 8B-class shapes; plus what only a
GPU can show: the launchers never sync with the host (`torch.cuda.set_sync_debug_mode("error")`), and
a decode step (KV write, attention, norms, activation) captured in a CUDA graph replays correctly for
new context lengths.
"""

from __future__ import annotations

import pytest
import torch
from cuda_cases import Batch, assert_close, make_batch

from troupe.core.sampler import Sampler, SamplingRow
from troupe.kernels.cuda.activation import silu_and_mul, silu_and_mul_reference
from troupe.kernels.cuda.attention import paged_attention, paged_attention_reference
from troupe.kernels.cuda.cache_write import kv_cache_shape, reshape_and_cache, reshape_and_cache_reference
from troupe.kernels.cuda.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from troupe.kernels.cuda.rotary import cos_sin_table, rotary_embedding, rotary_embedding_reference
from troupe.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
GEOMETRIES = [(9, 3, 64, torch.bfloat16), (32, 8, 128, torch.bfloat16), (9, 3, 64, torch.float32),
              (32, 8, 128, torch.float16)]
IDS = ["small-bf16", "8b-bf16", "small-f32", "8b-f16"]


def attend(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    b = batch.to(device)
    out = torch.empty_like(b.q)
    paged_attention(b.q, b.k_cache, b.v_cache, out, b.query_start_loc, b.seq_lens, b.block_tables, b.scale,
                    b.max_query_len, b.max_seq_len)
    ref = paged_attention_reference(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                    b.scale)
    return out, ref


PREFILL_SPECS = [(512, 512), (1024, 256), (700, 1), (2048, 2048), (77, 77), (1500, 1)]
DECODE_SPECS = [(1 + (s * 997) % 4096, 1) for s in range(64)]


@pytest.mark.parametrize("H,KVH,D,dtype", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("BS", [16, 32])
def test_prefill_and_mixed_batches(H: int, KVH: int, D: int, dtype: torch.dtype, BS: int) -> None:
    """Long prompts, chunks after 768 cached positions and decodes in one batch match the reference."""
    out, ref = attend(make_batch(PREFILL_SPECS, H, KVH, D, BS, dtype, seed=1), CUDA)
    assert_close(out, ref)


@pytest.mark.parametrize("H,KVH,D,dtype", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("specs", [DECODE_SPECS, [(4096, 1)], [(1, 1)] * 256], ids=["64x<=4096", "1x4096", "256x1"])
def test_decode_batches(H: int, KVH: int, D: int, dtype: torch.dtype, specs: list[tuple[int, int]]) -> None:
    """Decode batches of 64 (contexts up to 4096), 1 (long: many splits) and 256 (context 1)."""
    out, ref = attend(make_batch(specs, H, KVH, D, 16, dtype, seed=2), CUDA)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elementwise_kernels_at_model_sizes(dtype: torch.dtype) -> None:
    """KV write, rotary, norms and silu at 8B-class sizes (2048 tokens, hidden 4096, f 14336)."""
    g = torch.Generator().manual_seed(3)
    T, H, KVH, D, h, f, NB, BS = 2048, 32, 8, 128, 4096, 14336, 200, 16
    key, value = torch.randn(T, KVH, D, generator=g).to(dtype), torch.randn(T, KVH, D, generator=g).to(dtype)
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[::7] = -1
    kc = torch.zeros(kv_cache_shape(NB, BS, KVH, D), dtype=dtype, device=CUDA)
    vc = torch.zeros_like(kc)
    reshape_and_cache(key.to(CUDA), value.to(CUDA), kc, vc, slots.to(CUDA))
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    reshape_and_cache_reference(key.to(CUDA), value.to(CUDA), kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)

    table = cos_sin_table(1.0 / 500000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), 8192).to(CUDA)
    positions = torch.randint(0, 8192, (T,), generator=g).to(CUDA)
    q, k = torch.randn(T, H, D, generator=g).to(dtype).to(CUDA), key.to(CUDA)
    q2, k2 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, table)
    rotary_embedding_reference(positions, q2, k2, table)
    assert_close(q, q2)
    assert_close(k, k2)

    x, r, w = (torch.randn(T, h, generator=g).to(dtype).to(CUDA), torch.randn(T, h, generator=g).to(dtype).to(CUDA),
               torch.randn(h, generator=g).to(dtype).to(CUDA))
    assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    x2, r2 = x.clone(), r.clone()
    fused_add_rms_norm(x, r, w, 1e-5)
    fused_add_rms_norm_reference(x2, r2, w, 1e-5)
    assert_close(r, r2)
    assert_close(x, x2)
    gu = torch.randn(T // 4, 2 * f, generator=g).to(dtype).to(CUDA)
    assert_close(silu_and_mul(gu), silu_and_mul_reference(gu))


def test_launchers_never_sync_with_the_host() -> None:
    """Every launcher runs with CUDA's sync debug mode set to error: no `.item()`, no host copy."""
    batch = make_batch(PREFILL_SPECS, 9, 3, 64, 16, torch.bfloat16, seed=4).to(CUDA)
    dec = make_batch(DECODE_SPECS, 9, 3, 64, 16, torch.bfloat16, seed=5).to(CUDA)
    T, H, D = batch.q.shape
    k = torch.randn(T, 3, D, device=CUDA, dtype=torch.bfloat16)
    slots = torch.arange(T, device=CUDA)
    table = cos_sin_table(1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), 4096).to(CUDA)
    x = torch.randn(T, 576, device=CUDA, dtype=torch.bfloat16)
    w = torch.ones(576, device=CUDA, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reshape_and_cache(k, k, batch.k_cache, batch.v_cache, slots)
        rotary_embedding(slots, batch.q, k, table)
        fused_add_rms_norm(x, x.clone(), w, 1e-5)
        rms_norm(x, w, 1e-5)
        silu_and_mul(x)
        for b in (batch, dec):
            paged_attention(b.q, b.k_cache, b.v_cache, torch.empty_like(b.q), b.query_start_loc, b.seq_lens,
                            b.block_tables, b.scale, b.max_query_len, b.max_seq_len)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_decode_step_replays_in_a_cuda_graph() -> None:
    """A decode step captured once (with max_seq_len fixing the splits) replays for other context
    lengths and other block tables written into the same input tensors, matching the reference."""
    H, KVH, D, BS, B, max_len = 9, 3, 64, 16, 32, 2048
    g = torch.Generator().manual_seed(6)
    NB = B * max_len // BS + 1
    k_cache = torch.randn(kv_cache_shape(NB, BS, KVH, D), generator=g).to(torch.bfloat16).to(CUDA)
    v_cache = torch.randn(kv_cache_shape(NB, BS, KVH, D), generator=g).to(torch.bfloat16).to(CUDA)
    q = torch.zeros(B, H, D, dtype=torch.bfloat16, device=CUDA)
    k_new, v_new = torch.zeros(B, KVH, D, dtype=torch.bfloat16, device=CUDA), torch.zeros(B, KVH, D, dtype=torch.bfloat16, device=CUDA)
    slots = torch.zeros(B, dtype=torch.int64, device=CUDA)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=CUDA)
    seq_lens = torch.ones(B, dtype=torch.int32, device=CUDA)
    tables = torch.zeros(B, max_len // BS, dtype=torch.int32, device=CUDA)
    out = torch.empty_like(q)

    def step() -> None:
        reshape_and_cache(k_new, v_new, k_cache, v_cache, slots)
        paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, tables, D**-0.5, 1, max_len)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        lens = torch.randint(1, max_len + 1, (B,), generator=g)
        lens[0] = 0 if trial == 1 else lens[0]  # a padding row
        perm = torch.randperm(NB - 1, generator=g)[: B * (max_len // BS)].view(B, -1) + 1
        seq_lens.copy_(lens)
        tables.copy_(perm)
        q.copy_(torch.randn(B, H, D, generator=g))
        k_new.copy_(torch.randn(B, KVH, D, generator=g))
        v_new.copy_(torch.randn(B, KVH, D, generator=g))
        last = (lens - 1).clamp(min=0)
        slot = perm[torch.arange(B), last // BS] * BS + last % BS
        slot[lens == 0] = -1
        slots.copy_(slot)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_reference(q, k_cache, v_cache, qsl, seq_lens, tables, D**-0.5)
        assert_close(out, ref)
        p3 = int(last[3])
        assert torch.equal(k_cache[int(perm[3, p3 // BS]), :, p3 % BS], k_new[3])


def test_sampling_on_gpu_matches_cpu_sampler() -> None:
    """On GPU logits (vocabulary 49152): the same filtered distributions as the CPU sampler and the
    same greedy and seeded tokens (the uniforms are drawn on the host from the same generators)."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7, min_p=0.05, seed=3),
              SamplingParams(temperature=1.1, top_k=200, top_p=0.95, min_p=0.01, seed=4)] * 8
    logits = torch.randn(len(params), 49152, generator=torch.Generator().manual_seed(7)) * 4

    def rows() -> list[SamplingRow]:
        return [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
                for p in params]

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    chosen = [params[i] for i in random_rows]
    ours = Sampler._probs(chosen, logits[random_rows].to(CUDA), logits.shape[1]).cpu()
    theirs = Sampler._probs(chosen, logits[random_rows].clone(), logits.shape[1])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    on_gpu = Sampler(seed=9).sample(logits.to(CUDA), rows())
    assert on_gpu.token_ids == Sampler(seed=9).sample(logits.clone(), rows()).token_ids
