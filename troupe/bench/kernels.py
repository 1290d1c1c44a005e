"""`python -m troupe.bench.kernels`: the projection kernels on GGUF blocks against the eager float32 path.

For each of the default model's projection shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, the LM head 49152x576) and each batch of M rows, it times `torch.ops.troupe_qmm.linear` (and
`linear_q8` with --q8, `linear_bf16` with --bf16) on random valid blocks of each format against the eager set's oneDNN-packed float32
projection of the same (dequantized) weight, alternating the candidates round by round so that each sees
the same machine load, and prints medians: microseconds per call, weight bytes streamed per second
(GB/s: the block bytes, or the float32 bytes for eager), GFLOP/s (2 M N K per call) and the speed-up over
eager. K-quants need K to be a multiple of 256: on the 576-wide shapes they run with K = 512 (and their
own eager baseline). `--former-panel` adds the former dot-product panel kernel (path 3) as a candidate,
so the panel GEMM and its predecessor compare in the same run. `--bf16` (CPUs with avx512_bf16) adds, above
8 rows, the bf16 GEMM with the CPU's best kernel (`bf16`: AMX tiles where the CPU has them) and, where that
is AMX, the avx512_bf16 dot-product kernel too (`bf16-dp`). The head is skipped above 64 rows (it only runs on the rows that sample a token).

`--model-order` times what one decode step does instead: the default model's (or `--model`'s) real
projections, loaded by the cpu set, called back to back in model order (per layer qkv, o, gate_up, down,
then the LM head: 121 calls on the default model, its ~96 MB of blocks streaming through the caches as in a
real step), at each M of `--rows` (default 1,2,4), taking turns round by round: the rows path (path 0) on
the blocks where the cpu set keeps them (its huge-page weight arena), the same on a plain copy of them, and
the former one-row-at-a-time kernel (path 2) on the plain copy (what main ran). It prints the median
milliseconds per sequence and the ratio of the last to the first. `--paths` names the candidates instead,
all on the arena's blocks, so that a by-M crossover is measured where it is used: `auto` (the float
projection chosen by M), `rows`, `panel` (the panel GEMM), `former-panel` (the dot-product panel kernel),
with 8-bit activations `q8-auto`, `q8-rows`, `q8-gemm`, and in bf16 `bf16-auto` (by M), `bf16-dp`,
`bf16-amx`; each column's ratio is to the first.

`--isa both` runs the whole table twice: for this CPU's build, then in a subprocess for the AVX2/FMA
baseline, with MKL, oneDNN and ATen held to AVX2 as well (`troupe.bench.peers.AVX2_ENV`, as in `troupe
bench --isa avx2`), which is what an AVX2-only machine runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS_DEFAULT = "1,16,64,512"
DEFAULT_FORMATS = "Q4_1,Q8_0,Q4_0,Q4_K,Q5_K,Q6_K,F16"


def _time(fn: Callable[[], object], budget_s: float = 0.003) -> Callable[[], float]:
    """A sampler: each call times a batch of calls of about `budget_s`, one by one, and returns their median
    (a call that lost its core to another process, which on a shared 2-core VM stalls a 2-thread kernel by a
    whole scheduler slice, then moves the median of the batch little)."""
    fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-6)
    reps = max(1, int(budget_s / once))

    def sample() -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return sample


def run(formats: Sequence[str], rows: Sequence[int], repeats: int, q8: bool, shapes: Sequence[str],
        former_panel: bool = False, bf16: bool = False) -> None:
    import torch

    from troupe.kernels.cpu import linear as qlinear
    from troupe.kernels.cpu.build import isa, load_ops
    from troupe.kernels.eager.linear import Linear
    from troupe.kernels.quant import QType, QuantizedTensor, random_quantized

    if not load_ops("qmm", qlinear.SOURCES):
        raise SystemExit("the compiled kernels cannot be built here (see the warning above)")
    ops = torch.ops.troupe_qmm
    if bf16 and (reason := qlinear.bf16_unsupported() or ("" if ops.bf16_kernels() else "no bf16 kernels built")):
        raise SystemExit(f"--bf16: {reason}")
    bf16_paths = {"bf16": 1, "bf16-dp": 2}.items() if bf16 and ops.bf16_kernels() == 2 else {"bf16": 1}.items()
    g = torch.Generator().manual_seed(0)
    qtypes = [QType[f] for f in formats]
    print(f"# build: {isa()}; threads: {torch.get_num_threads()}; medians of {repeats} alternating rounds "
          f"(each the median call of a ~3 ms batch); load average {os.getloadavg()[0]:.1f}")
    print("| shape | N x K | M | format | µs | GB/s | GFLOP/s | eager f32 µs | x eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in shapes:
        n, k0 = SHAPES[name]
        groups: dict[int, list[QType]] = {}
        for q in qtypes:
            groups.setdefault(k0 if k0 % q.block_size == 0 else k0 // 256 * 256, []).append(q)
        for k, group in groups.items():
            weights: dict[QType, QuantizedTensor] = {}
            for q in group:
                w = random_quantized(q, n, k, g)
                if isinstance(w, QuantizedTensor):  # F32 is the eager baseline itself
                    weights[q] = w
            dense = next((w.dequantize() for w in weights.values()), torch.randn(n, k) * 0.1)
            eager = Linear(dense.clone())
            eager.pack()
            for m in rows:
                if name == "head" and m > 64:
                    continue
                x = torch.randn(m, k, generator=g)
                cands: dict[str, Callable[[], float]] = {"eager": _time(lambda: eager(x))}  # noqa: B023
                for q, w in weights.items():
                    cands[q.name] = _time(functools.partial(ops.linear, x, w.data, int(q), None, -1))
                    if former_panel and m > 8:  # the former dot-product panel kernel, forced (path 3)
                        cands[q.name + " former-panel"] = _time(functools.partial(ops.linear, x, w.data, int(q), None, 3))
                    if q8 and q not in (QType.F16, QType.BF16):
                        cands[q.name + " q8"] = _time(functools.partial(ops.linear_q8, x, w.data, int(q), None, -1))
                    if bf16 and m > 8:  # fewer rows: the float path (linear_bf16's by-M choice) or about to be
                        for label, path in bf16_paths:
                            cands[f"{q.name} {label}"] = _time(functools.partial(ops.linear_bf16, x, w.data, int(q),
                                                                                 None, path))
                times: dict[str, list[float]] = {c: [] for c in cands}
                for _ in range(repeats):
                    for c, sample in cands.items():
                        times[c].append(sample())
                med = {c: statistics.median(v) for c, v in times.items()}
                flops = 2 * m * n * k
                for c, t in med.items():
                    if c == "eager":
                        continue
                    w = weights[QType[c.split()[0]]]
                    print(f"| {name} | {n}x{k} | {m} | {c} | {t * 1e6:.0f} | {w.nbytes / t / 1e9:.1f} | "
                          f"{flops / t / 1e9:.0f} | {med['eager'] * 1e6:.0f} | {med['eager'] / t:.2f} |", flush=True)


# `--paths` names: (op, forced path) of troupe_qmm's float projection and its 8-bit activation variant
MODEL_ORDER_PATHS = {"auto": ("linear", -1), "rows": ("linear", 0), "panel": ("linear", 1),
                     "former-panel": ("linear", 3), "q8-auto": ("linear_q8", -1), "q8-rows": ("linear_q8", 0),
                     "q8-gemm": ("linear_q8", 1), "bf16-auto": ("linear_bf16", -1), "bf16-dp": ("linear_bf16", 2),
                     "bf16-amx": ("linear_bf16", 3)}


def run_model_order(model: str | None, rows: Sequence[int], repeats: int, paths: Sequence[str] = ()) -> None:
    import torch

    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cpu.build import isa
    from troupe.kernels.cpu.linear import QuantizedLinear
    from troupe.models.loader import load_model, resolve_model_path

    path = resolve_model_path(model)
    lm, _ = load_model(path, kernels=CpuKernels())
    projections: list[object] = [p for layer in lm.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    projections.append(lm.head)
    if not all(isinstance(p, QuantizedLinear) and not p.q8 for p in projections):
        raise SystemExit(f"{path}: every projection must be one quantized weight (no split row groups)")
    calls = [(p.data, p.qtype, p.bias) for p in projections if isinstance(p, QuantizedLinear)]
    nbytes = sum(d.numel() for d, _, _ in calls)
    widths = sorted({_width(d, q) for d, q, _ in calls})
    linear = torch.ops.troupe_qmm.linear
    print(f"# {path.name}: {len(calls)} projections, {nbytes / 1e6:.1f} MB of blocks; build: {isa()}; threads: "
          f"{torch.get_num_threads()}; medians of {repeats} rounds, paths taking turns; "
          f"load average {os.getloadavg()[0]:.1f}")
    if paths:
        _model_order_paths(calls, widths, rows, repeats, paths)
        return
    plain = [(d.clone(), q, b) for d, q, b in calls]  # the blocks in ordinary (4 KiB-page) memory, as on main
    print("| M | rows path, arena ms | rows path, plain memory ms | former rows path, plain memory ms | "
          "x former | GB/s |")
    print("|---|---|---|---|---|---|")
    Call = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]  # x, blocks, format, bias
    for m in rows:
        xs = {k: torch.randn(m, k) for k in widths}
        cands: dict[str, tuple[int, list[Call]]] = {
            "new": (0, [(xs[_width(d, q)], d, q, b) for d, q, b in calls]),
            "new plain": (0, [(xs[_width(d, q)], d, q, b) for d, q, b in plain]),
            "former plain": (2, [(xs[_width(d, q)], d, q, b) for d, q, b in plain]),
        }

        med = _taking_turns({c: functools.partial(_sequence, linear, path, ins) for c, (path, ins) in cands.items()},
                            repeats)
        new = med["new"]
        print(f"| {m} | {new * 1e3:.2f} | {med['new plain'] * 1e3:.2f} | {med['former plain'] * 1e3:.2f} | "
              f"{med['former plain'] / new:.2f} | {nbytes / new / 1e9:.1f} |", flush=True)


def _model_order_paths(calls: Sequence[tuple[torch.Tensor, int, torch.Tensor | None]], widths: Sequence[int],
                       rows: Sequence[int], repeats: int, paths: Sequence[str]) -> None:
    """Times the model-order sequence once per named path (`MODEL_ORDER_PATHS`), taking turns round by round."""
    import torch

    print("| M | " + " | ".join(f"{n} ms" for n in paths) + " | " + " | ".join(f"{n} / {paths[0]}" for n in paths[1:])
          + " |")
    print("|---|" + "---|" * (2 * len(paths) - 1))
    for m in rows:
        xs = {k: torch.randn(m, k) for k in widths}
        ins = [(xs[_width(d, q)], d, q, b) for d, q, b in calls]
        fns = {n: (getattr(torch.ops.troupe_qmm, MODEL_ORDER_PATHS[n][0]), MODEL_ORDER_PATHS[n][1]) for n in paths}
        by_name = _taking_turns({n: functools.partial(_sequence, fn, forced, ins) for n, (fn, forced) in fns.items()},
                                repeats)
        med = [by_name[n] for n in paths]
        print(f"| {m} | " + " | ".join(f"{t * 1e3:.2f}" for t in med) + " | "
              + " | ".join(f"{t / med[0]:.2f}" for t in med[1:]) + " |", flush=True)


def _sequence(fn: Callable[..., object], path: int,
              ins: Sequence[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]) -> float:
    """Seconds for one model-order pass: `fn(x, blocks, format, bias, path)` over every projection."""
    t = time.perf_counter()
    for x, d, q, b in ins:
        fn(x, d, q, b, path)
    return time.perf_counter() - t


def _taking_turns(cands: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each candidate's median over `repeats` rounds, one warm-up call first, the candidates taking turns
    within a round so that each sees the same machine load."""
    for sample in cands.values():
        sample()
    times: dict[str, list[float]] = {c: [] for c in cands}
    for _ in range(repeats):
        for c, sample in cands.items():
            times[c].append(sample())
    return {c: statistics.median(ts) for c, ts in times.items()}


def _width(data: torch.Tensor, qtype: int) -> int:
    """K of a weight of (N, row_bytes) blocks in format `qtype`."""
    from troupe.kernels.quant import QType

    q = QType(qtype)
    return int(data.shape[1]) // q.type_size * q.block_size


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated QType names")
    p.add_argument("--rows", default=ROWS_DEFAULT, help="comma-separated M")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--q8", action="store_true", help="also time 8-bit activations (linear_q8)")
    p.add_argument("--bf16", action="store_true", help="also time the bf16 GEMM (linear_bf16; avx512_bf16 CPUs)")
    p.add_argument("--former-panel", action="store_true",
                   help="also time the former dot-product panel kernel (path 3) on the same weights")
    p.add_argument("--isa", choices=["native", "avx2", "both"], default="native")
    p.add_argument("--model-order", action="store_true",
                   help="time one decode step's projections of a real model in model order (see above)")
    p.add_argument("--model", default=None, help="with --model-order: a GGUF file (default: the default model)")
    p.add_argument("--paths", default="", help=f"with --model-order: comma-separated candidates, of "
                   f"{', '.join(MODEL_ORDER_PATHS)} (see above)")
    args = p.parse_args(argv)
    # names as the user may type them (q4_1 for Q4_1); anything else is refused here, naming the choices
    from troupe.kernels.quant import QType

    args.formats = ",".join(f.strip().upper() for f in args.formats.split(","))
    unknown = [f for f in args.formats.split(",") if f not in QType.__members__]
    if unknown:
        p.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(QType.__members__)}")
    bad_shapes = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad_shapes:
        p.error(f"--shapes: unknown {', '.join(bad_shapes)}; choose from {', '.join(SHAPES)}")
    bad_paths = [n for n in args.paths.split(",") if n and n not in MODEL_ORDER_PATHS]
    if bad_paths:
        p.error(f"--paths: unknown {', '.join(bad_paths)}; choose from {', '.join(MODEL_ORDER_PATHS)}")
    if args.paths and not args.model_order:
        p.error("--paths: only with --model-order")
    if args.model_order and args.rows == ROWS_DEFAULT:
        args.rows = "1,2,4"
    if args.isa in ("native", "both"):
        _run_here(args)
    if args.isa in ("avx2", "both"):  # a fresh process: the ISA is chosen when the library loads
        child = [*(["--model-order"] if args.model_order else []), *(["--model", args.model] if args.model else []),
                 *(["--paths", args.paths] if args.paths else []),
                 "--formats", args.formats, "--rows", args.rows, "--shapes", args.shapes, "--repeats",
                 str(args.repeats), *(["--threads", str(args.threads)] if args.threads else []),
                 *(["--q8"] if args.q8 else []), *(["--bf16"] if args.bf16 else []), *(["--former-panel"] if args.former_panel else []),
                 "--isa", "native"]
        from troupe.bench.peers import AVX2_ENV

        env = {**os.environ, **AVX2_ENV}
        return subprocess.run([sys.executable, "-m", "troupe.bench.kernels", *child], env=env).returncode
    return 0


def _run_here(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model_order:
        run_model_order(args.model, [int(r) for r in args.rows.split(",")], args.repeats,
                        [n for n in args.paths.split(",") if n])
        return
    run(args.formats.split(","), [int(r) for r in args.rows.split(",")], args.repeats, args.q8,
        args.shapes.split(","), args.former_panel, args.bf16)


if __name__ == "__main__":
    raise SystemExit(main())
