"""`python -m troupe.bench.moe`: the cpu set's fused MoE op against `grouped_experts` on the same blocks.

One MoE layer's routed experts of a realistic shape (default: 16 experts, top-2, hidden 1024,
intermediate 2816, Q4_K blocks; `--layers` copies with their own weights, called back to back as a
decode step does, so the blocks stream from memory rather than sit in the cache), at each step size T of
`--tokens` (default 1 and 16), with a fresh random routing per call (so that no candidate finds the
experts its predecessor just loaded in the cache). Candidates, taking turns round by round (in rotating
order) so that each sees the same machine load:

- `grouped`: `troupe.kernels.moe.grouped_experts` over the cpu set's `linear` (what `KernelSet.moe`
  builds): one projection call per active expert and projection, each threaded over its rows, SiLU x up
  between them, the weighted sum in torch;
- `per-expert`: the fused op with no expert fused (`fused_max_m = 0`): the same projection calls made
  from C++ (the Python overhead alone);
- `fused`: the fused op (`troupe.kernels.cpu.moe`).

It prints the CPU model and thread count, then per T the median milliseconds per layer of each and the
ratio of grouped's time to fused's. `--q8` uses the 8-bit-activation ("gguf-q8") set, `--bf16` the "gguf-bf16" one
(its fused K-quant experts on the 16-bit rows path).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from troupe.bench.harness import _cpu_name
from troupe.kernels.moe import grouped_experts
from troupe.kernels.quant import QType, random_quantized


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--qtype", default="Q4_K", choices=[q.name for q in QType])
    p.add_argument("--layers", type=int, default=4, help="layers of distinct weights, called in turn")
    p.add_argument("--tokens", default="1,16", help="step sizes T, comma-separated")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--q8", action="store_true", help="8-bit activations (the gguf-q8 mode)")
    p.add_argument("--bf16", action="store_true", help="the gguf-bf16 mode (CPUs with avx512_bf16)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from troupe.kernels.cpu import CpuKernels
    from troupe.kernels.cpu.moe import FusedMoe

    kset = CpuKernels(quantize_activations=args.q8, bf16=args.bf16)
    qtype, E, h, f = QType[args.qtype], args.experts, args.hidden, args.intermediate
    g = torch.Generator().manual_seed(0)
    candidates: dict[str, list[Callable[..., torch.Tensor]]] = {"grouped": [], "per-expert": [], "fused": []}
    for _ in range(args.layers):
        gate_up = [random_quantized(qtype, 2 * f, h, g) for _ in range(E)]
        down = [random_quantized(qtype, h, f, g) for _ in range(E)]
        op = kset.moe(gate_up, down)  # on the blocks where they are (not the arena), as the others
        assert isinstance(op, FusedMoe), "the fused op does not apply to these experts"
        fused: FusedMoe = op
        per_expert = FusedMoe(fused.gate, fused.up, fused.down, fused.qtype_gate_up, fused.qtype_down, fused.q8,
                              fused.bf16)
        per_expert.fused_max_m = 0
        candidates["fused"].append(fused)
        candidates["per-expert"].append(per_expert)
        candidates["grouped"].append(grouped_experts([kset.linear(w) for w in gate_up], [kset.linear(w) for w in down],
                                                     kset.silu_and_mul))
    weight_mb = sum(int(t.numel()) for t in [*fused.gate, *fused.up, *fused.down]) / 2**20
    print(f"CPU: {_cpu_name()}, {torch.get_num_threads()} threads; {E} experts, top-{args.top_k}, hidden {h}, "
          f"intermediate {f}, {qtype.name} ({weight_mb:.0f} MiB of blocks per layer), {args.layers} layers, "
          f"{'8-bit' if args.q8 else 'gguf-bf16' if args.bf16 else 'float32'} activations")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, h, generator=g)
        routings = []
        for _ in range(64):
            ids = torch.rand(T, E, generator=g).topk(args.top_k, dim=-1).indices  # (T, k) distinct experts
            w = torch.rand(T, args.top_k, generator=g) + 0.1
            routings.append((ids, (w / w.sum(-1, keepdim=True)).float()))
        times: dict[str, list[float]] = {name: [] for name in candidates}
        names = list(candidates)
        calls = 0  # every call takes the next routing: no candidate finds the experts its predecessor loaded
        for r in range(args.rounds + 2):  # two warm-up rounds
            for c in range(len(names)):
                name = names[(r + c) % len(names)]  # each candidate first as often as the others
                start = time.perf_counter()
                for op in candidates[name]:
                    ids, w = routings[calls % len(routings)]
                    calls += 1
                    op(x, ids, w)
                if r >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3 / len(candidates[name]))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        cols = "  ".join(f"{name} {ms:.3f} ms" for name, ms in med.items())
        print(f"T={T:<4} {cols}  grouped/fused {med['grouped'] / med['fused']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
