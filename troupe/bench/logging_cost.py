"""`python -m troupe.bench.logging_cost`: what troupe's logging costs offline throughput, trace disabled.

Workload: `--num-prompts` prompts of 20..400 tokens, `--max-tokens` new tokens each (greedy,
ignore_eos) through `LLM.generate`, with the EngineCore in this process and the null model by
default (`null_model=True`: no weights, no compute, so the frontend, the scheduler and the logging
calls are all that is measured: the worst case for logging's share). Two modes on the same engine,
alternating run by run (the order flips every round, fairer on a noisy machine):

- `logging`: troupe's configuration at `--level` (default info: trace off), lines rendered in
  `--format` to /dev/null (the canonical line of each request, the engine's lines);
- `stubbed`: every logging call of troupe replaced by a no-op (module loggers, `trace`,
  `trace_enabled`, the canonical line, structlog's contextvars binding).

Prints the median output tokens/s of each and the cost, 1 - logging / stubbed, from the medians and
as the median of each round's ratio (the two runs of a round see about the same machine load); then
the CPU time spent inside logging calls in one more run, timed call site by call site, which does
not depend on the machine's load. `--control` runs the same A/B with logging in both modes: what it
prints as "cost" is the noise floor of this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any


class _NullLogger:
    """A logger whose every method does nothing."""

    def _nop(self, *args: Any, **kw: Any) -> None:
        return None

    trace = debug = info = warning = warn = error = critical = exception = msg = log = _nop

    def bind(self, **kw: Any) -> _NullLogger:
        return self


def _nop(*args: Any, **kw: Any) -> None:
    return None


def _never() -> bool:
    return False


@contextlib.contextmanager
def _null_context(**kw: Any) -> Iterator[None]:
    yield


def _logging_names() -> list[tuple[Any, str, Any]]:
    """(owner, name, value) of every logging call site troupe's modules use."""
    import structlog

    found: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("troupe.") or module is None or name == "troupe.log":
            continue
        for attr, value in list(vars(module).items()):
            if (attr == "log" and hasattr(value, "info") and hasattr(value, "debug")) or (
                    attr in ("trace", "log_finished", "trace_enabled") and callable(value)):
                found.append((module, attr, value))
    found += [(structlog.contextvars, attr, getattr(structlog.contextvars, attr))
              for attr in ("bind_contextvars", "bound_contextvars")]
    return found


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[int]:
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield len(patches)
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def stubbed_logging() -> contextlib.AbstractContextManager[int]:
    """Replace troupe's logging calls by no-ops while inside; yields the number of names patched."""
    stubs = {"log": _NullLogger(), "trace": _nop, "log_finished": _nop, "trace_enabled": _never,
             "bind_contextvars": _nop, "bound_contextvars": _null_context}
    return _patched([(owner, attr, stubs[attr]) for owner, attr, _ in _logging_names()])


class _Timed:
    """Sums the CPU time spent in logging calls, in whichever thread (`thread_time_ns`: a thread
    waiting for the GIL inside a call is not counted). A call inside a timed call (the canonical
    line's `log.info` inside `log_finished`) counts in its site but once in the total. The clock
    reads' own cost (`overhead_ns` a call, measured) is subtracted from the total."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self.by_site: dict[str, list[int]] = {}  # "module.name[.method]" -> [calls, ns]
        self._depth = threading.local()
        t0 = time.thread_time_ns()
        for _ in range(1000):
            time.thread_time_ns()
        self.overhead_ns = 2 * (time.thread_time_ns() - t0) // 1000

    def _add(self, site: str, ns: int, outermost: bool) -> None:
        if outermost:
            self.ns += ns
            self.calls += 1
        entry = self.by_site.setdefault(site, [0, 0])
        entry[0] += 1
        entry[1] += ns

    @property
    def net_ns(self) -> int:
        return max(0, self.ns - self.calls * self.overhead_ns)

    def wrap(self, fn: Any, site: str = "") -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t = time.thread_time_ns()
            try:
                return fn(*args, **kw)
            finally:
                self._add(site or getattr(fn, "__name__", "?"), time.thread_time_ns() - t, depth == 0)
                self._depth.n = depth
        return timed

    def context(self, fn: Any) -> Any:
        @contextlib.contextmanager
        def timed(**kw: Any) -> Iterator[None]:
            t = time.thread_time_ns()
            cm = fn(**kw)
            cm.__enter__()
            self._add("bound_contextvars", time.thread_time_ns() - t, True)
            try:
                yield
            finally:
                t = time.thread_time_ns()
                cm.__exit__(None, None, None)
                self.by_site["bound_contextvars"][1] += time.thread_time_ns() - t
                self.ns += time.thread_time_ns() - t
        return timed

    def logger(self, real: Any, module: str) -> Any:
        timer = self

        class TimedLogger:
            def __getattr__(self, name: str) -> Any:
                t = time.thread_time_ns()
                method = getattr(real, name)
                timer.ns += time.thread_time_ns() - t  # the lazy proxy's own cost
                return timer.wrap(method, f"{module}.log.{name}")
        return TimedLogger()


def timed_logging(timer: _Timed) -> contextlib.AbstractContextManager[int]:
    """Time every logging call of troupe while inside."""
    def wrapper(owner: Any, attr: str, value: Any) -> Any:
        if attr == "log":
            return timer.logger(value, owner.__name__)
        if attr == "bound_contextvars":
            return timer.context(value)
        return timer.wrap(value, attr)

    return _patched([(owner, attr, wrapper(owner, attr, value)) for owner, attr, value in _logging_names()])


def bench(args: argparse.Namespace) -> dict[str, list[float]]:
    """Runs of each mode: "<mode>" output tokens per wall second, "<mode> cpu" per CPU second of
    this process (all threads: the engine runs in it), which other programs' load disturbs less."""
    from troupe import LLM, SamplingParams
    from troupe.bench.offline import make_prompts
    from troupe.log import configure_logging

    sink = open(os.devnull, "w")  # noqa: SIM115  (closed below)
    configure_logging(args.level, args.format, force=True, file=sink)
    llm = LLM(args.model, null_model=args.null_model, multiprocess=False, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_threads=args.threads, enable_prefix_caching=False, log_stats_interval_s=10.0)
    try:
        prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, 20, 400)
        jobs = [{"prompt_token_ids": p} for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(jobs[:16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs: dict[str, list[float]] = {"logging": [], "stubbed": [], "logging cpu": [], "stubbed cpu": []}
        for r in range(args.repeats):
            order = ["logging", "stubbed"] if r % 2 == 0 else ["stubbed", "logging"]
            for mode in order:
                stub = mode == "stubbed" and not args.control
                with stubbed_logging() if stub else contextlib.nullcontext():
                    t, cpu = time.perf_counter(), time.process_time()
                    outs = llm.generate(jobs, params, use_tqdm=False)
                    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                runs[mode].append(tokens / wall)
                runs[f"{mode} cpu"].append(tokens / cpu)
                print(f"  run {r} {mode:<8} {tokens / wall:9.1f} output tok/s, {tokens / cpu:9.1f} per CPU s",
                      file=sys.__stdout__, flush=True)
        timer = _Timed()
        with timed_logging(timer):
            t, cpu = time.perf_counter(), time.process_time()
            llm.generate(jobs, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        runs["timed"] = [timer.net_ns / 1e9, timer.calls, cpu, wall]
        for site, (calls, ns) in sorted(timer.by_site.items(), key=lambda kv: -kv[1][1]):
            print(f"    {site:<48} {calls:6d} calls {ns / 1e6:8.2f} ms {ns / max(1, calls) / 1e3:7.1f} us/call"
                  f" (timer included: {timer.overhead_ns / 1e3:.1f} us/call)", file=sys.__stdout__)
        return runs
    finally:
        llm.close()
        sink.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.logging_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--null-model", action=argparse.BooleanOptionalAction, default=True,
                   help="skip the model (default); --no-null-model runs the real one")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--level", default="info", choices=["debug", "info", "warning"],
                   help="troupe's level in the logging mode (trace is never on here)")
    p.add_argument("--format", default="console", choices=["console", "json"])
    p.add_argument("--control", action="store_true",
                   help="an A/A run: the 'stubbed' mode logs too, so the figure shows the machine's noise")
    args = p.parse_args(argv)
    runs = bench(args)
    in_logging, calls, cpu, wall = runs.pop("timed")
    med = {mode: statistics.median(v) if v else 0.0 for mode, v in runs.items()}
    model = f"{args.model}{' (null model)' if args.null_model else ''}"
    print(f"offline LLM.generate, {args.num_prompts} prompts x {args.max_tokens} tokens, {model}, in-process, "
          f"level={args.level}, format={args.format}{' (CONTROL: both modes log)' if args.control else ''}:")
    for suffix, unit in (("", "output tok/s"), (" cpu", "output tok per CPU s")) if args.repeats else ():
        lg, st = f"logging{suffix}", f"stubbed{suffix}"
        for mode in (lg, st):
            print(f"  {mode:<12} {med[mode]:9.1f} {unit}  (median of {len(runs[mode])}: "
                  f"{min(runs[mode]):.1f}..{max(runs[mode]):.1f})")
        paired = statistics.median(a / b for a, b in zip(runs[lg], runs[st], strict=True))
        print(f"  logging cost ({unit}): {100 * (1 - med[lg] / med[st]):+.2f}% (ratio of medians), "
              f"{100 * (1 - paired):+.2f}% (median of the {args.repeats} paired ratios)")
    print(f"  CPU time inside logging calls, one more run: {1e3 * in_logging:.1f} ms in {int(calls)} calls "
          f"(timer's cost subtracted), {100 * in_logging / cpu:.2f}% of its {cpu:.2f} CPU s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
