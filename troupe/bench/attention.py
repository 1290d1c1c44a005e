"""`python -m troupe.bench.attention`: the cpu kernel set's paged attention against the eager set's, same run.

(The whole engine with each set: `python -m troupe.bench.kernel_sets`; greedy tokens of each set against
transformers: `python -m troupe.bench.accuracy`.)

Shapes of the default model (9 query heads, 3 kv heads, head dim 64, blocks of 16). Decode steps at
batch 1 / 16 / 64 and contexts 128..1024 (every sequence at that context), plus two prefill chunks; each
method runs one layer's attention per call over pools of several layers in turn (as many as keep its
pools under `--pool-mib`, at most 30), so large cases stream from memory as a real step does. Methods,
in turns within each round (medians of `--rounds`):

- `eager-gather`: the eager set's decode path without a row cache (gather the blocks, SDPA), float32;
- `eager-rows`: the eager set's decode row cache, rows already filled (its steady state), float32;
- `cpu-f32`, `cpu-f16`: the compiled kernel over the pool in float32 / float16.

The per-step plans (gather indices, row groups, the cpu work list) are built once and reused, so the
figures are per-layer attention; the cpu plan's own cost per step is printed apart. Nothing here is a
test: it prints figures and ratios against `eager-rows` / `eager-gather` measured in the same run, and
the float16 kernel's effective bandwidth: the bytes of K and V the layer must read (every context
position once) over its time, to set against the machine's streaming read bandwidth (the floor of a
memory-bound decode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from troupe.kernels.base import AttentionMetadata

H, KVH, D, BS = 9, 3, 64, 16


def _meta(seqs: list[tuple[int, int]]) -> AttentionMetadata:
    """Metadata for sequences (cached, new) with consecutive blocks per sequence."""
    tables, first = [], 0
    for c, n in seqs:
        nb = -(-(c + n) // BS)
        tables.append(list(range(first, first + nb)))
        first += nb
    width = max(len(t) for t in tables)
    slots = [t[p // BS] * BS + p % BS for (c, n), t in zip(seqs, tables, strict=True) for p in range(c, c + n)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0] + [n for _, n in seqs]).cumsum(0),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(c + n for c, n in seqs))


def _methods(seqs: list[tuple[int, int]], pool_bytes: int) -> dict[str, Callable[[], None]]:
    """One callable per method: attention of the next layer (round robin over its pools)."""
    from troupe.kernels.cpu.attention import CpuMetadata, paged_attention
    from troupe.kernels.eager.attention import DecodeRows, EagerMetadata
    from troupe.kernels.eager.attention import paged_attention as eager_attention

    meta = _meta(seqs)
    T = int(meta.query_start_loc[-1])
    NB = int(meta.block_tables.max()) + 1
    per_layer = 2 * NB * BS * KVH * D * 4
    L = max(1, min(30, pool_bytes // per_layer))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    eager_pools = [(torch.randn(NB, BS, KVH, D, generator=g), torch.randn(NB, BS, KVH, D, generator=g))
                   for _ in range(L)]
    cpu32 = [(kc.permute(0, 2, 3, 1).contiguous(), vc.transpose(1, 2).contiguous()) for kc, vc in eager_pools]
    cpu16 = [(kc.half(), vc.half()) for kc, vc in cpu32]
    scale = D**-0.5
    out: dict[str, Callable[[], None]] = {}
    decode = all(n == 1 for _, n in seqs)

    def cycle(fn: Callable[[int], object]) -> Callable[[], None]:
        state = [0]

        def call() -> None:
            fn(state[0])
            state[0] = (state[0] + 1) % L

        return call

    def eager_meta() -> EagerMetadata:
        return EagerMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             meta.max_query_len, meta.max_seq_len)

    gather_meta = eager_meta()
    out["eager-gather"] = cycle(lambda i: eager_attention(q, k, v, *eager_pools[i], gather_meta, scale, i))
    if decode:
        lens = meta.seq_lens.tolist()
        LC = max(lens)
        rows_k, rows_v = [], []
        for kc, vc in eager_pools:  # rows hold each sequence's context already (the steady state)
            rk = torch.empty(len(seqs), KVH, LC, D)
            rv = torch.empty(len(seqs), KVH, LC, D)
            for s, n in enumerate(lens):
                blocks = meta.block_tables[s, : -(-n // BS)]
                rk[s] = kc[blocks].view(-1, KVH, D)[:LC].transpose(0, 1)
                rv[s] = vc[blocks].view(-1, KVH, D)[:LC].transpose(0, 1)
            rows_k.append(rk)
            rows_v.append(rv)
        rows_meta = eager_meta()
        rows_meta.rows = DecodeRows.build(rows_k, rows_v, meta.query_start_loc[:-1], list(range(len(seqs))), lens, [])
        out["eager-rows"] = cycle(lambda i: eager_attention(q, k, v, *eager_pools[i], rows_meta, scale, i))
    m32, m16 = CpuMetadata.of(meta), CpuMetadata.of(meta)
    out["cpu-f32"] = cycle(lambda i: paged_attention(q, *cpu32[i], m32, scale))
    out["cpu-f16"] = cycle(lambda i: paged_attention(q, *cpu16[i], m16, scale))
    return out


def _time(fn: Callable[[], None], min_s: float) -> float:
    """Microseconds per call: repeat for at least `min_s` seconds."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s and n >= 3:
            return elapsed / n * 1e6


def plan_cost(seqs: list[tuple[int, int]], repeats: int = 200) -> float:
    """Microseconds to build the cpu attention plan of one step (once per step, not per layer)."""
    from troupe.kernels.cpu.attention import AttnPlan

    meta = _meta(seqs)
    q = torch.empty(int(meta.query_start_loc[-1]), H, D)
    pool = torch.empty(1, KVH, D, BS)
    t0 = time.perf_counter()
    for _ in range(repeats):
        AttnPlan.build(q, pool, meta)
    return (time.perf_counter() - t0) / repeats * 1e6


CASES: list[tuple[str, list[tuple[int, int]]]] = [
    *[(f"decode B={b:<2} ctx={c:<4}", [(c - 1, 1)] * b) for b in (1, 16, 64) for c in (128, 256, 512, 1024)],
    ("prefill 512 new", [(0, 512)]),
    ("prefill 256 after 768", [(768, 256)]),
    # a step of the offline workload's chunked prefill: 32 decodes plus 4 prompts' chunks, 1024 tokens
    ("mixed 32 dec + 4x248 new", [(199, 1)] * 32 + [(0, 248)] * 4),
]


def kv_bytes(seqs: list[tuple[int, int]], itemsize: int = 2) -> int:
    """Bytes of K and V one layer's attention must read at least: every context position of every
    sequence once (each kv head's key and value rows), at `itemsize` bytes an element."""
    return sum(c + n for c, n in seqs) * KVH * D * 2 * itemsize


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per method per round")
    p.add_argument("--pool-mib", type=int, default=256, help="pool bytes per method (decides the layers cycled)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = p.parse_args(argv)
    from troupe.kernels.cpu import available
    from troupe.kernels.cpu.build import isa

    if not available():
        print("the compiled CPU kernels are not available here", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"attention per layer, us (median of {args.rounds} alternating rounds); {torch.get_num_threads()} threads, "
          f"ISA {isa()}; H={H} KVH={KVH} D={D} block={BS}")
    names = ["eager-gather", "eager-rows", "cpu-f32", "cpu-f16"]
    print(f"{'case':<24}" + "".join(f"{n:>14}" for n in names) + f"{'f16 vs rows':>13}{'f16 vs gather':>15}"
          f"{'plan/step':>11}{'f16 GB/s':>10}")
    with torch.inference_mode():
        for label, seqs in CASES:
            if args.only and args.only not in label:
                continue
            methods = _methods(seqs, args.pool_mib << 20)
            runs: dict[str, list[float]] = {n: [] for n in methods}
            for fn in methods.values():
                fn()  # first calls: plans, buffers
            for _ in range(args.rounds):
                for n, fn in methods.items():
                    runs[n].append(_time(fn, args.min_time))
            med = {n: statistics.median(v) for n, v in runs.items()}
            cells = "".join(f"{med[n]:>14.1f}" if n in med else f"{'-':>14}" for n in names)
            vs_rows = f"{med['eager-rows'] / med['cpu-f16']:>12.2f}x" if "eager-rows" in med else f"{'-':>13}"
            print(f"{label:<24}{cells}{vs_rows}{med['eager-gather'] / med['cpu-f16']:>14.2f}x"
                  f"{plan_cost(seqs):>11.1f}{kv_bytes(seqs) / med['cpu-f16'] / 1e3:>10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
