"""`python -m troupe.bench.host`: the host side of a decode step, phase by phase, on a bare `EngineCore`.

Where `python -m troupe.bench.step` splits the model's work, this splits the engine's, for a device whose
step is bound by the host rather than the model, as the default model's batched step is on a GPU
(docs/benchmarks.md, "GPU"). For each batch size B of
`--batches`, B requests of `--context` random prompt tokens are prefilled, then every round (`--repeats`)
runs `--steps` decode steps of all B, each step and each of its phases timed by wrappers around the calls:

  schedule      `Scheduler.schedule` (which requests run, block allocation)
  seqs          `Scheduler.to_scheduled_seqs` (the runner's view of the step)
  execute       `ModelRunner.execute`: the kernel set's prepare, the model (or its CUDA graph) and the LM
                head; on a GPU only their launch, unless `--sync` waits for the GPU inside it
  sampling rows the engine's per-request sampling rows around the sampler
  sampler       `Sampler.sample`; on a GPU without `--sync` it holds the wait for the step's GPU work
                (the sampled ids coming back are the step's one sync)
  update        `Scheduler.update_from_output` (append, stop checks, outputs, frees)
  rest          the step less those: the engine's own bookkeeping, stats, grammar and logprob hooks

Prints the medians over the rounds, in milliseconds per step, with each phase's share. `--null-model`
runs the engine with no model at all (a fixed token, no compute): the host phases alone. Nothing here is
a test: it prints figures (docs/benchmarks.md lists the tools).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from troupe.bench.step import Timers, ints, start_batch

PHASES = ("step", "schedule", "seqs", "execute", "sampling rows", "sampler", "update", "rest")


def measure(core: Any, batch: int, context: int, steps: int, repeats: int, sync: bool = False,
            seed: int = 0) -> dict[str, float]:
    """Median ms per decode step of each phase in `PHASES` for `batch` sequences (module docstring); the
    engine is left with no request and no wrapper."""
    import torch

    ids = start_batch(core, "bench-host", batch, context, steps * repeats + 8, seed)
    wrapped = ((core.scheduler, "schedule"), (core.scheduler, "to_scheduled_seqs"), (core.runner, "execute"),
               (core, "_sample"), (core.sampler, "sample"), (core.scheduler, "update_from_output"))
    timers = Timers()
    if sync and core.runner.device.type == "cuda":
        execute = core.runner.execute

        def execute_synced(seqs: Any) -> Any:
            out = execute(seqs)
            torch.cuda.synchronize()
            return out

        core.runner.execute = execute_synced
    for (obj, attr), name in zip(wrapped, ("schedule", "seqs", "execute", "sample all", "sampler", "update"),
                                 strict=True):
        timers.wrap(obj, attr, name)
    rounds: dict[str, list[float]] = {p: [] for p in PHASES}
    try:
        for _ in range(repeats):
            timers.clear()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - start)
            per_step = {name: sum(v) / steps for name, v in timers.times.items()}
            step_s = statistics.mean(times)
            parts = {"schedule": per_step["schedule"], "seqs": per_step["seqs"], "execute": per_step["execute"],
                     "sampling rows": per_step["sample all"] - per_step["sampler"], "sampler": per_step["sampler"],
                     "update": per_step["update"]}
            parts["rest"] = step_s - sum(parts.values())
            parts["step"] = step_s
            for name, value in parts.items():
                rounds[name].append(value * 1e3)
    finally:  # the wrappers are instance attributes (execute's sync one under its timer): deleting them
        for obj, attr in wrapped:  # shows the methods again
            delattr(obj, attr)
        core.abort_requests(ids)
        core.step()  # publishes the aborts, frees the blocks
    return {name: statistics.median(v) for name, v in rounds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--null-model", action="store_true", help="no model: a fixed token per step, no compute")
    p.add_argument("--batches", type=ints, default=[1, 64, 256], help="comma-separated batch sizes (default 1,64,256)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens of each sequence (default 100)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    p.add_argument("--sync", action="store_true", help="on a GPU: wait for the step's GPU work inside execute")
    args = p.parse_args(argv)
    for name in ("context", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore

    core = EngineCore(EngineConfig(
        model=args.model, multiprocess=False, device=args.device, dtype=args.dtype, quantization=args.quantization,
        kernels=args.kernels, null_model=args.null_model, enable_prefix_caching=False, num_threads=args.threads,
        log_stats_interval_s=None, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(8192, args.context),  # chunked prefill takes larger batches' prompts
        max_model_len=args.context + args.steps * args.repeats + 16))
    try:
        results = {b: measure(core, b, args.context, args.steps, args.repeats, sync=args.sync) for b in args.batches}
    finally:
        core.close()
    model = "null model" if args.null_model else args.model
    print(f"# {model} on {core.runner.device} (kernels {core.runner.kernels.name}){', synced' if args.sync else ''}; "
          f"context {args.context} + up to {args.steps * args.repeats} tokens; medians of {args.repeats} rounds of "
          f"{args.steps} decode steps; ms per step (share of the step)")
    print("| B | " + " | ".join(PHASES) + " |")
    print("|" + "---|" * (len(PHASES) + 1))
    for b, r in results.items():
        cells = [f"{r['step']:.3f}"] + [f"{r[k]:.3f} ({r[k] / r['step']:.0%})" for k in PHASES[1:]]
        print(f"| {b} | " + " | ".join(cells) + " |")
    print("step = schedule + seqs + execute + sampling rows + sampler + update + rest")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
