"""`python -m troupe.bench.moe_llamacpp`: troupe against llama.cpp on one random-weight MoE GGUF (issue 44).

1. The model: a `qwen3moe` GGUF written by `troupe.models.moe_gguf` (default: 12 layers, hidden 1024, 16
   heads / 4 kv heads of 64, 16 experts, top-2, expert FF 2816, every matrix Q4_K, the router float32;
   the default model's tokenizer, vocabulary 49152; seed 0), ~1 GB, written once into `--workdir` and
   reused (its name says its shape and seed). Random valid Q4_K blocks: no quantizer is involved.
2. Each round (`--rounds`), each engine's OpenAI server in a fresh process, one after the other, on the
   same file: `troupe serve` (the cpu set, prefix caching off) and llama.cpp's `llama-server` (`-np B`
   parallel slots, continuous batching, `-c B x 256`, its default mmap; prompts not cached). Both take the
   same requests from the same client code here: `/v1/completions` with token-id prompts (distinct
   random ids, so that routing spreads over the experts as real text does), greedy, `ignore_eos`:
   every request streamed, N = `--gen-tokens` tokens each, its first and last chunk timed:
   - single stream: a `--prompt-len` prompt alone; TTFT = request sent to first chunk, ITL = (last chunk -
     first chunk) / (N - 1) (medians of `--single-repeats`);
   - batched decode: B = `--batch` such prompts at once; decode tok/s = the sum over the B requests of
     (N - 1) / (last chunk - first chunk): what the decode steps produce, the prefills taken out;
   and one unmeasured warm-up of each kind first. Peak RSS of each server's process tree is sampled
   meanwhile (file pages included: both engines map the GGUF).
3. The table: each engine's medians over the rounds and troupe's ratios to llama.cpp
   (`troupe.bench.report`), then the file's size.

llama.cpp's binaries come from `shared/bench/setup_peers.sh llamaserver` (`--llama-bin`, else
$LLAMA_BIN, else ~/.cache/troupe-peers/llama.cpp/build/bin); without them llama.cpp is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from troupe.bench.harness import _cpu_name
from troupe.bench.peers import PEERS_HOME, WorkerError, peer_env, troupe_env
from troupe.bench.report import Report
from troupe.bench.serving import SERVED_NAME, free_port, served, troupe_serve_cmd
from troupe.kernels.quant import QType
from troupe.models.moe_gguf import MoeShape, make_moe_gguf

GIB = 2**30
SLOT_CONTEXT = 256  # llama-server's context per slot (-c B x this): a prompt and its new tokens fit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.moe_llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = MoeShape()
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--expert-ff", type=int, default=d.expert_ff)
    p.add_argument("--qtype", default=d.qtype.name, choices=[q.name for q in QType if q != QType.F32])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "troupe-bench-moe"),
                   help="where the GGUF is written (and found on the next run) and the servers' logs go")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count())
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--troupe-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for troupe serve (e.g. quantization=gguf-q8); repeatable")
    p.add_argument("--llama-bin", default=None, help="the folder of llama-server (else $LLAMA_BIN, else the "
                   "setup_peers.sh build)")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="an extra llama-server argument, repeatable (e.g. --llama-arg=--no-repack: the repacked "
                        "and AMX weight layouts off, where a native build crashes with them)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    return p


def shape_of(args: argparse.Namespace) -> MoeShape:
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_ff", "rounds",
                 "prompt_len", "batch", "single_repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.gen_tokens < 2:
        raise SystemExit(f"--gen-tokens must be at least 2 (ITL needs two tokens), got {args.gen_tokens}")
    if args.top_k > args.experts:
        raise SystemExit(f"--top-k ({args.top_k}) must be at most --experts ({args.experts})")
    if args.prompt_len + args.gen_tokens > SLOT_CONTEXT:
        raise SystemExit(f"--prompt-len + --gen-tokens must be at most {SLOT_CONTEXT} (a llama-server slot)")
    return MoeShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, experts=args.experts, top_k=args.top_k, expert_ff=args.expert_ff,
                    qtype=QType[args.qtype])


def model_file(shape: MoeShape, seed: int, workdir: Path) -> Path:
    """The GGUF of `shape` in `workdir`, written unless a complete one is there (written to a temporary
    name, then renamed)."""
    s = shape
    name = (f"qwen3moe-L{s.layers}-h{s.hidden}-a{s.heads}x{s.head_dim}-kv{s.kv_heads}-E{s.experts}-k{s.top_k}"
            f"-f{s.expert_ff}-{s.qtype.name}-seed{seed}.gguf")
    path = workdir / name
    if not path.exists():
        t = time.perf_counter()
        partial = make_moe_gguf(workdir / (name + ".partial"), shape, tokenizer=True, seed=seed)
        os.replace(partial, path)
        print(f"  wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)
    return path


def llama_server(flag: str | None) -> Path | None:
    folder = Path(flag or os.environ.get("LLAMA_BIN") or PEERS_HOME / "llama.cpp" / "build" / "bin")
    exe = folder / "llama-server"
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids (ordinary tokens of the 49152 vocabulary), distinct."""
    rng = random.Random(seed)
    return [[rng.randrange(256, 48000) for _ in range(length)] for _ in range(count)]


class Client:
    """Streamed completions against one server: `run(batch, max_tokens)` sends every prompt at once and
    returns, per prompt, the seconds from sending to its first chunk and to its last; a request that is
    not streamed (`stream=False`) must hold exactly `max_tokens` tokens."""

    def __init__(self, url: str, extra: dict[str, Any], timeout: float) -> None:
        import httpx

        # a fresh connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few
        # requests, and a request sent on one just as it closes fails ("Server disconnected without sending a
        # response"); connecting over loopback costs both servers the same ~0.1 ms of TTFT
        self.http = httpx.Client(base_url=url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
        self.extra = extra
        self.pool = ThreadPoolExecutor(max_workers=64)

    def one(self, prompt: list[int], max_tokens: int, stream: bool) -> tuple[float, float]:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": stream, **self.extra}
        sent = time.perf_counter()
        if not stream:
            resp = self.http.post("/v1/completions", json=body)
            if resp.status_code != 200:
                raise WorkerError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            got = resp.json()["usage"]["completion_tokens"]
            if got != max_tokens:
                raise WorkerError(f"{got} tokens where {max_tokens} were asked for (ignore_eos)")
            done = time.perf_counter() - sent
            return done, done
        first = last = None
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise WorkerError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if not json.loads(line[6:]).get("choices"):
                    continue  # a usage-only chunk
                last = time.perf_counter() - sent
                first = last if first is None else first
        if first is None or last is None or last <= first:
            raise WorkerError(f"a stream of {max_tokens} tokens came in fewer than two chunks: nothing to time "
                              "the decode by (raise --gen-tokens)")
        return first, last

    def run(self, batch: list[list[int]], max_tokens: int, stream: bool = True) -> list[tuple[float, float]]:
        return [f.result() for f in [self.pool.submit(self.one, p, max_tokens, stream) for p in batch]]

    def close(self) -> None:
        self.pool.shutdown()
        self.http.close()


def measure(client: Client, single: list[int], batch: list[list[int]], n: int, repeats: int) -> dict[str, float]:
    """The figures of one server (see the module docstring, 2). Each figure is a ratio of a count to the
    time between two chunks of one stream, so it is positive whatever the noise."""
    client.run([single], n, stream=False)  # warm-up: first calls, allocations; the token count checked
    client.run(batch, n, stream=False)
    ttfts, itls = [], []
    for _ in range(repeats):
        ((first, last),) = client.run([single], n)
        ttfts.append(1e3 * first)
        itls.append(1e3 * (last - first) / (n - 1))
    rates = [(n - 1) / (last - first) for first, last in client.run(batch, n)]
    return {"single_ttft_ms": statistics.median(ttfts), "single_itl_ms": statistics.median(itls),
            "batch_decode_tok_s": sum(rates)}


def serve_and_measure(cmd: list[str], port: int, extra: dict[str, Any], env: dict[str, str], log: Path,
                      args: argparse.Namespace, single: list[int], batch: list[list[int]]) -> dict[str, float]:
    """Start the server `cmd`, measure it, stop it (its whole process group); figures plus peak RSS."""
    url = f"http://127.0.0.1:{port}"
    with served(cmd, url, env, log, args.startup_timeout) as (ready_s, sampler):
        client = Client(url, extra, args.request_timeout)
        try:
            figures = measure(client, single, batch, args.gen_tokens, args.single_repeats)
        finally:
            client.close()
    peak = sampler.peak.rss_bytes
    return {**figures, "serve_ready_s": ready_s, **({"rss_serve_gib": peak / GIB} if peak else {})}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    shape = shape_of(args)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = model_file(shape, args.seed, workdir)
    single, *batch = prompts(1 + args.batch, args.prompt_len, args.seed)
    options: dict[str, Any] = {"num_threads": args.threads, "enable_prefix_caching": False,
                               "max_num_seqs": max(args.batch, 16)}
    for item in args.troupe_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--troupe-option: {item!r} is not KEY=VALUE")
        options[key.strip().replace("-", "_")] = value.strip()
    engines: list[tuple[str, Any, dict[str, Any], dict[str, str]]] = [
        ("troupe", lambda port: troupe_serve_cmd(str(path), options, port), {}, troupe_env())]
    report = Report(troupe=["troupe"], baselines=[])
    exe = llama_server(args.llama_bin)
    if exe is None:
        report.notes.append("llama.cpp: no llama-server (run shared/bench/setup_peers.sh llamaserver, or give "
                            "--llama-bin / $LLAMA_BIN): skipped")
    else:
        report.baselines = ["llama.cpp"]
        t = str(args.threads)

        def llama_cmd(port: int) -> list[str]:
            return [str(exe), "-m", str(path), "-t", t, "-tb", t, "-np", str(args.batch),
                    "-c", str(args.batch * SLOT_CONTEXT), "--host", "127.0.0.1", "--port", str(port),
                    "--alias", SERVED_NAME, *args.llama_arg]

        engines.append(("llama.cpp", llama_cmd, {"cache_prompt": False}, peer_env()))
    print(f"troupe.bench.moe_llamacpp: {path.name} ({path.stat().st_size / GIB:.2f} GiB); "
          f"{', '.join(e[0] for e in engines)}; {args.rounds} round(s); logs in {workdir}", file=sys.stderr, flush=True)
    load_start = os.getloadavg()
    failures = 0
    for rnd in range(args.rounds):
        for label, cmd, extra, env in engines:
            port = free_port()
            try:
                figures = serve_and_measure(cmd(port), port, extra, env, workdir / f"{label}.r{rnd}.log", args,
                                            single, batch)
            except WorkerError as e:
                failures += 1
                report.notes.append(f"{label}, round {rnd}: {str(e).splitlines()[0]}")
                print(f"  {label} round {rnd}: {e}", file=sys.stderr)
                continue
            for key, value in figures.items():
                report.add(label, key, value)
            print(f"  {label} round {rnd}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                  file=sys.stderr, flush=True)
    s = shape
    print(f"MoE GGUF: qwen3moe, {s.layers} layers, hidden {s.hidden}, {s.experts} experts top-{s.top_k}, expert FF "
          f"{s.expert_ff}, {s.qtype.name}, {path.stat().st_size / GIB:.2f} GiB ({s.expert_bytes() / GIB:.2f} GiB "
          f"of experts); CPU {_cpu_name()}, {args.threads} threads; prompts of {args.prompt_len} tokens, "
          f"{args.gen_tokens} new, batch {args.batch}; llama-server arguments {args.llama_arg or 'none'} extra; "
          f"medians of {args.rounds} round(s); load average "
          f"{load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print(report.table())
    if args.json:
        data = {**report.to_json(), "file_bytes": path.stat().st_size, "shape": {
            k: getattr(s, k) for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k",
                                       "expert_ff", "vocab")} | {"qtype": s.qtype.name}, "args": vars(args)}
        Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
