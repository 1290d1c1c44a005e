"""Serving benchmark: many concurrent streaming clients against `troupe serve` on loopback.

    python -m troupe.bench.server [--url http://127.0.0.1:8000] [--clients 64] [--requests 256]
                                  [--max-tokens 128] [--prompt-words 100] [--model MODEL] [-- serve args]

Without `--url` it starts `troupe serve MODEL --port 0 [serve args]` itself and stops it (SIGTERM)
at the end. Each of `--clients` workers sends streaming completions (greedy, `ignore_eos`, so every
request produces exactly `--max-tokens` tokens) until `--requests` were sent; every prompt starts
with its own number so the prefix cache does not short-cut prefill. Reports requests/s, output
tokens/s, and the median and p99 of time to first token (TTFT, request sent to the first text
chunk) and inter-token latency (ITL, the gap between consecutive text chunks, as vLLM's
benchmark_serving measures it). Needs httpx (`pip install 'troupe[test]'`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

_WORDS = ("the history of computing is a story of layers each generation of engineers built tools that hid "
          "the details of the one before so that the next could think about larger problems punched cards "
          "gave way to terminals terminals to windows and windows to networks of machines").split()


@dataclass
class Sample:
    ttft: float
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    resent: bool = False  # the first try met a connection the server had closed (sent again once)


def make_prompt(i: int, words: int, rng: random.Random) -> str:
    start = rng.randrange(len(_WORDS))
    body = " ".join(_WORDS[(start + k) % len(_WORDS)] for k in range(words))
    return f"Request {i}: {body}"


class _ClosedBeforeResponse(Exception):
    """The server closed the request's connection before any response (a pooled keep-alive connection it
    had just closed)."""


async def one_request(http: Any, i: int, args: argparse.Namespace, rng: random.Random) -> Sample:
    body = {"model": args.served_model, "prompt": make_prompt(i, args.prompt_words, rng),
            "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        return await _stream_one(http, i, body)
    except _ClosedBeforeResponse:
        # llama-server closes keep-alive connections after a few requests, and a request can go out on one
        # as it closes: sent again once on a fresh connection, as HTTP clients resend an idempotent
        # request, and counted. A failure after the response began is the round's failure.
        sample = await _stream_one(http, i, body)
        sample.resent = True
        return sample


async def _stream_one(http: Any, i: int, body: dict[str, Any]) -> Sample:
    import httpx

    sent = time.perf_counter()
    first: float | None = None
    last = sent
    sample = Sample(ttft=0.0)
    async with contextlib.AsyncExitStack() as stack:
        try:
            resp = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body))
        except httpx.RemoteProtocolError as e:
            raise _ClosedBeforeResponse(f"request {i}: {e}") from e
        if resp.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                sample.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                sample.ttft = now - sent
            else:
                sample.itls.append(now - last)
            last = now
    return sample


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as http:
        if args.served_model is None:
            args.served_model = (await http.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(0)
        await one_request(http, -1, args, rng)  # warm-up
        samples: list[Sample] = []
        counter = iter(range(args.requests))

        async def worker() -> None:
            for i in counter:
                samples.append(await one_request(http, i, args, rng))

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(args.clients):
                tg.start_soon(worker)
        elapsed = time.perf_counter() - start
    ttfts = [s.ttft for s in samples]
    itls = [x for s in samples for x in s.itls]
    tokens = sum(s.output_tokens for s in samples)
    return {"clients": args.clients, "requests": len(samples), "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "elapsed_s": elapsed, "requests_per_s": len(samples) / elapsed,
            "output_tokens_per_s": tokens / elapsed, "output_tokens": tokens,
            "ttft_median_ms": 1000 * statistics.median(ttfts), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "itl_median_ms": 1000 * statistics.median(itls), "itl_p99_ms": 1000 * percentile(itls, 99),
            "resent_requests": sum(s.resent for s in samples)}


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`troupe serve` on a free port (its stdout in `log`); returns once /health answers 200."""
    import httpx

    cmd = [sys.executable, "-m", "troupe.cli", "serve", args.model, "--host", "127.0.0.1", "--port", "0",
           "--max-num-seqs", str(args.clients), *args.serve_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=sys.stderr)
    deadline = time.monotonic() + 600
    url = ""
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text()
        if not url and "troupe serve: " in text:
            url = text.split("troupe serve: ", 1)[1].split()[0]
        if url:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy (exit code {proc.poll()})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m troupe.bench.server", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server; default: start one")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model for the server started here")
    p.add_argument("--served-model", default=None, help="the `model` field (default: the first served)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after `--`: extra `troupe serve` flags")
    args = p.parse_args(argv)
    args.serve_args = [a for a in args.serve_args if a != "--"]
    proc = None
    try:
        url = args.url
        if url is None:
            proc, url = start_server(args, Path(tempfile.mkdtemp()) / "serve.out")
        result = anyio.run(run, url, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
