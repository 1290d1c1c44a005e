"""The compiled projection kernels (troupe_qmm) against the plain-torch reference, one function per check.

Imported by test_cpu_linear.py for the build of this CPU, and run as a script (`python qmm_cases.py`) in a
subprocess with TROUPE_CPU_ISA=avx2 for the AVX2/FMA baseline (a library registered under one
TORCH_LIBRARY name loads once per process). Every weight is random valid blocks of its format
(`troupe.kernels.quant.random_quantized`); the reference is float64 math on `QuantizedTensor.dequantize()`.
"""

from __future__ import annotations

import torch

from troupe.kernels.cpu.build import cpu_flags, cpu_vendor
from troupe.kernels.quant import QType, QuantizedTensor, random_quantized

FORMATS = [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K]
INTEGER_FORMATS = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K]
ROWS = [1, 2, 7, 64, 300]  # M
N = 37  # output columns: not a multiple of any vector width or tile


def ops() -> object:
    from troupe.kernels.cpu import linear
    from troupe.kernels.cpu.build import load_ops

    assert load_ops("qmm", linear.SOURCES)
    return torch.ops.troupe_qmm


def weight(qtype: QType, n: int = N, seed: int = 0) -> QuantizedTensor:
    """(n, K) in `qtype`, K = 2 blocks + for K-quants (512), 5 blocks of 32 otherwise (160)."""
    k = 512 if qtype.block_size == 256 else 160
    w = random_quantized(qtype, n, k, torch.Generator().manual_seed(seed))
    if isinstance(w, torch.Tensor):  # F32: the same bytes as a "quantized" tensor of blocks of one value
        return QuantizedTensor(QType.F32, w.contiguous().view(torch.uint8).reshape(n, -1), (n, k))
    return w


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def check_dequantize(qtype: QType) -> None:
    """The dequantize and embedding ops give the reference's float32 values bit for bit."""
    w = weight(qtype)
    ref = w.dequantize()
    got = ops().dequantize(w.data, int(qtype), w.shape[1])
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"{qtype.name}: dequantize differs"
    ids = torch.tensor([3, 0, N - 1, 3, 17])
    rows = ops().embedding(w.data, int(qtype), w.shape[1], ids)
    assert torch.equal(rows.view(torch.int32), ref[ids].view(torch.int32)), f"{qtype.name}: embedding differs"


def build_isa() -> str:
    from troupe.kernels.cpu.build import isa

    return isa()


def check_linear(qtype: QType) -> None:
    """Every path (rows, panel, the former panel, chosen by M) equals x @ W.T + b up to float32 summation order, for every M,
    with and without bias."""
    w = weight(qtype)
    ref = w.dequantize().double()
    g = torch.Generator().manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, w.shape[1], generator=g)
        for bias in (None, torch.randn(N, generator=g)):
            want = x.double() @ ref.T + (bias.double() if bias is not None else 0.0)
            for path in (-1, 0, 1, 3):
                got = ops().linear(x, w.data, int(qtype), bias, path)
                assert got.shape == (m, N) and got.dtype == torch.float32
                err = rel_err(got, want)
                assert err < 1e-5, f"{qtype.name} M={m} bias={bias is not None} path={path}: rel err {err:.1e}"
            if m == 7:  # by M: the rows path (two passes) on an AVX-512 build, the former panel on AVX2
                avx512 = build_isa() == "native" and "avx512f" in cpu_flags()
                forced = ops().linear(x, w.data, int(qtype), bias, 0 if avx512 else 3)
                assert torch.equal(ops().linear(x, w.data, int(qtype), bias, -1), forced), f"{qtype.name}: M=7 by M"


def check_rows_path(qtype: QType) -> None:
    """The decode-sized paths (0: several weight rows in flight, 2: the former one-row kernel) on every
    M = 1..4 (and 5, 8, 12, 13, 32: passes of four rows of x; by M an AVX-512 build takes it up to 12)
    and on N below, at and off the kernel's row group (1, 2, 3, 4, 5, 8, 37), with and without bias;
    and N = 1001 (a run of row groups per thread, then a one-row tail) at M = 1 and 3."""
    g = torch.Generator().manual_seed(7)
    for n, ms in [(1, (1, 2, 3, 4)), (2, (1, 4)), (3, (1, 2, 3, 4)), (4, (1, 3)), (5, (1, 2, 3, 4, 5, 8)),
                  (8, (1, 2, 3, 4)), (N, (1, 2, 3, 4, 5, 8, 12, 13, 32)), (1001, (1, 3))]:
        w = weight(qtype, n=n, seed=n)
        ref = w.dequantize().double()
        for m in ms:
            x = torch.randn(m, w.shape[1], generator=g)
            for bias in (None, torch.randn(n, generator=g)):
                want = x.double() @ ref.T + (bias.double() if bias is not None else 0.0)
                for path in (0, 2):
                    got = ops().linear(x, w.data, int(qtype), bias, path)
                    assert got.shape == (m, n)
                    err = rel_err(got, want)
                    assert err < 1e-5, f"{qtype.name} N={n} M={m} bias={bias is not None} path={path}: rel err {err:.1e}"


PANEL_SHAPES = [(1, 9), (17, 13), (33, 100), (1001, 9), (70, 999)]  # (N, M): N off the panel width and tile


def check_panel_path(qtype: QType) -> None:
    """The panel GEMM (path 1) and the former dot-product panel (path 3) on the outer-product kernel's
    edges: M not a multiple of its row block (9, 13, 100, 999; both schedules, small and large M), N
    below, at and off its panel widths and tiles (1, 17, 33, 70, 1001), K off its K slice (1664 = 576 +
    576 + 512 for 32-value blocks, 1792 = 3 x 512 + 256 for K-quants), with and without bias, on 1 and 2
    threads (a tile per thread, and tiles split between them); and the by-M choice between the two."""
    g = torch.Generator().manual_seed(11)
    k = 1792 if qtype.block_size == 256 else 1664
    threads = torch.get_num_threads()
    try:
        for n, m in PANEL_SHAPES:
            w = random_quantized(qtype, n, k, torch.Generator().manual_seed(n))
            if isinstance(w, torch.Tensor):
                w = QuantizedTensor(QType.F32, w.contiguous().view(torch.uint8).reshape(n, -1), (n, k))
            ref = w.dequantize().double()
            x = torch.randn(m, k, generator=g)
            for bias in (None, torch.randn(n, generator=g)):
                want = x.double() @ ref.T + (bias.double() if bias is not None else 0.0)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    outs = {}
                    for path in (1, 3):
                        got = outs[path] = ops().linear(x, w.data, int(qtype), bias, path)
                        assert got.shape == (m, n)
                        err = rel_err(got, want)
                        assert err < 1e-5, (f"{qtype.name} N={n} M={m} K={k} bias={bias is not None} threads={t} "
                                            f"path={path}: rel err {err:.1e}")
                    # by M: the rows path up to 12 rows on an AVX-512 build (faster on weights that come
                    # from memory), then the GEMM; on an AVX2 build the former kernel up to 64 rows
                    avx512 = build_isa() == "native" and "avx512f" in cpu_flags()
                    chosen = (0 if m <= 12 else 1) if avx512 else (1 if m > 64 else 3)
                    if chosen == 0:
                        outs[0] = ops().linear(x, w.data, int(qtype), bias, 0)
                    assert torch.equal(ops().linear(x, w.data, int(qtype), bias, -1), outs[chosen]), (
                        f"{qtype.name} N={n} M={m}: by M is not path {chosen}")
    finally:
        torch.set_num_threads(threads)


def reference_q8(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-value chunk rounded to its 8-bit grid: d = max|x| / 127, round(x * (1 / d)) * d (the
    kernel's float32 reciprocal, so that ties round alike)."""
    m, k = x.shape
    chunks = x.reshape(m, k // 32, 32)
    d = chunks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(chunks * torch.where(d == 0, torch.zeros_like(d), 1 / d))
    return (q * d).reshape(m, k)


Q8_PATHS = {0: "rows kernel", 1: "tiled GEMM"}


def check_q8(qtype: QType) -> None:
    """8-bit activations on every integer path (the rows kernel, the tiled GEMM, the choice by M): the
    kernel equals float math on the 8-bit-rounded x (up to float32 rounding), and stays within 2% (of the
    largest output) of the exact projection. M covers the micro-kernel's remainders (7, 300 rows), N = 37
    a partial group of weight rows; a wider (N = 300, K = 1536) weight splits into several tiles a thread."""
    cases = [(weight(qtype), ROWS), (wide_weight(qtype), [19, 64])]
    g = torch.Generator().manual_seed(2)
    for w, rows in cases:
        n, k = w.shape
        ref = w.dequantize().double()
        for m in rows:
            x = torch.randn(m, k, generator=g)
            bias = torch.randn(n, generator=g)
            outs = {path: ops().linear_q8(x, w.data, int(qtype), bias, path) for path in (0, 1)}
            for path, got in outs.items():
                name = Q8_PATHS[path]
                assert got.shape == (m, n) and got.dtype == torch.float32
                err = rel_err(got, reference_q8(x).double() @ ref.T + bias.double())
                assert err < 1e-5, f"{qtype.name} N={n} M={m} {name}: rel err {err:.1e} against the rounded x"
                err = rel_err(got, x.double() @ ref.T + bias.double())
                assert 1e-6 < err < 0.02, f"{qtype.name} N={n} M={m} {name}: q8 error {err:.1e} out of bounds"
            # by M: the result of the kernel `q8_path` names (-1 the exact float path), whose choice
            # follows the build's measured crossovers
            chosen = ops().linear_q8(x, w.data, int(qtype), bias, -1)
            exact = ops().linear(x, w.data, int(qtype), bias, -1)
            path = ops().q8_path(int(qtype), m)
            assert torch.equal(chosen, exact if path < 0 else outs[path]), f"{qtype.name} M={m}: by M, path {path}"
            # both ISAs' rules (qmatmul_q8.cpp): one row never pays for unpacking the GEMM's tiles; from 5
            # rows a format with the GEMM takes it (Q6_K has none; Q8_0 has it only with VNNI)
            assert m > 1 or path != 1, f"{qtype.name}: one row took the GEMM"
            if m >= 5 and qtype not in (QType.Q6_K, QType.Q8_0):
                assert path == 1, f"{qtype.name} M={m}: a batch took path {path}, not the GEMM"
        no_bias = ops().linear_q8(x, w.data, int(qtype), None, 1)
        assert rel_err(no_bias, reference_q8(x).double() @ ref.T) < 1e-5, f"{qtype.name}: GEMM without bias"


def check_q8_tables() -> None:
    """The q8 mode's by-M tables (qmatmul_q8.cpp `ByM`): AVX2 builds on AMD CPUs take the integer rows
    kernel for 1-2 rows (measured faster there), every other build and CPU the exact float path up to 4
    rows; then the GEMM, or for a format without it (Q6_K) the rows kernel up to 4 rows (integer first)
    or the float path (float first)."""
    avx512 = build_isa() == "native" and "avx512f" in cpu_flags()
    integer_first = not avx512 and cpu_vendor() == "AuthenticAMD"
    assert ops().q8_table() == int(integer_first)
    want = {
        True: {QType.Q4_1: [0, 0, 1, 1, 1, 1], QType.Q6_K: [0, 0, 0, 0, -1, -1]},
        False: {QType.Q4_1: [-1, -1, -1, -1, 1, 1], QType.Q6_K: [-1, -1, -1, -1, -1, -1]},
    }
    for table, by_format in want.items():
        for qtype, paths in by_format.items():
            got = [ops().q8_path_with(int(qtype), m, table) for m in (1, 2, 3, 4, 5, 64)]
            assert got == paths, f"{qtype.name}, integer first {table}: {got}"
            if table == integer_first:
                assert got == [ops().q8_path(int(qtype), m) for m in (1, 2, 3, 4, 5, 64)]
    assert ops().q8_path_with(int(QType.F16), 1, True) == -1  # float formats: the float path


def wide_weight(qtype: QType) -> QuantizedTensor:
    """(300, 1536) in `qtype`: more weight rows than one tile of the GEMM holds at this K."""
    w = random_quantized(qtype, 300, 1536, torch.Generator().manual_seed(7))
    assert isinstance(w, QuantizedTensor)
    return w


def check_quantize_q8() -> None:
    """The activation quantization: int8 values, per-chunk scales and per-16 scaled sums as the reference."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    x[1, :32] = 0.0  # an all-zero chunk: scale 0, values 0
    q, d, ds = ops().quantize_q8(x)
    chunks = x.reshape(5, 3, 32)
    want_d = chunks.abs().amax(-1) / 127
    want_q = torch.round(chunks * torch.where(want_d == 0, torch.zeros_like(want_d), 1 / want_d).unsqueeze(-1))
    assert torch.equal(d, want_d)
    assert torch.equal(q.reshape(5, 3, 32).float(), want_q)
    want_ds = (want_q.reshape(5, 6, 16).sum(-1) * want_d.repeat_interleave(2, dim=1))
    assert torch.allclose(ds, want_ds, rtol=1e-6, atol=0)


def check_float_formats_in_q8_mode() -> None:
    """F16 / BF16 / F32 weights have no integer path: linear_q8 gives the exact float result."""
    for qtype in (QType.F32, QType.F16, QType.BF16):
        w = weight(qtype)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(4))
        got = torch.ops.troupe_qmm.linear_q8(x, w.data, int(qtype), None, -1)
        assert rel_err(got, x.double() @ w.dequantize().double().T) < 1e-5


def check_bad_arguments() -> None:
    """Wrong shapes and formats are errors naming the problem, not wrong answers."""
    w = weight(QType.Q4_1)
    x = torch.randn(2, w.shape[1])
    for call, words in (
        (lambda: ops().linear(x, w.data, 99, None, -1), "unknown weight format"),
        (lambda: ops().linear(torch.randn(2, 96), w.data, int(QType.Q4_1), None, -1), "bytes"),
        (lambda: ops().linear(x, w.data, int(QType.Q4_1), torch.randn(5), -1), "bias"),
        (lambda: ops().linear(x, w.data, int(QType.Q4_1), None, 4), "path"),
        (lambda: ops().embedding(w.data, int(QType.Q4_1), w.shape[1], torch.tensor([N])), "out of range"),
    ):
        try:
            call()
        except RuntimeError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"no error for {words!r}")


def main() -> None:
    """Every check, for the build this process loads (the test runs it under TROUPE_CPU_ISA=avx2)."""
    for qtype in FORMATS:
        check_dequantize(qtype)
        check_linear(qtype)
        check_rows_path(qtype)
        check_panel_path(qtype)
    for qtype in INTEGER_FORMATS:
        check_q8(qtype)
    check_quantize_q8()
    check_q8_tables()
    check_float_formats_in_q8_mode()
    check_bad_arguments()
    from troupe.kernels.cpu.build import isa

    print(f"ok {isa()}")


if __name__ == "__main__":
    main()
