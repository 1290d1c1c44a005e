"""The attention features (`troupe.kernels.base`, "Attention features"): the plain-torch reference with a
sliding window and soft-capping against transformers' own Gemma 2 eager attention over transformers' own
mask functions, and the `KernelSet` side (which sets run them, which option values are refused)."""

from __future__ import annotations

import pytest
import torch
from factories import random_block_tables
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from troupe.errors import InvalidInputError
from troupe.kernels import reference
from troupe.kernels.base import ATTENTION_FEATURES, AttentionMetadata, KernelSet
from troupe.kernels.eager import EagerKernels

# (tokens already cached, new tokens): whole prompts, decodes, chunks after cached context
SEQS = [(0, 7), (6, 1), (0, 1), (13, 4), (30, 1), (16, 16), (20, 9)]
H, KVH, D, BS = 6, 2, 16, 4


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (tiny tensors: on a shared machine a second thread only costs), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Module(torch.nn.Module):
    """What transformers' eager attention reads of its attention module."""

    num_key_value_groups = H // KVH


def _contexts(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per sequence its whole context's keys and values (ctx, KVH, D), and the step's queries (T, H, D)."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(c + n, KVH, D, generator=g) for c, n in SEQS]
    vals = [torch.randn(c + n, KVH, D, generator=g) for c, n in SEQS]
    return keys, vals, torch.randn(sum(n for _, n in SEQS), H, D, generator=g) * 2  # larger scores: caps bite


def _paged(keys: list[torch.Tensor], vals: list[torch.Tensor], seed: int):
    """The contexts written into a shuffled pool (NB, BS, KVH, D) full of other values, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(SEQS, BS, g)
    k_cache, v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g), torch.randn(num_blocks, BS, KVH, D, generator=g)
    for kk, vv, table in zip(keys, vals, tables, strict=True):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(kk.shape[0])])
        reference.write_kv(kk, vv, k_cache, v_cache, slots)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),  # unused by attention
        query_start_loc=torch.tensor([0] + [n for _, n in SEQS]).cumsum(0),
        seq_lens=torch.tensor([c + n for c, n in SEQS]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
    )
    return k_cache, v_cache, meta


def _transformers(q: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor], scale: float,
                  window: int | None, softcap: float | None) -> torch.Tensor:
    """Each sequence through transformers' Gemma 2 eager attention with transformers' causal (or
    sliding-window causal) mask at the new tokens' positions: (T, H, D) float32."""
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    out, t = [], 0
    for (cached, n), kk, vv in zip(SEQS, keys, vals, strict=True):
        q_idx = torch.arange(cached, cached + n)[:, None]  # (n, 1) positions of the new tokens
        kv_idx = torch.arange(cached + n)[None, :]  # (1, ctx)
        visible = mask_fn(0, 0, q_idx, kv_idx)  # (n, ctx)
        bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]  # (1, 1, n, ctx)
        o, _ = eager_attention_forward(_Module().eval(), q[t : t + n].transpose(0, 1)[None],
                                       kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], bias,
                                       scaling=scale, softcap=softcap)  # (1, n, H, D)
        out.append(o[0])
        t += n
    return torch.cat(out)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 1, 3, 7, 16, 64])
def test_reference_matches_transformers(window, softcap):
    """`reference.paged_attention` over a shuffled pool equals transformers' Gemma 2 eager attention on the
    dense contexts with transformers' mask functions, for windows of 1 position, smaller than most contexts,
    equal to some (7, 16) and larger than all, with and without soft-capping."""
    keys, vals, q = _contexts(seed=1)
    k_cache, v_cache, meta = _paged(keys, vals, seed=2)
    scale = D**-0.5
    out = reference.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=window, softcap=softcap)
    expected = _transformers(q, keys, vals, scale, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_features_change_the_result():
    """The oracle above is not blind to the features: a window shorter than the contexts and a cap below
    the scores each change the output, and a window longer than every context does not."""
    keys, vals, q = _contexts(seed=3)
    k_cache, v_cache, meta = _paged(keys, vals, seed=4)
    plain = reference.paged_attention(q, k_cache, v_cache, meta, 0.5)
    assert not torch.allclose(reference.paged_attention(q, k_cache, v_cache, meta, 0.5, sliding_window=3), plain)
    assert not torch.allclose(reference.paged_attention(q, k_cache, v_cache, meta, 0.5, softcap=1.0), plain)
    assert torch.equal(reference.paged_attention(q, k_cache, v_cache, meta, 0.5, sliding_window=64), plain)


def test_every_kernel_set_runs_both_features():
    """The eager, compiled CPU and CUDA sets declare both features (`attention_features`); the base
    declares none, so a set written without them is refused rather than silently wrong."""
    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cuda.kernel_set import CudaKernels

    assert ATTENTION_FEATURES == {"sliding_window", "softcap"}
    for cls in (EagerKernels, CpuKernels, CudaKernels):
        assert cls.attention_features == ATTENTION_FEATURES, cls.name
    assert KernelSet.attention_features == frozenset()


class _Plain(EagerKernels):
    name = "plain"
    attention_features = frozenset({"softcap"})


@pytest.mark.parametrize(("window", "softcap", "field", "message"), [
    (0, None, "sliding_window", "int >= 1"),
    (-4, None, "sliding_window", "int >= 1"),
    (2.5, None, "sliding_window", "int >= 1"),
    (True, None, "sliding_window", "int >= 1"),
    (None, 0.0, "softcap", "finite float > 0"),
    (None, -30.0, "softcap", "finite float > 0"),
    (None, float("inf"), "softcap", "finite float > 0"),
    (None, float("nan"), "softcap", "finite float > 0"),
])
def test_bad_options_are_refused(window, softcap, field, message):
    """A window below one position (or not an int) and a cap that is not finite and positive are
    `InvalidInputError`s naming the option and what is allowed."""
    with pytest.raises(InvalidInputError, match=message) as err:
        EagerKernels().check_attention_options(window, softcap)
    assert err.value.field == field


def test_a_set_without_a_feature_refuses_it():
    """A set whose `attention_features` lacks the window refuses it by name, and accepts what it has."""
    _Plain().check_attention_options(None, 30.0)
    EagerKernels().check_attention_options(4096, 50.0)
    with pytest.raises(InvalidInputError, match="'plain' kernel set has no attention with sliding_window"):
        _Plain().check_attention_options(4096, None)
