"""`troupe bench`: offline throughput of troupe against Hugging Face transformers, same run.

Workload (issue #2): 64 prompts of 20..400 tokens, 128 new tokens each, greedy with ignore_eos,
on the default model. troupe (`LLM.generate`, the actor graph) and transformers' batched `generate`
(left padding, each batch size in `--hf-batch-sizes`) take turns, round by round, so that both see
the same machine load. Prints the medians of `--repeats` rounds, the ratio against the best
transformers batch size (of the medians, and per round), troupe's start-up time (constructor to
ready) and peak memory (RSS of this process before transformers is loaded, and of the engine
process); without `--skip-core`, also a bare `EngineCore` loop in this process.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

_TEXT = (
    "The history of computing is a story of layers. Each generation of engineers built tools that "
    "hid the details of the one before, so that the next could think about larger problems. "
    "Punched cards gave way to terminals, terminals to windows, and windows to networks of machines "
    "that talk to each other faster than any person could follow. "
)


def make_prompts(tokenizer: Any, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of lo..hi tokens (uniform), cut from natural text, each with a distinct start."""
    rng = random.Random(seed)
    base = tokenizer(_TEXT * 40, add_special_tokens=False)["input_ids"]
    prompts = []
    for i in range(n):
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(base) - length - 1)
        ids = tokenizer(f"Document {i}:", add_special_tokens=False)["input_ids"] + base[start:start + length]
        prompts.append(ids[:length])
    return prompts


def alternate_offline(groups: dict[str, Any], *, num_prompts: int, max_tokens: int, repeats: int,
                      label: str = "offline") -> dict[str, list[float]]:
    """Output tok/s of each `LLM` in `groups` on this workload (`num_prompts` prompts of 20..400
    tokens, `max_tokens` new tokens, greedy, ignore_eos), after a short warm-up; the groups take turns
    run by run, so that each round sees about the same machine load."""
    from troupe import SamplingParams

    prompts = make_prompts(next(iter(groups.values())).get_tokenizer(), num_prompts, 20, 400)
    warm_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for llm in groups.values():  # first calls (allocations, lazy inits) out of the measured runs
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], warm_up, use_tqdm=False)
    runs: dict[str, list[float]] = {name: [] for name in groups}
    for r in range(repeats):
        for name, llm in groups.items():
            rate = troupe_run(llm, prompts, max_tokens)
            runs[name].append(rate)
            print(f"  {label} {name:<20} run {r}: {rate:8.1f} output tok/s", file=sys.stderr)
    return runs


async def stream_requests(llm: Any, requests: int, concurrency: int, tokens: int) -> tuple[float, float]:
    """`requests` streaming (DELTA) requests of `tokens` tokens, `concurrency` at a time, through an
    `AsyncLLM`: (requests/s, output tokens/s)."""
    import anyio

    from troupe import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    produced = 0
    limit = anyio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal produced
        async with limit:
            async for out in llm.generate(f"Request number {i}: tell me everything.", params):
                produced += len(out.outputs[0].token_ids)

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(one, i)
    elapsed = time.perf_counter() - t
    assert produced == requests * tokens
    return requests / elapsed, produced / elapsed


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_child_rss_gib() -> float:
    """The largest peak RSS of the ended child processes (the engine process, once stopped)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def troupe_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, quantization=args.quantization, kernels=args.kernels,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                enable_prefix_caching=False, multiprocess=args.multiprocess)


def troupe_run(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """One `LLM.generate` over the workload: output tok/s."""
    from troupe import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def core_run(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    """The same workload on a bare `EngineCore` in this process (no actors): output tok/s."""
    from troupe import SamplingParams
    from troupe.config import EngineConfig
    from troupe.core.engine_core import EngineCore
    from troupe.messages import AddRequest

    core = EngineCore(EngineConfig(**troupe_options(args)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"core-{i}", p, params, args.max_tokens))
    produced = 0
    while core.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in core.step().outputs)
    return produced / (time.perf_counter() - t)


class HFRunner:
    """transformers' batched `generate` on the same prompts (left padding), one batch size per run."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from troupe.models.default_model import ensure_default_model, find_default_gguf
        from troupe.models.gguf import is_gguf
        from troupe.models.loader import resolve_model_path

        if args.threads:
            torch.set_num_threads(args.threads)
        path = resolve_model_path(args.model)
        extra: dict[str, Any] = {}
        if path == find_default_gguf():  # transformers reads the same weights from the converted folder
            path = ensure_default_model()
        elif is_gguf(path):  # transformers' own GGUF reader (expands to float)
            extra, path = {"gguf_file": path.name}, path.parent
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **extra).eval()
        self.prompts = make_prompts(tok, args.num_prompts, args.min_len, args.max_len)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.max_tokens = args.max_tokens

    def run(self, batch_size: int) -> float:
        import torch

        t = time.perf_counter()
        produced = 0
        for start in range(0, len(self.prompts), batch_size):
            chunk = self.prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=self.max_tokens, min_new_tokens=self.max_tokens,
                                          pad_token_id=self.pad)
            produced += (out.shape[1] - width) * len(chunk)
        return produced / (time.perf_counter() - t)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="troupe bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="auto: float32 for a GGUF model (the default one)")
    p.add_argument("--quantization", default="auto", help="GGUF weights: auto, gguf, gguf-q8, dequantize")
    p.add_argument("--kernels", default="auto", help="kernel set: auto, eager, cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-core", action="store_true", help="skip the bare EngineCore loop (quicker)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--multiprocess", dest="multiprocess", action="store_true", default=True,
                      help="the EngineCore in its own process (the default)")
    mode.add_argument("--in-process", dest="multiprocess", action="store_false",
                      help="the EngineCore in this process (see python -m troupe.bench_ipc for both)")
    args = p.parse_args(argv)

    from troupe import LLM

    t0 = time.perf_counter()
    llm = LLM(**troupe_options(args))
    startup = time.perf_counter() - t0
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.min_len, args.max_len)
    sizes = [] if args.skip_hf else [int(b) for b in args.hf_batch_sizes.split(",")]
    runs: dict[str, list[float]] = {"troupe": [], **{f"hf{bs}": [] for bs in sizes}}
    ratios: list[float] = []
    frontend_rss = None
    hf: HFRunner | None = None
    try:
        for r in range(args.repeats):  # troupe and transformers take turns, so each round sees the same load
            runs["troupe"].append(troupe_run(llm, prompts, args.max_tokens))
            if frontend_rss is None:
                frontend_rss = peak_rss_gib()  # before transformers' model is loaded into this process
            if sizes and hf is None:
                hf = HFRunner(args)
            for bs in sizes:
                assert hf is not None
                runs[f"hf{bs}"].append(hf.run(bs))
            line = " ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items())
            if sizes:
                ratios.append(runs["troupe"][-1] / max(runs[f"hf{bs}"][-1] for bs in sizes))
                line += f" -> {ratios[-1]:.2f}x"
            print(f"  round {r}: {line} (output tok/s)", file=sys.stderr, flush=True)
    finally:
        llm.close()
    engine_rss = peak_child_rss_gib() if args.multiprocess else None
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"engine: {'its own process' if args.multiprocess else 'in-process'}; "
          f"medians of {args.repeats} alternating round(s)")
    print(f"troupe start-up (constructor to ready): {startup:.2f} s")
    print(f"troupe peak memory (RSS):               {frontend_rss:.2f} GiB (this process)")
    if engine_rss is not None:
        print(f"troupe engine process peak RSS:         {engine_rss:.2f} GiB")
    print(f"troupe LLM.generate (actor graph):      {med['troupe']:.1f} output tok/s")
    if not args.skip_core:
        core = statistics.median(core_run(args, prompts) for _ in range(args.repeats))
        print(f"troupe bare EngineCore loop:            {core:.1f} output tok/s")
        print(f"  LLM.generate / bare EngineCore:       {med['troupe'] / core:.3f}")
    for bs in sizes:
        print(f"transformers generate, batch {bs:>3}:      {med[f'hf{bs}']:.1f} output tok/s")
    if sizes:
        best = max(med[f"hf{bs}"] for bs in sizes)
        print(f"ratio troupe (LLM.generate) / best transformers: {med['troupe'] / best:.2f}x"
              f" (per round: {', '.join(f'{x:.2f}x' for x in ratios)})")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
