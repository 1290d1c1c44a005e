"""The compiled CPU kernels' build: cached, targeted at the ISA asked for, sharing torch's threads, and a
clear fallback when it cannot be done."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from troupe.kernels.cpu import build

needs_build = pytest.mark.skipif(not build.REQUIRED_CPU_FLAGS <= build.cpu_flags() or not build.shutil.which("c++"),
                                 reason="no AVX2/FMA/F16C CPU or no C++ compiler here")


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(600)  # a C++ build (unless cached)
def test_probe_builds_for_this_cpu_and_shares_torchs_threads():
    """The probe extension builds (or comes from the cache), reports the ISA the CPU has, and its
    `at::parallel_for` runs on as many threads as torch is set to."""
    assert build.load_ops("probe", ("probe.cpp",))
    expected = "avx512" if "avx512f" in build.cpu_flags() else "avx2"
    assert torch.ops.troupe_probe.isa() == expected
    assert torch.ops.troupe_probe.parallel_threads() == min(torch.get_num_threads(), 64)


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(700)  # a C++ build in a subprocess
def test_avx2_baseline_builds_on_any_cpu(tmp_path):
    """TROUPE_CPU_ISA=avx2 builds the AVX2/FMA baseline (what an AVX2-only machine runs) even on an
    AVX-512 CPU, in its own cache entry."""
    code = textwrap.dedent("""
        import torch
        from troupe.kernels.cpu.build import load_ops
        assert load_ops("probe", ("probe.cpp",))
        print(torch.ops.troupe_probe.isa())
    """)
    env = {**os.environ, "TROUPE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "avx2"


def test_missing_compiler_falls_back_with_a_reason(monkeypatch):
    """Without a compiler the build raises `BuildError` saying so (and `load_ops` would answer False), so
    `kernels="auto"` keeps the eager set."""
    monkeypatch.setattr(build, "cpu_flags", lambda: build.REQUIRED_CPU_FLAGS)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(build.BuildError, match="no C.. compiler"):
        build.build("probe", ("probe.cpp",))


def test_bad_isa_is_refused(monkeypatch):
    """An unknown TROUPE_CPU_ISA is an error naming the variable, not a silent default."""
    monkeypatch.setenv("TROUPE_CPU_ISA", "sse2")
    with pytest.raises(build.BuildError, match="TROUPE_CPU_ISA"):
        build.isa()


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(600)  # one small C++ build
def test_prebuild_finishes_a_killed_build_and_a_later_process_loads_without_the_toolchain(tmp_path):
    """`prebuild` compiles a library into its own cache folder per ISA, marked complete, over what a build
    killed midway left there (a folder without its `built` marker, a partial object file), and empties a
    folder of the cache no process has loaded for two months (`STALE_AFTER_DAYS`); a later
    process loads a completed library directly (here with every compiler command made to fail), so another
    checkout or virtual environment with the same torch and compiler does not build again. The AVX2 build
    is made in an empty cache; the native one is the session's (tests/conftest.py prebuilds it)."""
    env = {**os.environ, "TROUPE_CACHE_DIR": str(tmp_path), "TROUPE_CPU_ISA": "avx2"}
    key = build.build_folder("probe", ("probe.cpp",), "avx2").name  # the native one's where they are the same
    stale = tmp_path / "kernels" / key
    stale.mkdir(parents=True)
    (stale / "probe.o").write_text("half an object file")  # what a killed build leaves
    unused = tmp_path / "kernels" / "attention-0123456789abcdef"  # last loaded two months ago
    unused.mkdir()
    for name in ("built", "troupe_attention.so"):
        (unused / name).write_text("")
        os.utime(unused / name, (time.time() - 60 * 86400,) * 2)
    prebuild = "from troupe.kernels.cpu.prebuild import prebuild; prebuild({'probe': ('probe.cpp',)}, ('avx2',))"
    subprocess.run([sys.executable, "-c", prebuild], env=env, check=True, timeout=600)
    folders = list((tmp_path / "kernels").glob("probe-*"))
    assert folders == [stale] and (stale / "built").exists()
    assert [p.name for p in unused.iterdir()] == ["troupe.lock"]  # the new build emptied it
    subprocess.run([sys.executable, "-c", prebuild.replace("avx2", "native")], env={**os.environ}, check=True,
                   timeout=600)
    code = textwrap.dedent("""
        import torch
        from troupe.kernels.cpu import build
        def no_build(*args, **kwargs):
            raise RuntimeError("built again")
        build.run_compiler = no_build
        build.build("probe", ("probe.cpp",))
        print(torch.ops.troupe_probe.isa())
    """)
    for isa, cache in (("avx2", {"TROUPE_CACHE_DIR": str(tmp_path)}), ("native", {})):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **cache, "TROUPE_CPU_ISA": isa},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        native = "avx512" if "avx512f" in build.cpu_flags() else "avx2"
        assert out.stdout.strip() == (native if isa == "native" else "avx2")


def test_a_new_build_empties_the_folders_unused_for_a_while(monkeypatch, tmp_path):
    """After a new build, the cache's folders last loaded (or, unfinished, last written) more than
    `STALE_AFTER_DAYS` ago are emptied but for their lock file; recent ones, the new one and one whose lock
    another process holds are left whole."""
    import fcntl

    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    now = time.time()
    old, recent = now - (build.STALE_AFTER_DAYS + 10) * 86400, now - 86400

    def folder(name: str, marker_time: float | None, files_time: float) -> Path:
        f = tmp_path / name
        (f / "src").mkdir(parents=True)
        for path in (f / "troupe_x.so", f / "src" / "x.cpp", f / "troupe.lock"):
            path.write_text("x")
            os.utime(path, (files_time, files_time))
        os.utime(f / "src", (files_time, files_time))
        if marker_time is not None:
            (f / "built").touch()
            os.utime(f / "built", (marker_time, marker_time))
        return f

    stale = folder("qmm-stale", old, old)
    used = folder("qmm-used", recent, old)  # built long ago, loaded yesterday
    unfinished = folder("qmm-killed", None, old)
    busy = folder("qmm-busy", old, old)
    new = folder("qmm-new", old, old)
    with open(busy / "troupe.lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process loading it
        build.remove_stale(keep=new)
    for emptied in (stale, unfinished):
        assert sorted(p.name for p in emptied.iterdir()) == ["troupe.lock"], emptied
    for whole in (used, busy, new):
        assert {p.name for p in whole.iterdir()} >= {"troupe_x.so", "src", "troupe.lock"}, whole
    assert (used / "built").exists() and (busy / "built").exists()


@needs_build
@pytest.mark.slow
def test_a_load_stamps_its_build_folder():
    """Loading a cached build sets its marker's time to now: what tells `build.remove_stale` it is in use."""
    assert build.load_ops("probe", ("probe.cpp",))
    marker = build.build_folder("probe", ("probe.cpp",), build.isa()) / "built"
    long_ago = time.time() - 90 * 86400
    os.utime(marker, (long_ago, long_ago))
    build.build("probe", ("probe.cpp",))
    assert marker.stat().st_mtime > time.time() - 60


def test_build_target_merges_the_avx2_build_only_where_the_code_paths_are_the_same(monkeypatch):
    """`build_target("avx2")` is "native" exactly where the compiler's ISA macros that troupe's sources
    test are the same under both flag sets: on this CPU, one without AVX-512 and AVX-VNNI. A compiler
    that cannot say (or a fake one) keeps them apart; "native" is always itself."""
    if not shutil.which(build.compiler_command()):
        pytest.skip("no C++ compiler")
    merged = not ({"avx512f", "avx_vnni"} & build.cpu_flags())
    assert build.build_target("avx2") == ("native" if merged else "avx2")
    assert build.build_target("native") == "native"
    baseline = build._isa_macros(build.compiler_command(), build.ISA_FLAGS["avx2"])
    assert baseline is not None and {"__AVX2__", "__FMA__"} <= baseline and "__AVX512F__" not in baseline
    monkeypatch.setenv("CXX", "true")  # prints nothing: no macros known
    assert build.build_target("avx2") == "avx2"


@needs_build
@pytest.mark.slow
@pytest.mark.timeout(600)  # a C++ build (unless cached)
@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_only_a_moe_model_loads_the_moe_library(tmp_path, arch):
    """An engine on the cpu set loads `troupe_moe` for a mixture-of-experts model (its experts run in it)
    and not for a dense one, which then never builds it either."""
    from troupe.models.tiny import make_transformers_model

    if arch == "llama":
        model = make_transformers_model(tmp_path, "LlamaConfig", **TINY)
    else:
        model = make_transformers_model(tmp_path, "Qwen3MoeConfig", num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=48, **TINY)
    code = textwrap.dedent(f"""
        from troupe import LLM, SamplingParams
        with LLM({str(model)!r}, dtype="float32", kernels="cpu", num_kv_blocks=64, num_threads=1,
                 multiprocess=False) as llm:
            out = llm.generate({{"prompt_token_ids": [5, 6, 7]}}, SamplingParams(max_tokens=2, temperature=0.0),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
            print("troupe_moe.so" in open("/proc/self/maps").read())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(arch != "llama")


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
