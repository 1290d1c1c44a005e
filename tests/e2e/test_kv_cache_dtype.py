"""`kv_cache_dtype` (EngineConfig, `--kv-cache-dtype`): the KV pool's dtype, through the real engine and the
CLI; bad values and combinations are refused naming the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troupe.config import EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels.cpu import build
from troupe.kernels.eager import EagerKernels

needs_build = pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                 reason="no AVX2/FMA/F16C CPU or no C++ compiler here")
BUDGET = 2 * 2 * 2 * 16 * 4 * 16 * 40  # bytes: 40 blocks of 16 tokens of the tiny Llama in float32

pytestmark = pytest.mark.timeout(900)  # engines and CLI runs in subprocesses


def test_bad_values_name_the_option():
    """An unknown dtype, or a pool dtype the eager set cannot hold, is an InvalidInputError naming
    kv_cache_dtype and what is allowed."""
    with pytest.raises(InvalidInputError, match="kv_cache_dtype.*'auto', 'float32', 'float16', 'bfloat16'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(InvalidInputError, match="kv_cache_dtype.*eager"):
        EngineConfig(kernels="eager", dtype="float32", kv_cache_dtype="float16")
    EngineConfig(kernels="eager", dtype="float32", kv_cache_dtype="float32")  # the model's own dtype is fine
    EngineConfig(kernels="eager", kv_cache_dtype="float32")  # dtype "auto": checked once the model's is known


def test_eager_set_refuses_a_foreign_pool_dtype():
    """When "auto" falls back to the eager set (no compiler), a float16 pool asked for explicitly is
    refused when the pool is sized, naming the option; "auto" and the model's dtype are accepted."""
    with pytest.raises(InvalidInputError, match="kv_cache_dtype"):
        EagerKernels(kv_cache_dtype="float16").kv_cache_dtype(torch.float32)
    assert EagerKernels(kv_cache_dtype="bfloat16").kv_cache_dtype(torch.bfloat16) == torch.bfloat16
    assert EagerKernels().kv_cache_dtype(torch.float32) == torch.float32


def generate(llm, n: int = 12) -> tuple[list[int], int]:
    from troupe import SamplingParams

    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids), llm.get_stats()["num_kv_blocks"]


@needs_build
def test_pool_dtype_reaches_the_engine(tiny_llama: Path):
    """Through LLM, with one byte budget: the cpu set's float16 (= "auto") and bfloat16 pools hold twice the
    blocks of a float32 one; the float32 pool gives the eager set's greedy tokens, and the 16-bit pools
    generate the full answer. The bfloat16 one runs in an engine process (the option crosses the process
    boundary); the others in this process (the same engine, a faster start)."""
    from troupe import LLM

    results = {}
    for kernels, kv in (("eager", "auto"), ("cpu", "float32"), ("cpu", "float16"), ("cpu", "auto"),
                        ("cpu", "bfloat16")):
        with LLM(model=str(tiny_llama), dtype="float32", kernels=kernels, kv_cache_dtype=kv,
                 kv_cache_memory_bytes=BUDGET, num_threads=1, multiprocess=kv == "bfloat16") as llm:
            results[kernels, kv] = generate(llm)
    blocks = {k: b for k, (_, b) in results.items()}
    assert blocks["eager", "auto"] == blocks["cpu", "float32"] == 40 - 1  # block 0 is the null block
    assert blocks["cpu", "float16"] == blocks["cpu", "auto"] == blocks["cpu", "bfloat16"] == 80 - 1
    assert results["cpu", "float32"][0] == results["eager", "auto"][0]
    assert all(len(tokens) == 12 for tokens, _ in results.values())


@needs_build
def test_cli_takes_the_option(tiny_llama: Path):
    """`--kernels cpu --kv-cache-dtype float16` generates; an unknown dtype is an argparse error and a
    combination the eager set cannot hold an error naming the option, both exit 2 without a traceback."""
    base = [sys.executable, "-m", "troupe.cli", "generate", "hello", "--model", str(tiny_llama), "--dtype", "float32",
            "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--in-process"]
    ok = subprocess.run([*base, "--kernels", "cpu", "--kv-cache-dtype", "float16"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.strip()
    bad = subprocess.run([*base, "--kv-cache-dtype", "int8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--kv-cache-dtype" in bad.stderr
    eager = subprocess.run([*base, "--kernels", "eager", "--kv-cache-dtype", "float16"], capture_output=True,
                           text=True, timeout=300)
    assert eager.returncode == 2 and "kv_cache_dtype" in eager.stderr and "Traceback" not in eager.stderr
