"""troupe.kernels.eager.linear: the packed oneDNN projection gives F.linear's answer and releases the dense copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from troupe.kernels.eager.linear import Linear, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported(torch.float32), reason="no oneDNN packing on this build")


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)  # (N, K)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)  # (M, K)
    expected = F.linear(x, weight, bias)
    lin = Linear(weight.clone(), bias)
    assert lin.pack() and lin.packed is not None
    assert lin.weight.numel() == 0  # the dense copy is released
    out = lin(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert lin.pack()  # packing twice is a no-op


def test_unpackable_weight_stays_dense() -> None:
    """A dtype oneDNN cannot pack here (float64 never is) keeps its dense weight and F.linear."""
    weight = torch.randn(8, 4, dtype=torch.float64)
    lin = Linear(weight)
    assert not lin.pack() and lin.packed is None and lin.weight is weight
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(lin(x), F.linear(x, weight))
