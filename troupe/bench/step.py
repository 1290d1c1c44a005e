"""`python -m troupe.bench.step`: where one decode step's time goes, part by part, on a bare `EngineCore`.

For each batch size B of `--batches`, B requests of `--context` random prompt tokens are prefilled in one
`EngineCore` built in this process (`--quantization`, `--kernels`, `--threads`; prefix caching off), then
every round (`--repeats`) runs `--steps` decode steps of all B, timing each step and, with timers around
the calls, its parts: the kernel set's `prepare` (the step's flat tensors and metadata), the model's
forward, the LM head (`compute_logits`) and the sampler. The rest of the step (scheduling, the logits
rows, the output bookkeeping) is the step less those parts. After the round, the last step's batch is run
again through prepare + forward alone three ways, taking turns: as it is; with every projection of the
layers replaced by its output captured once (so they cost nothing); and with attention replaced too (and
`prepare` alone, taken off all three). The differences split the forward into its projections, its
attention, and the rest (norms, rotary and KV write, SiLU x up, the embedding, the Python between the ops).
Those three runs take the model's per-layer loop even where the step itself runs the kernel set's decoder
stack (docs/kernels.md): the split replaces the layers' own ops, which the stack does not call from Python;
"forward alone" against "forward" then shows what the stack saves. The context grows by `--steps` a round.

`--prefill` adds a row for the step that prefills one fresh prompt of `--context` tokens alone (a new
prompt each round; the step behind a single stream's TTFT), split the same way.

`--llm` adds, for B = 1, the inter-token latency through `LLM` (the engine in its own process, the
frontend in this one: `troupe bench`'s single-stream figure), one measurement after each bare round so
that both see the same machine, and prints it against the bare step: the cost of the process boundary
and the frontend.

Prints the medians over the rounds in milliseconds per step and each part's share of the step. Nothing
here is a test: it prints figures (docs/benchmarks.md lists the tools).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# the step's parts (they add up to the step), then the forward run alone and its parts (they add up to it)
STEP_PARTS = ("step", "prepare", "forward", "head", "sampler", "engine rest")
FORWARD_PARTS = ("forward alone", "projections", "attention", "other ops")
PARTS = STEP_PARTS + FORWARD_PARTS


class Timers:
    """Per-call wall times of wrapped methods, by name."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        inner = getattr(obj, attr)
        times = self.times.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - start)

        setattr(obj, attr, timed)

    def clear(self) -> None:
        for v in self.times.values():
            v.clear()


def _median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def _time_calls(fn: Callable[[], Any], n: int) -> float:
    """Median wall time of `n` calls, ms."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _median_ms(times)


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down", "router", "experts")  # those a layer calls count


@contextmanager
def _free(model: Any, kernels: Any, seqs: Any, block_size: int, kv: Any, attention: bool) -> Iterator[None]:
    """The layers' projections (and with `attention` the attention) replaced by outputs captured once on
    this batch, restored on leaving."""
    import torch

    saved: list[tuple[Any, str, Any]] = []  # restored on leaving, a failed capture included
    try:
        with torch.inference_mode():
            batch = kernels.prepare(seqs, block_size)
            captured: dict[tuple[Any, str], torch.Tensor] = {}
            for layer in model.layers:
                for name in PROJECTIONS:
                    op = getattr(layer, name)

                    def capture(*args: torch.Tensor, op: Any = op, key: tuple[Any, str] = (layer, name)) -> torch.Tensor:
                        captured[key] = out = op(*args)
                        return out

                    setattr(layer, name, capture)
                    saved.append((layer, name, op))
            model(batch.input_ids, batch.positions, kv, batch.meta, batch.logits_indices)
            for layer, name, op in saved:  # a projection the layer does not call (a dense MLP's in a MoE layer) stays
                setattr(layer, name, (lambda *args, out=captured[(layer, name)]: out) if (layer, name) in captured else op)
            if attention:
                saved.append((kernels, "attention", None))
                kernels.attention = lambda q, *args, **features: q
        yield
    finally:
        for obj, name, op in reversed(saved):
            if obj is kernels:
                del kernels.attention  # the instance attribute goes: the method shows again
            else:
                setattr(obj, name, op)


def measure(core: Any, batch: int, context: int, steps: int, repeats: int, seed: int = 0,
            each_round: Callable[[], None] | None = None) -> dict[str, float]:
    """Median ms per decode step of each part in `PARTS` for `batch` sequences (see the module docstring);
    `each_round` runs after every round (another measurement taking turns with this one)."""
    ids = start_batch(core, "bench-step", batch, context, steps * repeats + 8, seed)

    def decode_round() -> tuple[list[float], Callable[[], None]]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        return times, lambda: None

    try:
        return _measure_rounds(core, decode_round, repeats, max(5, steps // 2), each_round)
    finally:
        core.abort_requests(ids)
        core.step()  # publishes the aborts, frees the blocks


def start_batch(core: Any, name: str, batch: int, context: int, max_tokens: int, seed: int = 0) -> list[str]:
    """Add `batch` greedy requests of `context` random prompt tokens (ids `{name}-{batch}-{i}`) and step
    until every prompt is prefilled; returns their ids (the caller aborts them)."""
    rnd = random.Random(seed)
    ids = [f"{name}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        _add(core, rid, [rnd.randrange(core.runner.vocab_size) for _ in range(context)], max_tokens)
    while sum(len(o.new_token_ids) for o in core.step().outputs) < batch:  # until every prompt is in
        pass
    return ids


def measure_prefill(core: Any, context: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median ms of each part in `PARTS` for the step that prefills one fresh prompt of `context` tokens (a
    new prompt each round, in one step: `context` must fit `max_num_batched_tokens`), the TTFT's step."""
    rnd = random.Random(seed + 1)
    count = iter(range(repeats))

    def prefill_round() -> tuple[list[float], Callable[[], None]]:
        rid = f"bench-prefill-{next(count)}"
        _add(core, rid, [rnd.randrange(core.runner.vocab_size) for _ in range(context)], 2)
        start = time.perf_counter()
        out = core.step()
        elapsed = time.perf_counter() - start
        assert [o.request_id for o in out.outputs if o.new_token_ids] == [rid], "the prompt took more than one step"

        def done() -> None:  # after the forward's reruns, which still write into its blocks
            core.abort_requests([rid])
            core.step()

        return [elapsed], done

    return _measure_rounds(core, prefill_round, repeats, 5, None)


def _add(core: Any, request_id: str, prompt: list[int], max_tokens: int) -> None:
    from troupe.messages import AddRequest
    from troupe.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params, max_tokens=max_tokens))


def _measure_rounds(core: Any, run_round: Callable[[], tuple[list[float], Callable[[], None]]], repeats: int,
                    reruns: int, each_round: Callable[[], None] | None) -> dict[str, float]:
    """`repeats` rounds of `run_round` (the step times of the round, and what to do once its last batch has
    been run again) with the parts timed, then the last step's batch run again alone `reruns` times in the
    three ways of the module docstring; the medians over the rounds of each part in `PARTS`."""
    import torch

    runner, model = core.runner, core.runner.model
    last: list[Any] = []
    timers = Timers()
    timers.wrap(runner.kernels, "prepare", "prepare")
    timers.wrap(model, "forward", "forward")
    timers.wrap(model, "compute_logits", "head")
    timers.wrap(core.sampler, "sample", "sampler")
    execute = runner.execute

    def keep(seqs: Any) -> Any:
        last[:] = [seqs]
        return execute(seqs)

    runner.execute = keep  # type: ignore[method-assign]
    rounds: dict[str, list[float]] = {p: [] for p in PARTS}
    try:
        for _ in range(repeats):
            timers.clear()
            step_times, done = run_round()
            t = {name: _median_ms(v) for name, v in timers.times.items()}
            seqs = last[0]

            @torch.inference_mode()
            def forward(seqs: Any = seqs) -> None:
                b = runner.kernels.prepare(seqs, runner.block_size)
                model(b.input_ids, b.positions, runner.kv_caches, b.meta, b.logits_indices)

            def prepare(seqs: Any = seqs) -> None:
                runner.kernels.prepare(seqs, runner.block_size)

            prep_alone = _time_calls(prepare, reruns)
            with model.per_layer_loop():  # the split replaces the layers' own ops
                whole = _time_calls(forward, reruns)
                with _free(model, runner.kernels, seqs, runner.block_size, runner.kv_caches, attention=False):
                    no_proj = _time_calls(forward, reruns)
                with _free(model, runner.kernels, seqs, runner.block_size, runner.kv_caches, attention=True):
                    no_proj_attn = _time_calls(forward, reruns)
            done()
            prep, step = t["prepare"], _median_ms(step_times)
            parts = {"step": step, "prepare": prep, "forward": t["forward"], "head": t["head"],
                     "sampler": t["sampler"], "engine rest": step - prep - t["forward"] - t["head"] - t["sampler"],
                     "forward alone": whole - prep_alone, "projections": whole - no_proj,
                     "attention": no_proj - no_proj_attn, "other ops": no_proj_attn - prep_alone}
            for name, value in parts.items():
                rounds[name].append(value)
            if each_round is not None:
                each_round()
    finally:  # the wrappers are instance attributes: deleting them shows the methods again
        del runner.execute, runner.kernels.prepare, model.forward, model.compute_logits, core.sampler.sample
    return {p: statistics.median(v) for p, v in rounds.items()}


class LlmItl:
    """Single-stream ITL through `LLM` (the engine in its own process, the frontend in this one): each call
    of `round` adds (T(tokens) - T(1)) / (tokens - 1) for a fresh random prompt of `context` tokens."""

    def __init__(self, model: str, options: dict[str, Any], context: int, tokens: int) -> None:
        from troupe import LLM

        self.llm = LLM(model=model, **options)
        self.context, self.tokens = context, tokens
        self.vocab = self.llm.get_tokenizer().vocab_size
        self.rnd = random.Random(1)
        self.itls: list[float] = []
        self._timed(4)  # warm-up

    def _timed(self, n: int) -> float:
        from troupe import SamplingParams

        prompt = [self.rnd.randrange(self.vocab) for _ in range(self.context)]
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    def round(self) -> None:
        first = self._timed(1)
        self.itls.append((self._timed(self.tokens) - first) / (self.tokens - 1))

    def close(self) -> None:
        self.llm.close()


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto", help="EngineConfig.quantization (e.g. gguf, gguf-q8, gguf-bf16)")
    p.add_argument("--kernels", default="auto", help="EngineConfig.kernels")
    p.add_argument("--batches", type=ints, default=[1, 16], help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--context", type=int, default=100, help="prompt tokens of each sequence (default 100)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    p.add_argument("--llm", action="store_true", help="also B = 1's ITL through LLM (engine process)")
    p.add_argument("--prefill", action="store_true", help="also the step that prefills one --context-token prompt")
    args = p.parse_args(argv)
    for name in ("context", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore

    options: dict[str, Any] = dict(quantization=args.quantization, kernels=args.kernels, dtype="float32",
                                   enable_prefix_caching=False, num_threads=args.threads, log_stats_interval_s=None,
                                   max_num_seqs=max(args.batches),
                                   max_num_batched_tokens=max(1024, args.context),
                                   max_model_len=args.context + args.steps * args.repeats + 16)
    core = EngineCore(EngineConfig(model=args.model, multiprocess=False, **options))
    llm = LlmItl(args.model, options, args.context, args.steps + 1) if args.llm and 1 in args.batches else None
    try:
        results: dict[str, dict[str, float]] = {}
        if args.prefill:
            results[f"prefill {args.context}"] = measure_prefill(core, args.context, args.repeats)
        for b in args.batches:
            results[str(b)] = measure(core, b, args.context, args.steps, args.repeats,
                                      each_round=llm.round if llm is not None and b == 1 else None)
    finally:
        core.close()
        if llm is not None:
            llm.close()
    itl = _median_ms(llm.itls) if llm is not None else None

    print(f"# {args.model}, kernels {core.runner.kernels.name}, quantization {args.quantization}, "
          f"threads {args.threads or 'all'}; context {args.context} + up to {args.steps * args.repeats} tokens; "
          f"medians of {args.repeats} rounds of {args.steps} decode steps; ms per step (share of the step)")
    print("| B | " + " | ".join(PARTS) + " |")
    print("|" + "---|" * (len(PARTS) + 1))
    for b, r in results.items():
        cells = [f"{r[k]:.2f}" if k in ("step", "forward alone") else f"{r[k]:.2f} ({r[k] / r['step']:.0%})"
                 for k in PARTS]
        print(f"| {b} | " + " | ".join(cells) + " |")
    print("step = prepare + forward + head + sampler + engine rest; the step's batch run again by itself: "
          "forward alone = projections + attention + other ops")
    if itl is not None:
        step = results["1"]["step"]
        print(f"B = 1 through LLM (engine process + frontend, taking turns with the bare rounds): ITL {itl:.2f} ms, "
              f"{itl - step:+.2f} ms ({itl / step:.2f}x) against the bare step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
