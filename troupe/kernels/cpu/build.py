"""Building the compiled CPU kernels: C++ sources in `csrc/`, compiled once on first use and cached.

Each extension is a set of C++ files that register their ops with `TORCH_LIBRARY(troupe_<name>, m)`;
`load_ops(name, sources)` compiles them with `torch.utils.cpp_extension.load` (g++ and ninja) into a
shared library that `torch.ops.troupe_<name>` then calls. Why this toolchain is in docs/kernels.md; in
short: a library of registered ops includes only ATen's core headers (compiles in seconds, not the minute
`torch/extension.h` takes), calls cost a few microseconds, and `at::parallel_for` runs on torch's own
OpenMP pool (`-fopenmp`), so the kernels share torch's threads instead of fighting them.

The cache: `<troupe cache>/kernels/<name>-<key>/`, the key hashing what the library depends on: the
sources, the flags, the compiler (path and version), torch's version and the CPU's instruction-set flags,
so a changed source, another compiler, a new torch or a home directory shared with another kind of CPU
builds anew, while checkouts and virtual environments with the same torch share one build. A folder whose
build completed (its `built` marker) is loaded directly with `torch.ops.load_library`, without ninja (whose
build file names one environment's torch headers). The sources are copied into the folder and built from
there, so the same sources in another checkout (a fresh clone) find the build done. Concurrent first uses
are safe: an OS file lock per build folder, so a build in progress elsewhere is waited for, not
duplicated, and a build killed midway leaves no marker and is redone. Each load stamps the folder's marker
with the time, and each new build empties the folders of the cache no process has loaded for
`STALE_AFTER_DAYS` (the builds of older sources, flags or torch versions) but their lock file, skipping any
whose lock is held. `prebuild` compiles several
extensions at once, each in its own process (the test suite's session start uses it).

Instruction sets, decided at run time: the default compiles for the running CPU (`-march=native`), so
AVX-512 code paths (`#ifdef __AVX512F__`) are taken where the CPU has them and the AVX2/FMA paths
elsewhere; `TROUPE_CPU_ISA=avx2` builds the AVX2/FMA/F16C baseline on any CPU (tests use it to run the
baseline on an AVX-512 machine). A CPU without AVX2 and FMA, no compiler, or a failed build: `load_ops`
returns False, the cause is logged once as a warning, and `kernels="auto"` runs the eager torch set.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from troupe.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-DNDEBUG")
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f")}
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
STALE_AFTER_DAYS = 30  # a build folder no process has loaded for this long is emptied by the next new build


log = structlog.get_logger("troupe.kernels")


class BuildError(RuntimeError):
    """The compiled kernels cannot be built or loaded here; the message says why."""


def cpuinfo(field: str) -> str:
    """The value of `field` ("flags", "vendor_id", "model name", ...) for this machine's first CPU in
    `/proc/cpuinfo`; empty if unreadable or absent."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's first CPU (`/proc/cpuinfo`; empty if unreadable)."""
    return frozenset(cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The vendor of this machine's first CPU: "GenuineIntel", "AuthenticAMD" (empty if unreadable)."""
    return cpuinfo("vendor_id")


def isa() -> str:
    """The instruction-set target of the build: `TROUPE_CPU_ISA` ("native" or "avx2"), default "native"."""
    choice = os.environ.get("TROUPE_CPU_ISA", "native")
    if choice not in ISA_FLAGS:
        raise BuildError(f"TROUPE_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {choice!r}")
    return choice


def _cache_root() -> Path:

    return cache_dir() / "kernels"


@functools.cache
def _compiler_identity() -> str:
    """The C++ compiler's resolved path and the first line of its `--version` (empty if it cannot say)."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or ""
    if not compiler:
        return ""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return compiler
    return f"{os.path.realpath(compiler)} {out.stdout.splitlines()[0] if out.stdout else ''}"


def _build_key(name: str, sources: Sequence[Path], flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    for src in sorted(sources):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # shared headers count for every extension
        h.update(header.name.encode())
        h.update(header.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_compiler_identity().encode())
    h.update(torch.__version__.encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    return f"{name}-{h.hexdigest()[:16]}"


def build_folder(name: str, sources: Sequence[str], target: str) -> Path:
    """Where the build of `csrc/<sources>` as extension `name` for ISA `target` is cached."""
    return _cache_root() / _build_key(name, [CSRC / s for s in sources], [*BASE_FLAGS, *ISA_FLAGS[target]])


def build(name: str, sources: Sequence[str]) -> None:
    """Compile (or reuse the cached build of) `csrc/<sources>` and load it: its ops appear under
    `torch.ops.troupe_<name>`. Raises `BuildError` with the reason if that cannot be done here."""
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        raise BuildError(f"this CPU lacks {sorted(missing)} (the compiled kernels need AVX2, FMA and F16C)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler found ({compiler!r} is not on PATH)")
    paths = [CSRC / s for s in sources]
    target = isa()
    flags = [*BASE_FLAGS, *ISA_FLAGS[target]]
    folder = build_folder(name, sources, target)
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    # cpp_extension's own lock is a file it deletes when done: a build killed midway leaves it behind and
    # every later build of the folder waits for it forever. An OS lock, released when its holder dies,
    # serializes our builds instead; whoever holds it knows a leftover `lock` file is stale.
    library = folder / f"troupe_{name}.so"
    with open(folder / "troupe.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (folder / "built").exists():
            try:
                torch.ops.load_library(str(library))
                _stamp_use(folder)
                return
            except OSError as exc:  # a library removed or damaged by hand: build it again
                log.warning("cached kernel library does not load: rebuilding", kernels=name, reason=str(exc))
                (folder / "built").unlink()
        (folder / "lock").unlink(missing_ok=True)
        src = _stable_sources(folder, paths)
        try:
            load(f"troupe_{name}", [str(src / p.name) for p in paths], extra_cflags=flags, extra_include_paths=[str(src)],
                 extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False, verbose=False)
        except (RuntimeError, OSError, ImportError) as exc:  # cpp_extension raises RuntimeError for a failed build
            raise BuildError(f"building the {name} kernels failed: {exc}") from exc
        (folder / "built").touch()  # only now: a build killed midway leaves no marker
    _remove_stale(keep=folder)


def _stamp_use(folder: Path) -> None:
    """The marker's time is the folder's last load (a read-only cache keeps its old time)."""
    try:
        os.utime(folder / "built")
    except OSError:
        pass


def _remove_stale(keep: Path) -> None:
    """Empty the cache's build folders last loaded (or, never finished, last written) more than
    `STALE_AFTER_DAYS` ago, except `keep` and any whose lock another process holds (a build or a load in
    progress). Only the lock file stays: a process that opened it before stays excluded from one that
    opens it after, and builds the folder again under it if it needs that build after all. A library
    already loaded from a folder stays mapped in its process."""
    cutoff = time.time() - STALE_AFTER_DAYS * 86400
    for folder in _cache_root().iterdir():
        if folder == keep or not folder.is_dir():
            continue
        marker = folder / "built"
        try:
            contents = [p for p in folder.iterdir() if p.name != "troupe.lock"]
            if not contents:
                continue
            last = max(p.stat().st_mtime for p in ([marker] if marker.exists() else contents))
        except OSError:  # removed meanwhile, or not readable
            continue
        if last >= cutoff:
            continue
        try:
            with open(folder / "troupe.lock", "a") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                marker.unlink(missing_ok=True)  # first: a folder half emptied reads as unbuilt
                for path in contents:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
        except OSError:  # held by another process, or not ours to change
            continue
        log.info("emptied a kernel build unused for a while", folder=str(folder), days=STALE_AFTER_DAYS)


def _stable_sources(folder: Path, paths: Sequence[Path]) -> Path:
    """The sources and shared headers, copied once into the build folder, which ninja then builds from:
    its build file names source paths, so building from the checkout would recompile everything
    whenever the same sources sit in another checkout (every fresh clone, every CI run). The folder's
    key hashes their contents, so a copy that exists is the right one (written whole, then renamed)."""
    src = folder / "src"
    src.mkdir(exist_ok=True)
    for path in [*paths, *sorted(CSRC.glob("*.h"))]:
        target = src / path.name
        if not target.exists():
            partial = target.with_suffix(target.suffix + ".partial")
            shutil.copyfile(path, partial)
            os.replace(partial, target)
    return src


@functools.cache
def load_ops(name: str, sources: tuple[str, ...]) -> bool:
    """`build` once per process; False (with one warning log line naming the cause) when it cannot be done."""
    try:
        build(name, sources)
    except BuildError as exc:
        log.warning("compiled CPU kernels unavailable: using the eager torch kernels", kernels=name, reason=str(exc))
        return False
    return True


def prebuild(extensions: dict[str, tuple[str, ...]], isas: Sequence[str] = ("native",), jobs: int = 2,
             timeout: float = 1800) -> None:
    """Compile `extensions` (name -> sources) for each of `isas`, `jobs` builds at a time, each in its own
    process (a process loads one library per name), into the cache that `build` then loads from; what the
    cache holds already is skipped here. A build that fails is left for `build` to report where it is
    used."""
    from concurrent.futures import ThreadPoolExecutor

    def one(target: str, name: str, sources: tuple[str, ...]) -> None:
        if (build_folder(name, sources, target) / "built").exists():
            return  # built before: no process (and no torch import) to find that out
        code = f"from troupe.kernels.cpu.build import load_ops; load_ops({name!r}, {tuple(sources)!r})"
        env = {**os.environ, "TROUPE_CPU_ISA": target, "MAX_JOBS": "1"}  # the parallelism is ours: one job each
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=timeout, check=False)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for target in isas:
            for name, sources in extensions.items():
                pool.submit(one, target, name, sources)
