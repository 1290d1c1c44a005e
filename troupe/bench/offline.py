"""`python -m troupe.bench.offline`: offline throughput of troupe against Hugging Face transformers, same run.

Workload (issue #2): 64 prompts of 20..400 tokens, 128 new tokens each, greedy with ignore_eos,
on the default model. troupe (`LLM.generate`, the actor graph) and transformers' batched `generate`
(left padding, each batch size in `--hf-batch-sizes`) take turns, round by round, so that both see
the same machine load. Prints the medians of `--repeats` rounds, the ratio against the best
transformers batch size (of the medians, and per round), troupe's start-up time (constructor to
ready) and peak memory (RSS of this process before transformers is loaded, and of the engine
process); without `--skip-core`, also a bare `EngineCore` loop in this process.

`--device cuda` runs both on the GPU (in `--dtype`, bfloat16 by default; troupe takes
`--gpu-memory-utilization` of the GPU, leaving the rest to transformers in this process);
`--random-model SPEC` benchmarks a randomly initialised Llama built from a config instead of the
default model (`1b`: hidden 2048, 16 layers, 32 heads / 8 kv heads, ffn 8192, the default model's
49152-token vocabulary); `--itl` adds single-stream inter-token latency (one request of `--itl-tokens`,
troupe's from its request metrics, transformers' batch-1 `generate` as the baseline).

`--warmup-rounds` (default: 1 on the GPU, 0 on the CPU) runs whole rounds of both sides first, unmeasured:
on a GPU a first round runs well below the next ones on both sides (troupe: Triton compiling the
kernel variants of its first large prefill steps; transformers: its first batches at each shape), which a
single measured round would count as throughput.
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
    if produced != requests * tokens:
        raise RuntimeError(f"{requests} requests of {tokens} tokens produced {produced} tokens: a request finished "
                           "early (is the KV pool smaller than prompt + max_tokens?)")
    return requests / elapsed, produced / elapsed


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_child_rss_gib() -> float:
    """The largest peak RSS of the ended child processes (the engine process, once stopped)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def troupe_options(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, kernels=args.kernels,
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                   enable_prefix_caching=False, multiprocess=args.multiprocess, device=args.device,
                   enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    util = args.gpu_memory_utilization
    if util is None and args.device != "cpu":
        import torch

        util = 0.5 if torch.cuda.is_available() else None  # an engine on the CPU takes only the default
    if util is not None:
        options["gpu_memory_utilization"] = util
    return options


RANDOM_MODELS = {"1b": "hidden=2048,layers=16,heads=32,kv_heads=8,intermediate=8192"}
_RANDOM_KEYS = {"hidden": "hidden", "layers": "num_layers", "heads": "heads", "kv_heads": "kv_heads",
                "intermediate": "intermediate", "max_len": "max_position_embeddings"}


def random_model(spec: str, dtype: str, folder: str, device: str = "cpu") -> str:
    """A randomly initialised Llama folder (HF layout, the default model's tokenizer) built from `spec`,
    "key=value,..." over `_RANDOM_KEYS` or a name in `RANDOM_MODELS`; weights in `dtype`, nothing downloaded."""
    from troupe.models.tiny import make_tiny_model

    shape: dict[str, int] = {}
    for item in RANDOM_MODELS.get(spec, spec).split(","):
        key, _, value = item.partition("=")
        if key.strip() not in _RANDOM_KEYS or not value.strip().isdigit():
            raise ValueError(f"--random-model: {item!r} is not KEY=INT with KEY in {sorted(_RANDOM_KEYS)} "
                             f"(or a name in {sorted(RANDOM_MODELS)})")
        shape[_RANDOM_KEYS[key.strip()]] = int(value)
    stored = "float32" if dtype == "float32" else "bfloat16"
    return str(make_tiny_model(folder, arch="llama", init_std=0.02, dtype=stored, device=device,
                               **shape))  # type: ignore[arg-type]


def itl_run(llm: Any, prompt: list[int], tokens: int) -> float:
    """Seconds between consecutive tokens of one streaming-sized request alone in the engine (the mean gap
    between its first and last token as the frontend received them)."""
    from troupe import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.last_token_time is not None
    return (m.last_token_time - m.first_token_time) / max(1, tokens - 1)


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
    """transformers' batched `generate` on the same prompts (left padding), one batch size per run, on
    `--device` (CPU or the GPU)."""

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
        self.device = torch.device(args.device)
        # "auto": bfloat16 on CUDA (as troupe there), float32 on the CPU (a GGUF computes in float32)
        bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and self.device.type == "cuda")
        dtype = torch.bfloat16 if bf16 else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **extra)
        self.model = model.to(self.device).eval()
        self.prompts = make_prompts(tok, args.num_prompts, args.min_len, args.max_len)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.max_tokens = args.max_tokens

    def generate(self, chunk: list[list[int]], tokens: int) -> int:
        """One left-padded batch of `tokens` new tokens each; returns the tokens produced (synced)."""
        import torch

        width = max(len(p) for p in chunk)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=self.pad)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (out.shape[1] - width) * len(chunk)

    def run(self, batch_size: int) -> float:
        t = time.perf_counter()
        produced = 0
        for start in range(0, len(self.prompts), batch_size):
            produced += self.generate(self.prompts[start:start + batch_size], self.max_tokens)
        return produced / (time.perf_counter() - t)

    def itl(self, prompt: list[int], tokens: int) -> float:
        """Batch-1 seconds per generated token after the first (`tokens` new tokens minus 1 new token)."""
        t = time.perf_counter()
        self.generate([prompt], 1)
        first = time.perf_counter() - t
        t = time.perf_counter()
        self.generate([prompt], tokens)
        return (time.perf_counter() - t - first) / max(1, tokens - 1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.offline", description=__doc__,
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
    p.add_argument("--warmup-rounds", type=int, default=None,
                   help="unmeasured rounds of both sides first (default: 1 on the GPU, 0 on the CPU)")
    p.add_argument("--hf-batch-sizes", default="16,64")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-core", action="store_true", help="skip the bare EngineCore loop (quicker)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where troupe and transformers run (auto: CUDA when torch sees a GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="troupe's share of the GPU (the rest is transformers'; default 0.5); CUDA only")
    p.add_argument("--enforce-eager", action="store_true", help="troupe without CUDA graphs")
    p.add_argument("--async-scheduling", action="store_true",
                   help="troupe launches each step before the previous step's ids are read (troupe.core.overlap)")
    p.add_argument("--random-model", default=None, metavar="SPEC",
                   help="benchmark a random Llama built from a config instead of --model: "
                        f"{', '.join(RANDOM_MODELS)} or KEY=INT,... over {', '.join(_RANDOM_KEYS)}")
    p.add_argument("--itl", action="store_true", help="also measure single-stream inter-token latency")
    p.add_argument("--itl-tokens", type=int, default=256)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--multiprocess", dest="multiprocess", action="store_true", default=True,
                      help="the EngineCore in its own process (the default)")
    mode.add_argument("--in-process", dest="multiprocess", action="store_false",
                      help="the EngineCore in this process (see python -m troupe.bench.ipc for both)")
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warmup_rounds is None:
        args.warmup_rounds = 1 if args.device == "cuda" else 0
    if args.repeats < 1 or args.warmup_rounds < 0:
        p.error(f"--repeats must be >= 1 and --warmup-rounds >= 0, got {args.repeats} and {args.warmup_rounds}")
    if not args.random_model:
        return run(args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="troupe-bench-model-") as scratch:  # removed however the run ends
        t0 = time.perf_counter()
        args.model = random_model(args.random_model, args.dtype, scratch, device=args.device)
        print(f"  random model {args.random_model} written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The benchmark itself, on the parsed `args` (with `--random-model`, `args.model` is already its folder)."""
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
        for r in range(-args.warmup_rounds, args.repeats):  # troupe and transformers take turns, so each
            # round sees the same load; rounds < 0 warm both up (compiles, first shapes) and are not counted
            tok_s = {"troupe": troupe_run(llm, prompts, args.max_tokens)}
            if frontend_rss is None:
                frontend_rss = peak_rss_gib()  # before transformers' model is loaded into this process
            if sizes and hf is None:
                hf = HFRunner(args)
            for bs in sizes:
                assert hf is not None
                tok_s[f"hf{bs}"] = hf.run(bs)
            line = " ".join(f"{k} {v:.1f}" for k, v in tok_s.items())
            if sizes:
                ratio = tok_s["troupe"] / max(tok_s[f"hf{bs}"] for bs in sizes)
                line += f" -> {ratio:.2f}x"
            if r < 0:
                print(f"  warm-up round (not counted): {line} (output tok/s)", file=sys.stderr, flush=True)
                continue
            for k, v in tok_s.items():
                runs[k].append(v)
            if sizes:
                ratios.append(ratio)
            print(f"  round {r}: {line} (output tok/s)", file=sys.stderr, flush=True)
        if args.itl:
            prompt = prompts[0][:64]
            itl_run(llm, prompt, 8)  # warm-up
            itl = statistics.median(itl_run(llm, prompt, args.itl_tokens) for _ in range(3))
            hf_itl = None
            if sizes:
                assert hf is not None
                hf_itl = hf.itl(prompt, args.itl_tokens)
    finally:
        llm.close()
    engine_rss = peak_child_rss_gib() if args.multiprocess else None
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"engine: {'its own process' if args.multiprocess else 'in-process'}; device {args.device} "
          f"({gpu_name(args.device)}), dtype {args.dtype}, model {args.random_model or args.model}, "
          f"{args.num_prompts} prompts x {args.max_tokens} tokens; medians of {args.repeats} alternating round(s) "
          f"after {args.warmup_rounds} warm-up round(s)")
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
    if args.itl:
        line = f"single-stream ITL ({args.itl_tokens} tokens, median of 3): troupe {itl * 1e3:.2f} ms"
        if hf_itl is not None:
            line += f", transformers batch 1 {hf_itl * 1e3:.2f} ms -> {hf_itl / itl:.2f}x"
        print(line)
    sys.stdout.flush()
    return 0


def gpu_name(device: str) -> str:
    if device != "cuda":
        return "CPU"
    import torch

    return str(torch.cuda.get_device_name())


if __name__ == "__main__":
    raise SystemExit(main())
