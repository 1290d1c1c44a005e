"""Building the compiled CPU kernels: C++ sources in `csrc/`, compiled once on first use and cached.

Each extension is a set of C++ files that register their ops with `TORCH_LIBRARY(troupe_<name>, m)`;
`load_ops(name, sources)` compiles them with the C++ compiler (`$CXX`, default `c++`; one process per
source, as many at once as there are cores, then the link against torch's libraries, with the include
paths, library paths and C++ ABI that `torch.utils.cpp_extension` names) into a shared library that
`torch.ops.troupe_<name>` then calls. Why this toolchain is in docs/kernels.md; in short: a library of
registered ops includes only ATen's core headers (compiles in seconds, not the minute `torch/extension.h`
takes), calls cost a few microseconds, and `at::parallel_for` runs on torch's own OpenMP pool
(`-fopenmp`), so the kernels share torch's threads instead of fighting them.

The cache: `<troupe cache>/kernels/<name>-<key>/`, the key hashing what the library depends on: the
sources, the flags, the compiler (path and version), torch's version and the CPU's instruction-set flags,
so a changed source, another compiler, a new torch or a home directory shared with another kind of CPU
builds anew, while checkouts and virtual environments with the same torch share one build. A folder whose
build completed (its `built` marker) is loaded directly with `torch.ops.load_library`, with no compiler.
The sources are copied into the folder and built from there, so the same sources in another checkout (a
fresh clone) find the build done. Concurrent first uses
are safe: an OS file lock per build folder, so a build in progress elsewhere is waited for, not
duplicated, and a build killed midway leaves no marker and is redone. Each load stamps the folder's marker
with the time, and each new build empties the folders of the cache no process has loaded for
`STALE_AFTER_DAYS` (the builds of older sources, flags or torch versions) but their lock file, skipping any
whose lock is held. `prebuild.prebuild` fills the same folders for several extensions and ISAs in one
pool of compiler processes (a first use, the test suite's start).

Instruction sets, decided at run time: the default compiles for the running CPU (`-march=native`), so
AVX-512 code paths (`#ifdef __AVX512F__`) are taken where the CPU has them and the AVX2/FMA paths
elsewhere; `TROUPE_CPU_ISA=avx2` builds the AVX2/FMA/F16C baseline on any CPU (tests use it to run the
baseline on an AVX-512 machine; on a CPU where both compile the same code paths, `build_target` gives them one
build). A CPU without AVX2 and FMA, no compiler, or a failed build: `load_ops`
returns False, the cause is logged once as a warning, and `kernels="auto"` runs the eager torch set.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

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


def build_target(target: str) -> str:
    """The ISA whose build serves `target`: "native" for "avx2" where the native flags define the same
    instruction-set macros that troupe's sources test (a CPU without AVX-512 or AVX-VNNI, such as an AMD
    Zen 3), since both builds then compile the same code paths; else `target`. So such a machine builds
    and caches one library per extension, not two."""
    if target != "avx2":
        return target
    native, baseline = (_isa_macros(compiler_command(), ISA_FLAGS[t]) for t in ("native", "avx2"))
    return "native" if native is not None and native == baseline else target


@functools.cache
def _tested_macros() -> frozenset[str]:
    """The instruction-set macros (`__AVX512F__`, `__FMA__`, ...) that troupe's sources test."""
    return frozenset(m for path in CSRC.iterdir() if path.suffix in (".h", ".cpp")
                     for m in re.findall(r"__(?:AVX|AMX|FMA|F16C)\w*__", path.read_text()))


@functools.cache
def _isa_macros(compiler: str, flags: tuple[str, ...]) -> frozenset[str] | None:
    """Those of `_tested_macros` that `compiler` predefines with `flags`; None if the compiler cannot say,
    or defines no `__AVX2__`."""
    try:
        out = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return _tested_macros() & defined if "__AVX2__" in defined else None


def _cache_root() -> Path:
    """The folder of every kernel build folder: `<troupe cache>/kernels`."""
    return cache_dir() / "kernels"


def compiler_command() -> str:
    """The C++ compiler's command: `$CXX`, default `c++`."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_identity() -> str:
    """The C++ compiler's resolved path and the first line of its `--version` (empty if it cannot say)."""
    compiler = shutil.which(compiler_command()) or ""
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
    """Where the build of `csrc/<sources>` as extension `name` for ISA `target` is cached (the folder of
    `build_target(target)`)."""
    flags = [*BASE_FLAGS, *ISA_FLAGS[build_target(target)]]
    return _cache_root() / _build_key(name, [CSRC / s for s in sources], flags)


def build(name: str, sources: Sequence[str]) -> None:
    """Compile (or reuse the cached build of) `csrc/<sources>` and load it: its ops appear under
    `torch.ops.troupe_<name>`. Raises `BuildError` with the reason if that cannot be done here."""
    check_toolchain()
    target = build_target(isa())
    folder = build_folder(name, sources, target)
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"troupe_{name}.so"
    # An OS lock, released when its holder dies, serializes the builds of a folder: a build in progress
    # elsewhere is waited for, and a build killed midway (no `built` marker) is redone.
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
        plan = plan_build(name, sources, target, folder)
        _run_all([cmd for cmd, _ in plan.compiles], jobs=os.cpu_count() or 1, what=f"the {name} kernels")
        run_compiler(plan.link, f"the {name} kernels")
        (folder / "built").touch()  # only now: a build killed midway leaves no marker
        try:
            torch.ops.load_library(str(library))
        except OSError as exc:
            raise BuildError(f"the {name} kernels built but do not load: {exc}") from exc
    remove_stale(keep=folder)


def check_toolchain() -> None:
    """`BuildError` naming what is missing: the CPU flags the kernels need, or the C++ compiler."""
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        raise BuildError(f"this CPU lacks {sorted(missing)} (the compiled kernels need AVX2, FMA and F16C)")
    compiler = compiler_command()
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler found ({compiler!r} is not on PATH)")


class BuildPlan(NamedTuple):
    """The compiler commands that build one extension into its folder: one per source (with that
    source), then the link."""

    compiles: list[tuple[list[str], Path]]
    link: list[str]


def compile_flags(target: str) -> list[str]:
    """What every translation unit for ISA `target` is compiled with: troupe's flags and torch's headers
    and C++ ABI (what `torch.utils.cpp_extension` would pass; no Python headers: the ops use none)."""
    from torch.utils.cpp_extension import include_paths

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    return ["-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-isystem{p}" for p in include_paths()),
            *BASE_FLAGS, *ISA_FLAGS[target]]


def plan_build(name: str, sources: Sequence[str], target: str, folder: Path, pch: Path | None = None) -> BuildPlan:
    """The commands that build `sources` as extension `name` into `folder`, from copies of the sources
    there (`_stable_sources`); `pch`: a header precompiled with the same flags (`prebuild.precompile`), included
    first by every source."""
    from torch.utils.cpp_extension import library_paths

    compiler = compiler_command()
    src = _stable_sources(folder, [CSRC / s for s in sources])
    flags = [*compile_flags(target), f"-I{src}", *(["-include", str(pch), "-Winvalid-pch"] if pch else [])]
    objects = [folder / f"{Path(s).stem}.o" for s in sources]
    compiles = [([compiler, *flags, "-c", str(src / s), "-o", str(obj)], src / s)
                for s, obj in zip(sources, objects, strict=True)]
    link = [compiler, "-shared", "-fopenmp", *map(str, objects), *(f"-L{p}" for p in library_paths()),
            "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(folder / f"troupe_{name}.so")]
    return BuildPlan(compiles, link)


def run_compiler(cmd: list[str], what: str, timeout: float = 1800) -> None:
    """Run one compiler command; `BuildError` with the compiler's last words if it fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"building {what} failed: {exc}") from exc
    if out.returncode != 0:
        raise BuildError(f"building {what} failed ({Path(cmd[0]).name} exited {out.returncode}):\n"
                         f"{(out.stderr or out.stdout)[-4000:]}")


def _run_all(cmds: Sequence[list[str]], jobs: int, what: str) -> None:
    """`cmds` at most `jobs` at a time; the first failure is raised once all have ended."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_compiler, cmd, what) for cmd in cmds]
    for future in futures:
        future.result()


def _stamp_use(folder: Path) -> None:
    """The marker's time is the folder's last load (a read-only cache keeps its old time)."""
    try:
        os.utime(folder / "built")
    except OSError:
        pass


def remove_stale(keep: Path) -> None:
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
    """The sources and shared headers, copied once into the build folder and built from there: the
    library then depends on nothing in the checkout it was built from (a fresh clone may be deleted
    while another uses the cache), and a build's compiler messages name paths that stay. The folder's
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
