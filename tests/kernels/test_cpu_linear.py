"""Quantized weights and the compiled projections: the torch reference against the gguf package, every
kernel against the reference on irregular shapes (this CPU's build and the AVX2 baseline), and the cpu
kernel set's `linear` / `embedding` as the model uses them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import qmm_cases as cases
import torch

from troupe.kernels.cpu import build
from troupe.kernels.quant import QType, QuantizedTensor, dequantize, random_quantized

needs_build = pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                 reason="no AVX2/FMA/F16C CPU or no C++ compiler here")


pytestmark = pytest.mark.timeout(600)  # the first test of a process may build the C++ extensions


@pytest.mark.parametrize("qtype", cases.FORMATS, ids=lambda q: q.name)
def test_reference_dequantization_equals_gguf_packages(qtype: QType) -> None:
    """troupe's torch dequantization gives gguf.quants.dequantize's float32 values bit for bit (an
    independent implementation of every layout), on random valid blocks."""
    import gguf

    w = cases.weight(qtype, n=19, seed=5)
    ours = w.dequantize().numpy()
    theirs = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert theirs.shape == ours.shape
    assert np.array_equal(theirs.astype(np.float32).view(np.uint32), ours.view(np.uint32))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.F16, QType.BF16], ids=lambda q: q.name)
def test_blocks_quantized_by_gguf_round_trip(qtype: QType) -> None:
    """Blocks written by gguf's own quantizer read back as gguf reads them, and within the format's step
    of the original values."""
    import gguf

    values = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype)))
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(6, -1)
    ours = dequantize(data, qtype, 256)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))
    assert np.array_equal(ours.numpy(), theirs)
    assert np.abs(ours.numpy() - values).max() < 0.1 * np.abs(values).max()


def test_quantized_tensor_rows_and_checks() -> None:
    """Rows move as whole blocks (permute, stack, look up) and a wrong byte shape is refused."""
    w = random_quantized(QType.Q4_K, 6, 512)
    assert isinstance(w, QuantizedTensor)
    order = torch.tensor([5, 0, 4, 1, 3, 2])
    assert torch.equal(w.permute_rows(order).dequantize(), w.dequantize()[order])
    both = QuantizedTensor.cat([w, w.permute_rows(order)])
    assert both.shape == (12, 512) and torch.equal(both.dequantize()[6:], w.dequantize()[order])
    assert torch.equal(w.dequantize_rows(torch.tensor([2, 2])), w.dequantize()[[2, 2]])
    with pytest.raises(ValueError, match="Q4_K"):
        QuantizedTensor(QType.Q4_K, w.data[:, :-1], (6, 512))
    with pytest.raises(ValueError, match="one format"):
        QuantizedTensor.cat([w, random_quantized(QType.Q6_K, 2, 512)])  # type: ignore[list-item]


@needs_build
@pytest.mark.parametrize("qtype", cases.FORMATS, ids=lambda q: q.name)
def test_kernels_dequantize_exactly(qtype: QType) -> None:
    """The compiled decoders (whole weights, embedding rows) reproduce the reference bit for bit."""
    cases.check_dequantize(qtype)


@needs_build
@pytest.mark.parametrize("qtype", cases.FORMATS, ids=lambda q: q.name)
def test_kernels_linear_match_reference(qtype: QType) -> None:
    """Every path of the float projection matches float64 math on the dequantized weight, M = 1..300,
    N = 37, with and without bias."""
    cases.check_linear(qtype)


@needs_build
@pytest.mark.parametrize("qtype", cases.FORMATS, ids=lambda q: q.name)
def test_kernels_rows_path_every_small_shape(qtype: QType) -> None:
    """The decode-sized kernels (several weight rows in flight, and the former one-row kernel) match
    float64 math for M = 1..4 (and 5, 8) on N below, at and off their row group (1..5, 8, 37, 1001)."""
    cases.check_rows_path(qtype)


@needs_build
@pytest.mark.parametrize("qtype", cases.FORMATS, ids=lambda q: q.name)
def test_kernels_panel_path_edges(qtype: QType) -> None:
    """The panel GEMM (and the former panel kernel) match float64 math where the outer-product kernel has
    edges: M off its row block (9, 13, 100, 999), N off its panel width and tile (1, 17, 33, 70, 1001), K
    off its K slice, bias on and off, on 1 and 2 threads; by M the GEMM is taken (AVX2 builds: from 65 rows)."""
    cases.check_panel_path(qtype)


@needs_build
@pytest.mark.parametrize("qtype", cases.INTEGER_FORMATS, ids=lambda q: q.name)
def test_kernels_q8_activations(qtype: QType) -> None:
    """8-bit activations on the rows kernel and the tiled GEMM: exact integer arithmetic on the rounded
    activations, within 2% of exact, irregular M and N."""
    cases.check_q8(qtype)


@needs_build
def test_kernels_q8_quantization_float_formats_and_errors() -> None:
    """The activation quantizer matches its reference; the by-M tables; float formats stay exact in q8
    mode; bad arguments are errors naming what is wrong."""
    cases.check_quantize_q8()
    cases.check_q8_tables()
    cases.check_float_formats_in_q8_mode()
    cases.check_bad_arguments()


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the AVX2 build and its checks, in a subprocess
def test_avx2_baseline_kernels_match_reference() -> None:
    """The AVX2/FMA build (what an AVX2-only machine runs) passes every check above, in a subprocess."""
    env = {**os.environ, "TROUPE_CPU_ISA": "avx2"}
    script = Path(cases.__file__)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900,
                         cwd=script.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok avx2")


@needs_build
def test_cpu_set_linear_and_embedding() -> None:
    """`CpuKernels.linear` keeps a quantized weight in its blocks (float32 and q8 activations, bias, a
    bfloat16 input cast round trip) and a dense weight on oneDNN; `embedding` expands looked-up rows only."""
    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cpu.linear import QuantizedLinear

    w = random_quantized(QType.Q4_1, 40, 64, torch.Generator().manual_seed(6))
    assert isinstance(w, QuantizedTensor)
    x = torch.randn(3, 64)
    b = torch.randn(40)
    want = x.double() @ w.dequantize().double().T + b.double()
    exact, q8 = CpuKernels(), CpuKernels(quantize_activations=True)
    lin = exact.linear(w, b)
    assert isinstance(lin, QuantizedLinear)
    assert cases.rel_err(lin(x), want) < 1e-5
    assert cases.rel_err(lin(x.bfloat16()).float(), want) < 2e-2 and lin(x.bfloat16()).dtype == torch.bfloat16
    # one row (a decode step): the float rows path where it is the faster (AVX-512 builds), exact; else
    # the integer rows kernel; a batch of 9 rows the tiled GEMM: really quantized, and close
    one = q8.linear(w, b)(x[:1])
    if torch.ops.troupe_qmm.q8_path(int(QType.Q4_1), 1) < 0:
        assert torch.equal(one, lin(x[:1]))
    else:
        assert 1e-6 < cases.rel_err(one, want[:1]) < 2e-2
    assert 1e-6 < cases.rel_err(q8.linear(w, b)(torch.cat([x] * 3)), torch.cat([want] * 3)) < 2e-2
    dense = torch.randn(40, 64)
    assert cases.rel_err(exact.linear(dense.clone(), b)(x), x.double() @ dense.double().T + b.double()) < 1e-5
    narrow = random_quantized(QType.F16, 40, 40)  # rows not whole 32-value chunks: expanded, eager path
    assert isinstance(narrow, QuantizedTensor) and not isinstance(exact.linear(narrow, None), QuantizedLinear)
    x40 = torch.randn(3, 40)
    assert cases.rel_err(exact.linear(narrow, None)(x40), x40.double() @ narrow.dequantize().double().T) < 1e-5
    ids = torch.tensor([7, 0, 39])
    assert torch.equal(exact.embedding(w)(ids), w.dequantize()[ids])
