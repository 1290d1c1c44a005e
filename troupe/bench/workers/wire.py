"""The protocol between `troupe bench` and an engine worker (standard library only: peers' venvs run it).

    PYTHON WORKER.py SPEC.json RESULT.json

SPEC (written by `troupe.bench.peers.run_worker`): `parts` (a subset of offline, single, startup),
`prompts` (token-id lists of the offline workload), `max_tokens`, `single_prompt` (token ids),
`single_tokens`, `single_repeats`, `warm_prompt`, `threads`, `model` (what this engine loads) and
`options` (engine keyword arguments). The worker builds its engine, generates one token of
`warm_prompt` (the first token: start-up), warms up on 8 prompts x 4 tokens, then runs the parts and
writes RESULT (one JSON object) even when it fails (`error`: the traceback; exit status 1):

- `t_ready`, `t_first_token`: wall-clock `time.time()` when the engine was built / the first token was
  back (the parent subtracts the time it spawned the process: start-up from process start);
- `offline`: `output_tokens`, `prompt_tokens`, `seconds`, `output_tok_s` of one call over every prompt
  (greedy, `max_tokens` each, ignore_eos: a count short of len(prompts) x max_tokens is an error);
- `single`: `ttft_ms` (median wall time of a 1-token generate of `single_prompt`), `itl_ms` (median of
  (T(single_tokens) - T(1)) / (single_tokens - 1)), and every repeat's figures;
- `info`: what the engine reports about itself (version, settings).

Every engine is timed by this same code around its own public generate call, so the figures compare.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        """Greedy, ignore_eos, `max_tokens` new tokens for each prompt (no prefix caching); returns the
        number of tokens produced in all."""
        ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> int:
    produced = engine.generate(prompts, max_tokens)
    if produced != len(prompts) * max_tokens:
        raise RuntimeError(f"{produced} tokens for {len(prompts)} prompts x {max_tokens} (ignore_eos): "
                           "the engine stopped early")
    return produced


def offline(engine: Engine, spec: dict[str, Any]) -> dict[str, Any]:
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    t = time.perf_counter()
    produced = _generate(engine, prompts, max_tokens)
    seconds = time.perf_counter() - t
    return {"output_tokens": produced, "prompt_tokens": sum(len(p) for p in prompts), "seconds": seconds,
            "output_tok_s": produced / seconds}


def _timed(engine: Engine, prompt: list[int], tokens: int) -> float:
    t = time.perf_counter()
    _generate(engine, [prompt], tokens)
    return time.perf_counter() - t


def single(engine: Engine, spec: dict[str, Any]) -> dict[str, Any]:
    prompt, tokens = spec["single_prompt"], spec["single_tokens"]
    ttfts, itls = [], []
    for _ in range(spec["single_repeats"]):
        first = _timed(engine, prompt, 1)
        whole = _timed(engine, prompt, tokens)
        ttfts.append(1e3 * first)
        itls.append(1e3 * (whole - first) / max(1, tokens - 1))
    return {"ttft_ms": statistics.median(ttfts), "itl_ms": statistics.median(itls), "ttft_all_ms": ttfts,
            "itl_all_ms": itls, "prompt_tokens": len(prompt), "tokens": tokens}


def run(make_engine: Callable[[dict[str, Any]], Engine]) -> None:
    """The worker's whole life (see the module docstring); exits the process."""
    spec_path, result_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"pid": os.getpid(), "parts": spec["parts"]}
    code = 0
    try:
        engine = make_engine(spec)
        try:
            result["t_ready"] = time.time()
            _generate(engine, [spec["warm_prompt"]], 1)
            result["t_first_token"] = time.time()
            result["info"] = engine.info()
            if {"offline", "single"} & set(spec["parts"]):
                _generate(engine, spec["prompts"][:8], 4)  # first calls (allocations, lazy set-up) off the clock
            if "offline" in spec["parts"]:
                result["offline"] = offline(engine, spec)
            if "single" in spec["parts"]:
                result["single"] = single(engine, spec)
        finally:
            engine.close()
    except BaseException:  # the parent reads the traceback from RESULT
        result["error"] = traceback.format_exc()
        code = 1
    result["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    sys.exit(code)  # a teardown that hangs is the parent's to end (it has the result by then)
