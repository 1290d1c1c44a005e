"""`python -m troupe.bench.dp`: data parallelism on this machine, and where the frontend stops scaling.

- `offline`: the offline workload of `troupe.bench.offline` (64 prompts of 20..400 tokens, 128 new tokens,
  greedy, ignore_eos) through `LLM.generate` on the default model, with 1 engine x `--threads`
  torch threads against `--dp` engines x (`--threads` / `--dp`) threads each, same total cores. Both
  groups stay up and alternate run by run (fairer on a noisy machine); prints the median output
  tokens/s of each and their ratio.
- `null`: null-model engines (no weights, no compute: a fixed token per step) at N = 1, 2, 4, 8
  (`--sizes`); `--requests` streaming requests (`--concurrency` at a time) of `--null-tokens` tokens
  through one `AsyncLLM` + the DP balancer. Prints requests/s and output tokens/s per N: with the
  engines free, this is the ceiling of the frontend (input processor, balancer, output handler) and
  of its ZMQ links, i.e. where adding engines stops paying.

Each figure is the median of `--repeats` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import anyio


def bench_offline(args: argparse.Namespace) -> dict[str, list[float]]:
    from troupe import LLM
    from troupe.bench.offline import alternate_offline

    base = dict(model=args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=1024,
                enable_prefix_caching=False, log_stats_interval_s=None)
    split = max(1, args.threads // args.dp)
    groups = {
        f"1 x {args.threads} threads": LLM(**base, num_threads=args.threads),
        f"{args.dp} x {split} threads": LLM(**base, data_parallel_size=args.dp, num_threads=split),
    }
    try:
        return alternate_offline(groups, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                                 repeats=args.repeats)
    finally:
        for llm in groups.values():
            llm.close()


async def bench_null(args: argparse.Namespace) -> dict[int, tuple[list[float], list[float]]]:
    from troupe import AsyncLLM
    from troupe.bench.offline import stream_requests

    results: dict[int, tuple[list[float], list[float]]] = {}
    for n in (int(s) for s in args.sizes.split(",")):
        async with AsyncLLM(args.model, null_model=True, data_parallel_size=n, num_threads=1,
                            max_num_seqs=args.concurrency, max_num_batched_tokens=max(1024, 16 * args.concurrency),
                            log_stats_interval_s=None) as llm:
            reqs, toks = [], []
            for r in range(args.repeats + 1):
                rps, tps = await stream_requests(llm, args.requests, args.concurrency, args.null_tokens)
                if r:
                    reqs.append(rps)
                    toks.append(tps)
                print(f"  null N={n} run {r}: {rps:8.1f} req/s {tps:9.1f} output tok/s{'' if r else ' (warm-up)'}",
                      file=sys.stderr)
            results[n] = (reqs, toks)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.dp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="all", choices=["all", "offline", "null"])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2, help="total torch threads (offline)")
    p.add_argument("--dp", type=int, default=2, help="engines of the data-parallel group (offline)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="1,2,4,8", help="engine counts (null)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--null-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.which in ("all", "offline"):
        runs = bench_offline(args)
        med = {name: statistics.median(v) for name, v in runs.items()}
        print(f"offline, default model, {args.num_prompts} prompts x {args.max_tokens} tokens "
              f"(median of {args.repeats}):")
        for name, value in med.items():
            print(f"  {name:<20} {value:8.1f} output tok/s  ({min(runs[name]):.1f}..{max(runs[name]):.1f})")
        a, b = med.values()
        print(f"  data parallel / single engine: {b / a:.3f}")
    if args.which in ("all", "null"):
        results = anyio.run(bench_null, args)
        print(f"null-model engines, {args.requests} requests x {args.null_tokens} tokens, "
              f"{args.concurrency} at a time (median of {args.repeats}):")
        for n, (reqs, toks) in results.items():
            print(f"  N={n}: {statistics.median(reqs):8.1f} req/s  {statistics.median(toks):9.1f} output tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
