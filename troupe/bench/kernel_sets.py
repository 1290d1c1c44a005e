"""`python -m troupe.bench.kernel_sets`: the engine with each kernel set, same run, taking turns.

Every set in `--sets` (`name[:kv_cache_dtype][/quantization]`, e.g. `eager,cpu,cpu:float32,cpu/gguf-q8`;
see `set_options`) gets its own `LLM` (engine process, prefix caching off, `--dtype`), all alive at once
so that they take turns round by round under the same machine load:

- offline: `troupe.bench.alternate_offline` (`--num-prompts` prompts of 20..400 tokens, `--max-tokens`
  greedy tokens each, ignore_eos), output tok/s;
- single stream: one 100-token prompt, alone: TTFT (a 1-token request) and decode ITL
  ((time of a `--max-tokens` request - TTFT) / (max_tokens - 1));
- memory: each engine process's peak RSS (`VmHWM`) after all runs.

Prints medians of `--repeats` rounds and each set's ratio against the first one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from troupe.bench.offline import alternate_offline, make_prompts


def set_options(spec: str) -> dict[str, Any]:
    """`name[:kv_cache_dtype][/quantization]` -> the EngineConfig fields `kernels`, `kv_cache_dtype`,
    `quantization` (each omitted part "auto")."""
    rest, _, quantization = spec.partition("/")
    name, _, kv = rest.partition(":")
    return dict(kernels=name, kv_cache_dtype=kv or "auto", quantization=quantization or "auto")


def _rss_gib(pid: int, field: str = "VmHWM") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _single_stream(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, ITL) in seconds for one prompt alone."""
    from troupe import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t

    ttft = timed(1)
    return ttft, (timed(max_tokens) - ttft) / (max_tokens - 1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.kernel_sets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="eager,cpu")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="auto: float32 for a GGUF (the default model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-offline", action="store_true")
    args = p.parse_args(argv)
    from troupe import LLM

    llms: dict[str, Any] = {}
    try:
        for spec in args.sets.split(","):
            llms[spec] = LLM(model=args.model, dtype=args.dtype, **set_options(spec), enable_prefix_caching=False,
                             num_threads=args.threads)
        offline = {} if args.skip_offline else alternate_offline(
            llms, num_prompts=args.num_prompts, max_tokens=args.max_tokens, repeats=args.repeats)
        prompt = make_prompts(next(iter(llms.values())).get_tokenizer(), 1, 100, 100, seed=1)[0]
        stream: dict[str, list[tuple[float, float]]] = {k: [] for k in llms}
        for llm in llms.values():
            _single_stream(llm, prompt, 8)  # warm-up
        for _ in range(args.repeats):
            for k, llm in llms.items():
                stream[k].append(_single_stream(llm, prompt, args.max_tokens))
        rss = {k: _rss_gib(llm._engine.engine_pids[0]) for k, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()
    first = next(iter(llms))
    med_off = {k: statistics.median(v) for k, v in offline.items()}
    ttft = {k: statistics.median(t for t, _ in v) * 1e3 for k, v in stream.items()}
    itl = {k: statistics.median(i for _, i in v) * 1e3 for k, v in stream.items()}
    print(f"model {args.model}, weights {args.dtype}, medians of {args.repeats} alternating rounds; "
          f"offline: {args.num_prompts} prompts x {args.max_tokens} tokens; single stream: 100-token prompt")
    print(f"{'set':<16}{'offline tok/s':>14}{'x':>7}{'TTFT ms':>9}{'ITL ms':>8}{'x':>7}{'engine peak RSS':>17}")
    for k in llms:
        off = f"{med_off[k]:>14.1f}{med_off[k] / med_off[first]:>6.2f}x" if k in med_off else f"{'-':>14}{'-':>7}"
        print(f"{k:<16}{off}{ttft[k]:>9.1f}{itl[k]:>8.2f}{itl[first] / itl[k]:>6.2f}x{rss[k]:>13.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
