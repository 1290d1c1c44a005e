"""Every Triton kernel compiles ahead of time for Hopper (sm_90) to PTX and a cubin, on this CPU-only
machine: `python -m troupe.kernels.cuda.aot` in a subprocess (the interpreter that the other kernel
tests use replaces the kernels by Python functions, so it must be off there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from troupe.paths import cache_dir

KERNELS = {"reshape_and_cache", "rotary_embedding", "rms_norm", "rms_norm-fused", "silu_and_mul",
           "prefill_attention", "decode_attention", "decode_reduce", "fused_moe"}
ROOT = Path(__file__).resolve().parents[2]


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # Triton compiles every kernel in a subprocess


def compile_env(triton_cache: Path) -> dict[str, str]:
    """A subprocess's environment: the interpreter off, Triton's cache in `triton_cache` (not the user's
    `~/.triton`, which kernels compiled for other targets or Triton builds share)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_every_kernel_compiles_for_sm90() -> None:
    """Each launcher variant (bf16 at the default model's and 8B-class shapes, float32, block size 32)
    yields sm_90 PTX and an ELF cubin within Hopper's shared memory; all nine kernels are covered. Triton's
    cache lives in troupe's cache folder: its key is the kernel's source, the target, the options and
    Triton's version, so a kernel is compiled again exactly when one of them changed."""
    proc = subprocess.run([sys.executable, "-m", "troupe.kernels.cuda.aot", "--arch", "90", "--json"],
                          env=compile_env(cache_dir() / "triton-sm90"), capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if "error" in r]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-4000:])
    covered = {k for k in KERNELS if any(r["name"].startswith(k + "-") for r in rows)}
    assert covered == KERNELS
    for r in rows:
        assert r["ptx_bytes"] > 1000 and r["cubin_bytes"] > 1000, r


@pytest.mark.parametrize("body,error", [
    ("tl.store(x + i, tl.dot(tl.load(x + i), tl.load(x + i)))", "CompilationError"),  # dot of 1-D tensors
    ("tl.store(x + i, tl.load(x + i) + undefined_name)", "CompilationError"),
])
def test_a_kernel_that_cannot_compile_fails(tmp_path: Path, body: str, error: str) -> None:
    """The check is not vacuous: a kernel that does not compile for sm_90 makes `compile_variant` raise."""
    (tmp_path / "broken_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        f"def broken(x, BLOCK: tl.constexpr):\n    i = tl.arange(0, BLOCK)\n    {body}\n"
    )
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from broken_kernel import broken\n"
        "from troupe.kernels.cuda.aot import Variant, compile_variant\n"
        "try:\n"
        "    compile_variant(Variant('broken', broken, {'x': '*fp32'}, {'BLOCK': 16, 'num_warps': 1}), 90)\n"
        "except Exception as e:\n"
        "    print('RAISED', type(e).__name__)\n"
        "else:\n"
        "    print('COMPILED')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=compile_env(tmp_path / "triton-cache"),
                          capture_output=True, text=True, timeout=300)
    assert f"RAISED {error}" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
