"""The cpu set's weight arena: blocks moved in place into huge-page-advised memory, holders following,
nothing left behind; and the default model's projections living there once bound."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

from troupe.kernels.cpu import arena
from troupe.kernels.cpu.arena import WeightArena
from troupe.kernels.quant import QType, QuantizedTensor, random_quantized


def test_place_moves_bytes_in_place_and_aligned() -> None:
    """`place` keeps the bytes and the tensor object, points it into the arena on a 64-byte line, and a
    second placement of the same tensor is a no-op."""
    a = WeightArena()
    tensors = [torch.randint(0, 256, (n, 20), dtype=torch.uint8) for n in (3, 50, 7)]
    copies = [t.clone() for t in tensors]
    for t in tensors:
        a.place(t)
    for t, c in zip(tensors, copies, strict=True):
        assert a.holds(t) and torch.equal(t, c) and t.data_ptr() % 64 == 0
    ptr = tensors[0].data_ptr()
    a.place(tensors[0])
    assert tensors[0].data_ptr() == ptr
    assert not a.holds(copies[0])


def test_place_frees_the_old_buffer_and_spans_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The moved weight's old buffer is released (here a numpy array, which then dies), and weights that
    do not fit the current chunk open a new one, each weight contiguous and intact."""
    monkeypatch.setattr(arena, "CHUNK_BYTES", 4096)
    a = WeightArena()
    buf = np.random.default_rng(0).integers(0, 256, (64, 40), dtype=np.uint8)
    alive = weakref.ref(buf)
    t = torch.from_numpy(buf)
    ref = t.clone()
    del buf
    a.place(t)
    gc.collect()
    assert alive() is None and torch.equal(t, ref)
    big = torch.randint(0, 256, (3, 3000), dtype=torch.uint8)  # 9000 bytes: a chunk of its own
    more = [torch.randint(0, 256, (10, 100), dtype=torch.uint8) for _ in range(6)]  # 1000 bytes each
    ref_big, ref_more = big.clone(), [m.clone() for m in more]
    for w in (big, *more):
        a.place(w)
    assert torch.equal(big, ref_big) and all(torch.equal(m, r) for m, r in zip(more, ref_more, strict=True))
    assert len(a._spans) >= 3 and all(a.holds(w) for w in (t, big, *more))


def test_place_refuses_other_tensors() -> None:
    """Only contiguous uint8 blocks are placed; anything else is an error naming what was given."""
    with pytest.raises(ValueError, match="uint8"):
        WeightArena().place(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="contiguous"):
        WeightArena().place(torch.zeros(4, 4, dtype=torch.uint8).t())


@pytest.mark.timeout(600)  # the first cpu-set use of a process may build the kernels
def test_cpu_set_projection_moves_its_weight_and_stays_exact() -> None:
    """`CpuKernels.linear` moves a quantized weight into its arena; the weight's other holders (an
    embedding lookup bound before) follow, and the results equal the reference."""
    from troupe.kernels.cpu import CpuKernels, available

    if not available():
        pytest.skip("the compiled kernels cannot be built here")
    w = random_quantized(QType.Q8_0, 64, 96, torch.Generator().manual_seed(3))
    assert isinstance(w, QuantizedTensor)
    ref = w.dequantize()
    kernels = CpuKernels()
    lookup = kernels.embedding(w)
    head = kernels.linear(w)
    assert kernels.arena.holds(w.data)
    x = torch.randn(2, 96)
    assert float((head(x).double() - x.double() @ ref.double().T).abs().max()) < 1e-4
    ids = torch.tensor([0, 63, 5])
    assert torch.equal(lookup(ids), ref[ids])


@pytest.mark.timeout(600)
def test_default_model_projections_live_in_the_arena() -> None:
    """Loading the default model on the cpu set leaves every projection's blocks and the tied embedding
    (the LM head's table) in the arena, and no block tensor outside it."""
    from troupe.kernels.cpu import CpuKernels, available
    from troupe.kernels.cpu.linear import QuantizedLinear
    from troupe.models.loader import load_model, resolve_model_path

    if not available():
        pytest.skip("the compiled kernels cannot be built here")
    kernels = CpuKernels()
    model, _ = load_model(resolve_model_path(None), kernels=kernels)
    projections = [p for layer in model.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    projections.append(model.head)
    assert all(isinstance(p, QuantizedLinear) and kernels.arena.holds(p.data) for p in projections)
    assert isinstance(model.embed, QuantizedTensor) and kernels.arena.holds(model.embed.data)
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        blocks = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.uint8]
    outside = [o for o in blocks if o.numel() > 100_000 and not kernels.arena.holds(o)]
    assert blocks and outside == []
