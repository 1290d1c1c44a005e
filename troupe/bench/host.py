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
runs the engine with no model at all (a fixed token, no compute; `troupe.core.model_runner`): the host
phases alone, the batch still flattened by the kernel set's `prepare`. Its only device-like work is the
greedy argmax over the (B, vocab) logits, which stands in for the GPU's sampling: timed inside the step
(`argmax`, a wrapper around the sampler's `row_argmax`), it is taken off the step to give the host cost per
request per step,
`host/req` = (step - argmax) / B in microseconds, the figure issue 43 bounds (<= 6 us at B = 256).
`--actor` adds the engine loop's own cost: the same decode (B requests of `--steps` tokens) stepped by a
bare loop and by the engine-core actor on memory streams (its step thread, the event loop sending each
step's outputs on to a reader), alternated `--repeats` times; the difference is what the actor adds per step.
Nothing here is a test: it prints figures (docs/benchmarks.md lists the tools).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from troupe.bench.step import Timers, ints, start_batch

if TYPE_CHECKING:
    from troupe.engine.core_actor import StepThread

PHASES = ("step", "schedule", "seqs", "execute", "sampling rows", "sampler", "update", "rest")
HOST_TARGET_US = 6.0  # issue 43: host cost per request per step at 256 rows, on the null model


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
    import troupe.core.sampler as sampler_module

    row_argmax = sampler_module.row_argmax
    if core.runner.null_model:
        timers.wrap(sampler_module, "row_argmax", "argmax")
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
            if core.runner.null_model:
                parts["argmax"] = per_step["argmax"]
            for name, value in parts.items():
                rounds.setdefault(name, []).append(value * 1e3)
    finally:  # the wrappers are instance attributes (execute's sync one under its timer): deleting them
        for obj, attr in wrapped:  # shows the methods again
            delattr(obj, attr)
        sampler_module.row_argmax = row_argmax
        core.abort_requests(ids)
        core.step()  # publishes the aborts, frees the blocks
    return {name: statistics.median(v) for name, v in rounds.items()}


def measure_actor(core: Any, batch: int, steps: int, repeats: int, pool: StepThread) -> dict[str, float]:
    """Median ms per step of `batch` greedy requests of `steps` tokens (4-token prompts), stepped by a bare
    loop (`bare`) and by the engine-core actor (`actor`), alternated `repeats` times, both on `pool`'s
    thread, the one that built `core` (one OpenMP team, as in the engine process)."""
    import anyio

    from troupe.engine.core_actor import EngineCoreActor
    from troupe.messages import AddRequest
    from troupe.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    counter = iter(range(1 << 30))

    def adds() -> list[AddRequest]:
        return [AddRequest(f"bench-actor-{next(counter)}", [1, 2, 3, 4], params, steps) for _ in range(batch)]

    def bare() -> float:
        for msg in adds():
            core.add_request(msg)
        n, start = 0, time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            n += 1
        return (time.perf_counter() - start) / n

    async def actor() -> float:
        to_actor, inbox = anyio.create_memory_object_stream[Any](batch + 1)
        outbox, from_actor = anyio.create_memory_object_stream[Any](4)
        async with to_actor, inbox, from_actor, anyio.create_task_group() as tg:  # the actor closes its outbox
            await tg.start(EngineCoreActor(core, inbox, outbox, step_thread=pool).run)
            start, n, done = time.perf_counter(), 0, 0
            for msg in adds():
                await to_actor.send(msg)
            async for out in from_actor:
                n += 1
                done += sum(o.finish_reason is not None for o in out.outputs)
                if done == batch:
                    break
            elapsed = (time.perf_counter() - start) / n
            await to_actor.aclose()
        return elapsed

    rounds: dict[str, list[float]] = {"bare": [], "actor": []}
    for _ in range(repeats):
        rounds["bare"].append(pool.submit(bare).result() * 1e3)
        rounds["actor"].append(anyio.run(actor) * 1e3)
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
    p.add_argument("--actor", action="store_true", help="also time the engine-core actor against a bare step loop")
    args = p.parse_args(argv)
    for name in ("context", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore
    from troupe.engine.child import startup_heap_frozen
    from troupe.engine.core_actor import step_thread

    config = EngineConfig(
        model=args.model, multiprocess=False, device=args.device, dtype=args.dtype, quantization=args.quantization,
        kernels=args.kernels, null_model=args.null_model, enable_prefix_caching=False, num_threads=args.threads,
        log_stats_interval_s=None, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(8192, args.context),  # chunked prefill takes larger batches' prompts
        max_model_len=args.context + args.steps * args.repeats + 16)
    # Built and stepped on one thread, as in the engine process: steps on another thread than the build's
    # would run a second OpenMP team, which libgomp throttles (troupe.engine.core_actor).
    with step_thread(0) as pool:
        core = pool.submit(EngineCore, config).result()
        try:  # the start-up heap frozen, as in the engine process (a full collection would land in some steps)
            with startup_heap_frozen():
                results = {b: pool.submit(measure, core, b, args.context, args.steps, args.repeats,
                                          sync=args.sync).result() for b in args.batches}
                actor = ({b: measure_actor(core, b, args.steps, args.repeats, pool) for b in args.batches}
                         if args.actor else {})
        finally:
            pool.submit(core.close).result()
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
    if args.null_model:
        print("\n# host cost: step less the argmax standing in for the device (ms); host/req in microseconds")
        print("| B | step | argmax | host | host/req |\n|---|---|---|---|---|")
        for b, r in results.items():
            host = r["step"] - r["argmax"]
            print(f"| {b} | {r['step']:.3f} | {r['argmax']:.3f} | {host:.3f} | {host / b * 1e3:.2f} |")
        if 256 in results:
            r = results[256]
            per_req = (r["step"] - r["argmax"]) / 256 * 1e3
            verdict = "PASS" if per_req <= HOST_TARGET_US else "FAIL"
            print(f"{verdict}: host cost at B=256 {per_req:.2f} us per request per step (target <= {HOST_TARGET_US} us)")
    if actor:
        print(f"\n# engine loop: {args.steps}-token greedy decodes stepped bare and by the engine-core actor (ms per "
              f"step, medians of {args.repeats})")
        print("| B | bare | actor | actor overhead |\n|---|---|---|---|")
        for b, r in actor.items():
            print(f"| {b} | {r['bare']:.3f} | {r['actor']:.3f} | {r['actor'] - r['bare']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
