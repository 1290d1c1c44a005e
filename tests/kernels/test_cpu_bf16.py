"""The "gguf-bf16" projections (`troupe_qmm.linear_bf16`, csrc/qmatmul_bf16.cpp, csrc/panel_bf16.h) against
float64 math on the dequantized weights, within the error that rounding x and W to bfloat16 allows; the
by-M choice (few rows: the exact float path); the mode's wiring (the decoder stack, the refusal on a CPU
without avx512_bf16).

The bound, per output element: x and W are each rounded once to bf16 (8 significant bits, round to nearest
even: relative error <= u = 2^-9), so each product x_k w_k is off by at most (2u + u^2) |x_k w_k|, and the
float32 sum of K products adds at most K * 2^-24 * sum |x_k w_k| (the standard gamma_K bound). Hence
|out - x @ W^T| <= (2^-8 + 2^-18 + K * 2^-24) * sum_k |x_k| |w_k| (+ the bias add's float32 rounding).
"""

from __future__ import annotations

import pytest
import torch
from qmm_cases import FORMATS, ops

from troupe.config import EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels.cpu import build
from troupe.kernels.quant import QType, QuantizedTensor, random_quantized

HAS_BF16 = "avx512_bf16" in build.cpu_flags() and build.isa() == "native"
needs_bf16 = pytest.mark.skipif(not HAS_BF16 or not build.REQUIRED_CPU_FLAGS <= build.cpu_flags(),
                                reason="this CPU lacks avx512_bf16 (or TROUPE_CPU_ISA=avx2): no bf16 kernels to test")
I16_FORMATS = [QType.Q4_K, QType.Q5_K, QType.Q6_K]  # the 16-bit rows path's (csrc/rows_i16.h)
ROWS = [9, 13, 31, 64, 65, 300]  # M: odd, around the fused/tiled switch at 64
N = 37  # not a multiple of the panel's 32 rows or of a vector


def kernels() -> list[int]:
    """The bf16 kernels this build has: 2 (avx512_bf16 dot products), 3 (AMX tiles) where available."""
    return [2, 3][: int(ops().bf16_kernels())]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest error bf16 inputs with float32 sums allow for x (M, K) @ w (N, K)^T (module docstring)."""
    k = x.shape[1]
    return (2.0**-8 + 2.0**-18 + k * 2.0**-24) * (x.double().abs() @ w.double().abs().T) + 1e-30


def check(qtype: QType, k: int, path: int, seed: int = 0) -> float:
    """linear_bf16 with `path` over ROWS, with and without bias: within the bound everywhere; returns the
    largest error as a share of the bound."""
    w = random_quantized(qtype, N, k, torch.Generator().manual_seed(seed))
    if isinstance(w, torch.Tensor):  # F32: its bytes as blocks of one value
        from troupe.kernels.quant import QuantizedTensor

        w = QuantizedTensor(QType.F32, w.contiguous().view(torch.uint8).reshape(N, -1), (N, k))
    ref = w.dequantize()
    g = torch.Generator().manual_seed(seed + 1)
    worst = 0.0
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        for bias in (None, torch.randn(N, generator=g)):
            got = ops().linear_bf16(x, w.data, int(qtype), bias, path)
            assert got.shape == (m, N) and got.dtype == torch.float32
            want = x.double() @ ref.double().T + (bias.double() if bias is not None else 0.0)
            slack = bound(x, ref) + (bias.double().abs() * 2.0**-23 if bias is not None else 0.0)
            share = ((got.double() - want).abs() / slack).max().item()
            assert share <= 1.0, f"{qtype.name} M={m} K={k} path {path}: error {share:.2f} of the bf16 bound"
            worst = max(worst, share)
    return worst


@needs_bf16
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_bf16_gemm_within_the_rounding_bound(qtype: QType) -> None:
    """Every format, every bf16 kernel here, M past the float path (odd, both schedules), N = 37 (a partial
    panel), K of 5 blocks of 32 (or 2 of 256) and K longer than a panel slice (PANEL_KC = 576): within the
    bf16 bound, and with errors of bf16's size (not the float32 path's 2^-24 scale)."""
    for path in kernels():
        for k in ((512, 768) if qtype.block_size == 256 else (160, 640)):
            share = check(qtype, k, path)
            assert share > 1e-3, f"{qtype.name} K={k} path {path}: error {share:.1e} of the bound: not bf16?"


@needs_bf16
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.Q4_1], ids=lambda q: q.name)
def test_by_m_choice_and_errors(qtype: QType) -> None:
    """Up to `bf16_rows_max_m()` rows (8 with AMX, 6 with the dot-product kernel on AMD, else 12) the mode
    is the 16-bit rows path (path 4) for the K-quants and the output-exact float path for the other
    formats, bit for bit; above, the bf16 GEMM with the CPU's best kernel (path 1); bad arguments are refused
    with the reason."""
    w = random_quantized(qtype, N, 512, torch.Generator().manual_seed(5))
    limit = ops().bf16_rows_max_m()
    amd = build.cpu_vendor() == "AuthenticAMD"
    assert limit == (8 if ops().bf16_kernels() == 2 else 6 if amd else 12)
    for m in (1, 4, limit, limit + 1, 40):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        got = ops().linear_bf16(x, w.data, int(qtype), None, -1)
        if m <= limit and qtype in I16_FORMATS:
            assert torch.equal(got, ops().linear_bf16(x, w.data, int(qtype), None, 4))
            assert not torch.equal(got, ops().linear(x, w.data, int(qtype), None, -1))
        elif m <= limit:
            assert torch.equal(got, ops().linear(x, w.data, int(qtype), None, -1))
        else:
            assert torch.equal(got, ops().linear_bf16(x, w.data, int(qtype), None, 1))
            assert torch.equal(got, ops().linear_bf16(x, w.data, int(qtype), None, kernels()[-1]))
    with pytest.raises(RuntimeError, match="bf16 path must be"):
        ops().linear_bf16(torch.zeros(20, 512), w.data, int(qtype), None, 7)
    if qtype not in I16_FORMATS:
        with pytest.raises(RuntimeError, match=f"16-bit rows path needs .*got format {int(qtype)}"):
            ops().linear_bf16(torch.zeros(2, 512), w.data, int(qtype), None, 4)
    with pytest.raises(RuntimeError, match="does not match K"):
        ops().linear_bf16(torch.zeros(20, 256), w.data, int(qtype), None, 1)


def weight_parts(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|ds * q|, |dm|) per value (n, k) of a K-quant weight, w = ds * q - dm: the integer part the 16-bit rows
    path multiplies with x's int16 values and the min it takes off with x's sums (Q6_K: |w| and 0)."""
    from troupe.kernels.quant import k_scale_min

    n, k = w.shape
    if w.qtype == QType.Q6_K:
        return w.dequantize().double().abs(), torch.zeros(n, k, dtype=torch.float64)
    nbytes = 176 if w.qtype == QType.Q5_K else 144
    b = w.data.reshape(n, k // 256, nbytes)
    f16 = b[..., 0:4].contiguous().view(torch.float16).float()  # (n, nb, 2): d, dmin
    sc, mn = k_scale_min(b[..., 4:16].reshape(-1, 12))
    ds = (f16[..., 0:1] * sc.reshape(n, -1, 8).float()).abs()  # (n, nb, 8)
    dm = (f16[..., 1:2] * mn.reshape(n, -1, 8).float()).abs()
    qs = b[..., nbytes - 128:].reshape(n, -1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1, 8, 32)
    if w.qtype == QType.Q5_K:  # bit j of qh[l]: bit 4 of value l of sub-block j
        qh = b[..., 16:48].reshape(n, -1, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
    dsq = (ds.double().unsqueeze(-1) * q.double()).reshape(n, k)
    return dsq, dm.double().unsqueeze(-1).expand(n, -1, 8, 32).reshape(n, k)


def i16_slack(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The largest error of the 16-bit rows path (csrc/rows_i16.h) for x (M, K) @ the K-quant weight w^T: x
    rounded to int16 steps of s = max |x| / 32767 per 32-value chunk (at most s / 2 a value) times |ds * q| of
    the weight, plus float32 rounding (generously (K / 8 + 64) * 2^-24 of sum |x| (|ds q| + |dm|)) and the
    bias add's."""
    dsq, dm = weight_parts(w)
    k = x.shape[1]
    xa = x.double().abs()
    step = xa.reshape(x.shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x.shape) / 65534
    slack = step @ dsq.T + (k / 8 + 64) * 2.0**-24 * (xa @ (dsq + dm).T)
    return slack + (bias.double().abs() * 2.0**-23 if bias is not None else 0.0) + 1e-30


@needs_bf16
@pytest.mark.parametrize("qtype", I16_FORMATS, ids=lambda q: q.name)
def test_16_bit_rows_path_within_its_bound(qtype: QType) -> None:
    """The K-quants on the 16-bit rows path (path 4, and what path -1 takes up to the rows limit): M = 1..13
    (passes of 4 rows of x), N = 37 (a partial group of 4), K = 512 and 768, with and without bias, x with a
    large outlier per row and an all-zero row: within the bound of x's int16 rounding (`i16_slack`), and at
    that rounding's scale (not float32's, not bf16's)."""
    g = torch.Generator().manual_seed(9)
    worst = 0.0
    for k in (512, 768):
        w = random_quantized(qtype, N, k, g)
        assert isinstance(w, QuantizedTensor)
        ref = w.dequantize().double()
        for m in (1, 2, 3, 4, 5, 8, 13):
            x = torch.randn(m, k, generator=g)
            x[:, 7] *= 300.0  # an outlier: its chunk's step grows, the other chunks' do not
            x[m // 2] = 0.0
            for bias in (None, torch.randn(N, generator=g)):
                got = ops().linear_bf16(x, w.data, int(qtype), bias, 4)
                want = x.double() @ ref.T + (bias.double() if bias is not None else 0.0)
                share = ((got.double() - want).abs() / i16_slack(x, w, bias)).max().item()
                assert share <= 1.0, f"{qtype.name} M={m} K={k}: error {share:.2f} of the int16 bound"
                worst = max(worst, share)
                if bias is None:
                    assert torch.equal(got[m // 2], torch.zeros(N)), "a zero row of x gives zeros"
    assert worst > 1e-3, f"{qtype.name}: error {worst:.1e} of the int16 bound: is x rounded at all?"


def test_refused_where_the_cpu_lacks_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization="gguf-bf16" on a CPU without avx512_bf16 (simulated: its flags without it) or on the
    AVX2 baseline build is an error naming `quantization` and what is missing; on the eager set it needs the
    compiled kernels."""
    from troupe.kernels.select import select_kernels

    flags = build.cpu_flags()
    monkeypatch.setattr(build, "cpu_flags", lambda: flags - {"avx512_bf16"})
    with pytest.raises(InvalidInputError, match="quantization: 'gguf-bf16' .*this CPU lacks avx512_bf16"):
        select_kernels(EngineConfig(kernels="cpu", quantization="gguf-bf16"))
    monkeypatch.setattr(build, "cpu_flags", lambda: flags | {"avx512_bf16"})
    monkeypatch.setenv("TROUPE_CPU_ISA", "avx2")
    with pytest.raises(InvalidInputError, match="quantization: 'gguf-bf16' .*TROUPE_CPU_ISA=avx2"):
        select_kernels(EngineConfig(kernels="cpu", quantization="gguf-bf16"))
    with pytest.raises(InvalidInputError, match="quantization: 'gguf-bf16' needs the compiled CPU kernels"):
        select_kernels(EngineConfig(kernels="eager", quantization="gguf-bf16"))


# Fixed prompts: 16 of them, so that batched decode steps (16 rows) take the bf16 GEMM too, not only the prefill.
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "Explain photosynthesis in one sentence.",
           "List three prime numbers:", "What is 12 times 7?", "Translate 'good morning' into Spanish.",
           "The quick brown fox", "Once upon a time, in a small village,", "Python is a programming language that",
           "Give me a recipe for pancakes.", "Why is the sky blue?", "The largest planet in the solar system is",
           "def fibonacci(n):", "My favourite book is", "In 1969, humans first", "Summarize the plot of Hamlet."]


@needs_bf16
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_greedy_agrees_with_float32() -> None:
    """The default model (SmolLM2-135M, Q4_1 GGUF) through the engine: greedy continuations of 16 fixed prompts,
    16 tokens each, with gguf-bf16 and with gguf (exact float32). bf16 rounding moves the logits by about 1e-2
    relative, so a greedy choice can flip only at a near tie, after which that continuation goes its own way;
    measured (2026-12-06, Xeon with AMX): 15 of 16 continuations equal over 32 tokens, the other from its 8th
    token. Required, with margin for a few more near ties: at least 12 of 16 continuations equal throughout,
    and equal first tokens in at least 14. A broken kernel (layout, rounding, schedule) gives unrelated text."""
    from troupe import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for mode in ("gguf", "gguf-bf16"):
        with LLM(quantization=mode, kernels="cpu", multiprocess=False, enable_prefix_caching=False) as llm:
            tokens[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    pairs = list(zip(tokens["gguf"], tokens["gguf-bf16"], strict=True))
    assert all(len(a) == len(b) == 16 for a, b in pairs)
    same = sum(a == b for a, b in pairs)
    first = sum(a[0] == b[0] for a, b in pairs)
    assert same >= 12 and first >= 14, f"{same}/16 continuations and {first}/16 first tokens agree"
