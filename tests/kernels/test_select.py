"""`select_kernels`: "auto" takes the compiled cpu set where it builds, the eager set otherwise (checked
through the real engine and CLI for a missing compiler and a CPU without AVX2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import troupe.kernels.cpu as cpu
from troupe.config import EngineConfig
from troupe.errors import InvalidInputError
from troupe.kernels import select_kernels
from troupe.kernels.cpu import build


@pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                    reason="no AVX2/FMA/F16C CPU or no C++ compiler here")
def test_auto_is_the_cpu_set_where_it_builds():
    """With a compiler and AVX2/FMA/F16C, "auto" (the default) and "cpu" give the compiled set, with its
    float16 pool by default."""
    for name in ("auto", "cpu"):
        ops = select_kernels(EngineConfig(kernels=name))
        assert ops.name == "cpu" and ops.kv_cache_dtype(torch.float32) == torch.float16


def test_auto_falls_back_to_eager(monkeypatch):
    """Where the compiled kernels cannot be built (`available()` is False; it logs the reason once),
    "auto" gives the eager set, and "cpu" is an error naming the option."""
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert select_kernels(EngineConfig(kernels="auto")).name == "eager"
    assert select_kernels(EngineConfig(kernels="eager")).name == "eager"
    with pytest.raises(InvalidInputError, match="kernels.*'cpu' cannot run here"):
        select_kernels(EngineConfig(kernels="cpu"))


NO_AVX2 = """
import sys
import troupe.kernels.cpu.build as build
build.cpu_flags = lambda: frozenset({"sse2"})  # a CPU without AVX2 / FMA / F16C
from troupe.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], str]:
    """A tiny Q4_1 GGUF and the CLI's greedy answer on it with `--kernels eager` asked for: (args, stdout)."""
    from troupe.kernels.quant import QType
    from troupe.models.tiny import make_tiny_gguf

    gguf_path, _ = make_tiny_gguf(tmp_path_factory.mktemp("select") / "m", default_qtype=QType.Q4_1)
    args = ["generate", "hello world", "--model", str(gguf_path), "--max-tokens", "6", "--temperature", "0",
            "--ignore-eos", "--in-process"]
    eager = subprocess.run([sys.executable, "-m", "troupe.cli", *args, "--kernels", "eager"], capture_output=True,
                           text=True, timeout=600)
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert eager.stdout.strip()
    return args, eager.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)  # CLI runs on a tiny GGUF, in subprocesses
@pytest.mark.parametrize("why", ["no-compiler", "no-avx2"])
def test_engine_falls_back_to_eager_with_one_warning(why: str, eager_run: tuple[list[str], str]) -> None:
    """The real engine on a GGUF with `kernels` left at "auto", where the compiled kernels cannot be built
    (no C++ compiler on PATH, or a CPU without AVX2): it generates on the eager set (the blocks expanded to
    float32), the same greedy tokens as `kernels="eager"` asked for, after exactly one warning that names
    the reason; asking for "cpu" there is an error naming `kernels`, exit code 2."""
    args, eager_stdout = eager_run
    env = dict(os.environ, TROUPE_LOG_LEVEL="info")  # the CLI logs warnings only unless asked: the runner's line
    if why == "no-compiler":
        env["CXX"] = "no-such-compiler-xyz"
    cmd = [sys.executable, "-c", NO_AVX2] if why == "no-avx2" else [sys.executable, "-m", "troupe.cli"]
    fallback = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    reason = "no C++ compiler" if why == "no-compiler" else "lacks ['avx2', 'f16c', 'fma']"
    warnings = [line for line in fallback.stderr.splitlines() if "compiled CPU kernels unavailable" in line]
    assert len(warnings) == 1 and reason in warnings[0], fallback.stderr[-3000:]
    assert "kernels=eager" in fallback.stderr and "kernels=cpu" not in fallback.stderr
    assert fallback.stdout == eager_stdout
    forced = subprocess.run([*cmd, *args, "--kernels", "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert forced.returncode == 2 and "kernels: 'cpu' cannot run here" in forced.stderr, forced.stderr[-3000:]
