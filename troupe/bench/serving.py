"""The serving part of `troupe bench`: an engine's OpenAI server under concurrent HTTP streams.

`serve_once` starts a server command (`troupe serve`, or vLLM's `vllm.entrypoints.openai.api_server` on
the peer's python) in a new session on a free loopback port, waits for `/health` to answer 200 (its
start-up: process start to ready), runs the load of `troupe.bench.server.run` from this process
(`clients` concurrent streaming completions, greedy, ignore_eos, each prompt with its own number so a
prefix cache could not help; TTFT and the gaps between streamed chunks), samples the server's process
tree meanwhile, and stops it (SIGTERM, then SIGKILL to whatever is left of its group).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from troupe.bench import server as load
from troupe.bench.peers import WorkerError, log_tail, stop_group
from troupe.bench.rss import TreePeak, TreeSampler

SERVED_NAME = "bench-model"


@dataclass
class ServeRun:
    figures: dict[str, Any]  # troupe.bench.server.run's result
    ready_s: float  # process start to /health 200
    peak: TreePeak
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_flags(options: dict[str, Any]) -> list[str]:
    """`troupe serve` flags for engine options (EngineConfig field names): `key=value` -> `--key value`,
    True -> `--key`, enable_prefix_caching=False -> `--no-prefix-caching`."""
    flags: list[str] = []
    for key, value in options.items():
        if key == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif key == "multiprocess":
            flags += [] if value else ["--in-process"]
        elif value is True:
            flags.append("--" + key.replace("_", "-"))
        elif value is not None and value is not False:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def troupe_serve_cmd(model: str, options: dict[str, Any], port: int) -> list[str]:
    return [sys.executable, "-m", "troupe.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, *engine_flags(options)]


def vllm_serve_cmd(python: str, folder: str, port: int, dtype: str) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--no-enable-prefix-caching", "--seed", "0"]


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float, log: Path) -> float:
    """Poll `url`/health until 200; returns time.time() then. Raises `WorkerError` if the server exits or
    `timeout` s pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise WorkerError(f"the server exited (status {proc.returncode}) before it was ready; "
                              f"its output ends:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.time()
        except httpx.TransportError:
            pass
        time.sleep(0.25)  # polling: a server's readiness has no event to wait on
    raise WorkerError(f"the server was not ready after {timeout:.0f} s; its output ends:\n{log_tail(log)}")


@contextlib.contextmanager
def served(cmd: list[str], url: str, env: dict[str, str], log: Path,
           startup_timeout: float) -> Iterator[tuple[float, TreeSampler]]:
    """Start the server `cmd` in a new session (its output to `log`), wait until `url`/health answers;
    yields (seconds from process start to ready, the sampler of its process tree); on leaving, the
    sampler stops (its `peak` stays readable) and the whole process group is stopped."""
    with open(log, "wb") as out:
        spawned = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        with TreeSampler(proc.pid, group=proc.pid) as sampler:
            yield wait_healthy(url, proc, startup_timeout, log) - spawned, sampler
    finally:
        stop_group(proc, grace=60.0)


def _first_leaf(e: BaseException) -> BaseException:
    """The first exception at the bottom of an exception group (a task group's failure), else `e`."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def serve_once(cmd: list[str], port: int, *, env: dict[str, str], workdir: Path, tag: str,
               clients: int, requests: int, max_tokens: int, prompt_words: int,
               startup_timeout: float) -> ServeRun:
    """Start the server `cmd` (listening on `port`), load it, stop it; see the module docstring."""
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{tag}.log"
    args = argparse.Namespace(clients=clients, requests=requests, max_tokens=max_tokens,
                              prompt_words=prompt_words, api_key=None, served_model=SERVED_NAME)
    with served(cmd, url, env, log, startup_timeout) as (ready_s, sampler):
        try:
            figures = anyio.run(load.run, url, args)
        except Exception as e:  # a request failed or the server went away mid-load: the round fails, not the run
            raise WorkerError(f"{tag}: the load failed: {_first_leaf(e)!r}; the server's output ends:\n"
                              f"{log_tail(log)}") from e
    expected = requests * max_tokens
    if figures["output_tokens"] != expected:
        raise WorkerError(f"{tag}: {figures['output_tokens']} tokens streamed, {expected} expected "
                          f"({requests} requests x {max_tokens}, ignore_eos)")
    return ServeRun(figures=figures, ready_s=ready_s, peak=sampler.peak, log=log)
