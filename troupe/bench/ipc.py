"""`python -m troupe.bench.ipc`: what the engine process boundary costs, and the frontend's ceiling.

- `offline`: the offline workload of `troupe.bench.offline` (64 prompts of 20..400 tokens, 128 new tokens,
  greedy, default model, bf16) through `LLM.generate`, with the EngineCore in its own process and
  in this one; both engines stay up and the two modes alternate run by run (fairer on a noisy
  machine). Prints the median output tokens/s of each and their ratio.
- `null`: `--streams` concurrent streaming `AsyncLLM` requests (DELTA) of `--null-tokens` tokens
  each, on two engines that skip the model: the null model (`null_model=True`: no weights, but it
  still builds (S, vocab) logits that the sampler reads), and `scheduler_only_core`, the null model
  with the logits and the sampler bypassed too, so that the engine is only the scheduler and what is
  measured is the frontend + IPC + detokenization ceiling. Median output tokens/s per mode.

Each figure is the median of `--repeats` runs, after a warm-up (a short generate for `offline`, one
full run for `null`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import anyio


def bench_offline(args: argparse.Namespace) -> dict[str, list[float]]:
    from troupe import LLM
    from troupe.bench.offline import alternate_offline

    opts = dict(model=args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=1024,
                num_threads=args.threads, enable_prefix_caching=False)
    llms = {mode: LLM(**opts, multiprocess=mode == "multiprocess") for mode in args.modes.split(",")}
    try:
        return alternate_offline(llms, num_prompts=64, max_tokens=128, repeats=args.repeats)
    finally:
        for llm in llms.values():
            llm.close()


def scheduler_only_core(config: Any) -> Any:
    """A null-model EngineCore whose step is scheduling only: no logits, no sampler (module-level, so
    that an engine process can import it)."""
    import torch

    from troupe.core.engine_core import EngineCore
    from troupe.core.sampler import SamplerOutput

    core = EngineCore(config)
    token = core.runner.null_token_id
    core.runner.execute = lambda seqs, placeholders=None: torch.empty(sum(s.needs_logits for s in seqs), 0)  # type: ignore[method-assign]
    core.sampler.sample = lambda logits, rows: SamplerOutput([token] * len(rows), [None] * len(rows))  # type: ignore[method-assign]
    return core


def null_pool_blocks(streams: int, tokens: int, prompt_tokens: int = 64, block_size: int = 16) -> int:
    """KV blocks for the null engine: every stream's prompt (the bench's are ~12 tokens) and `tokens`
    outputs at once, plus the null block. The default pool holds 512 tokens a sequence, and the engine
    caps a request that could never fit at what the pool holds, so longer runs would finish early."""
    return streams * -(-(prompt_tokens + tokens) // block_size) + 1


async def bench_null(args: argparse.Namespace, make_core: Any) -> dict[str, list[float]]:
    from troupe import AsyncLLM
    from troupe.bench.offline import stream_requests

    runs: dict[str, list[float]] = {}
    for mode in args.modes.split(","):
        async with AsyncLLM(args.model, null_model=True, multiprocess=mode == "multiprocess", make_core=make_core,
                            max_num_seqs=args.streams, max_num_batched_tokens=max(1024, 16 * args.streams),
                            num_kv_blocks=null_pool_blocks(args.streams, args.null_tokens),
                            num_threads=args.threads) as llm:
            runs[mode] = []
            for r in range(args.repeats + 1):
                _, rate = await stream_requests(llm, args.streams, args.streams, args.null_tokens)
                if r:
                    runs[mode].append(rate)
                name = "null" if make_core is None else "scheduler-only"
                print(f"  {name} {mode:<12} run {r}: {rate:9.1f} output tok/s{'' if r else ' (warm-up)'}",
                      file=sys.stderr)
    return runs


def _report(title: str, runs: dict[str, list[float]]) -> None:
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    print(title)
    for mode, value in med.items():
        spread = f"{min(runs[mode]):.1f}..{max(runs[mode]):.1f}"
        print(f"  {mode:<12} {value:10.1f} output tok/s  (median of {len(runs[mode])}: {spread})")
    if len(med) == 2:
        print(f"  multiprocess / in-process: {med['multiprocess'] / med['in-process']:.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.ipc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="all", choices=["all", "offline", "null", "scheduler-only"])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="multiprocess,in-process", choices=["multiprocess,in-process",
                   "multiprocess", "in-process"], help="which engine modes to measure")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--null-tokens", type=int, default=128)
    args = p.parse_args(argv)
    shape = f"{args.streams} streaming AsyncLLM requests x {args.null_tokens} tokens"
    if args.which in ("all", "null"):
        _report(f"null model, {shape}:", anyio.run(bench_null, args, None))
    if args.which in ("all", "scheduler-only"):
        from troupe.bench.ipc import scheduler_only_core  # by its module name: the engine process imports it
        _report(f"scheduler-only engine (null model, no logits, no sampler), {shape}: "
                "the frontend + IPC + detokenization ceiling", anyio.run(bench_null, args, scheduler_only_core))
    if args.which in ("all", "offline"):
        _report("offline workload (troupe.bench: 64 prompts, 128 new tokens), LLM.generate:", bench_offline(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
