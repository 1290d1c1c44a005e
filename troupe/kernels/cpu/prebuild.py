"""Compiling several kernel extensions for several ISAs at once: the test suite's session start and a
process's first use of the compiled set (`troupe.kernels.cpu.available`).

`prebuild` plans every missing build folder (`build.build_folder`, locked as `build.build` locks it,
skipping one another process holds), then runs every source of every extension and ISA in one pool of
compiler processes, the longest first, after one precompiled header per ISA that has enough sources to
repay it, then one link per extension; only a folder whose link succeeded gets its `built` marker. It
loads nothing: `build.build` (through `load_ops`) loads from the cache afterwards, and reports a build
that failed here. On a 2-core Zen 4 the suite's prebuild of both ISAs takes 75-85 s, against 107 s built
one extension per Python process (docs/kernels.md).
"""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

import troupe.kernels.cpu.build as build

log = build.log


# The headers every source includes first, precompiled once per ISA when `prebuild` compiles at least
# `PCH_MIN_SOURCES` sources for it: parsing them is ~4 s of each source's ~6-25 s, making the precompiled
# header ~13 s (and ~280 MB, in a temporary folder removed afterwards).
PCH_HEADERS = ("ATen/Parallel.h", "ATen/core/Tensor.h", "ATen/ops/empty.h", "torch/library.h")
PCH_MIN_SOURCES = 5


def prebuild(extensions: dict[str, tuple[str, ...]], isas: Sequence[str] | Mapping[str, Collection[str]] = ("native",),
             jobs: int = 2, timeout: float = 1800) -> None:
    """Compile `extensions` (name -> sources) for each of `isas` (or, where `isas` maps each ISA to names
    of `extensions`, those for that ISA) into the cache that `build` then loads from, without loading
    them (a process loads one library per name): every source of every extension and ISA in one pool of
    `jobs` compiler processes (the longest first), after one precompiled header per ISA, then the links.
    What the cache holds already is skipped, and so is a folder whose lock another process holds (it is
    building it). A build that fails is left for `build` to report where it is used."""
    try:
        build.check_toolchain()
    except build.BuildError:
        return  # `build` reports it where the kernels are used
    todo: list[tuple[str, str, tuple[str, ...], Path]] = []
    guards: dict[Path, IO[str]] = {}
    try:
        wanted = isas if isinstance(isas, Mapping) else {target: extensions for target in isas}
        for target, names in wanted.items():
            for name in names:
                sources = extensions[name]
                folder = build.build_folder(name, sources, target)
                if folder in guards or (folder / "built").exists():  # planned already (`build_target`), or built
                    continue
                folder.mkdir(parents=True, exist_ok=True)
                guard = open(folder / "troupe.lock", "w")
                try:
                    fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # another process is building it
                    guard.close()
                    continue
                guards[folder] = guard
                if not (folder / "built").exists():
                    todo.append((build.build_target(target), name, tuple(sources), folder))
        with tempfile.TemporaryDirectory(prefix="troupe-pch-") as tmp:
            _pool(todo, jobs, timeout, Path(tmp), guards)
    finally:
        for held in guards.values():
            held.close()
    if todo:
        build.remove_stale(keep=todo[-1][3])


def _pool(todo: list[tuple[str, str, tuple[str, ...], Path]], jobs: int, timeout: float, tmp: Path,
          guards: dict[Path, IO[str]]) -> None:
    """Build `todo` (target, name, sources, folder) in one pool of `jobs` workers, the precompiled headers
    in `tmp`; each folder's lock in `guards` is released once its link has ended."""
    def attempt(cmd: list[str]) -> bool:
        try:
            build.run_compiler(cmd, "a kernel library", timeout)
        except build.BuildError:
            return False
        return True

    targets = sorted({target for target, *_ in todo})
    counts = {t: sum(len(sources) for target, _, sources, _ in todo if target == t) for t in targets}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pch_targets = [t for t in targets if counts[t] >= PCH_MIN_SOURCES]
        pch = {t: pool.submit(_precompile, tmp / t, t, timeout) for t in pch_targets}
        # the workers the precompiles leave idle take those ISAs' longest sources meanwhile, without the header
        spare = max(0, jobs - len(pch))
        early: dict[Path, Future[bool]] = {}
        bare = [cmd for target, name, sources, folder in todo if spare and target in pch
                for cmd in build.plan_build(name, sources, target, folder).compiles]  # only if a worker is spare
        for cmd, src in sorted(bare, key=lambda item: -item[1].stat().st_size)[:spare]:
            early[src] = pool.submit(attempt, cmd)
        plans = [(folder, build.plan_build(name, sources, target, folder,
                                           pch[target].result() if target in pch else None))
                 for target, name, sources, folder in todo]
        compiles = sorted((cmd for _, plan in plans for cmd in plan.compiles if cmd[1] not in early),
                          key=lambda item: -item[1].stat().st_size)  # the longest first: the cores end together
        compiled = {**early, **{src: pool.submit(attempt, cmd) for cmd, src in compiles}}  # a source copy: one folder's
        links = {folder: pool.submit(attempt, plan.link) for folder, plan in plans
                 if all(compiled[src].result() for _, src in plan.compiles)}
        for folder, linked in links.items():
            if linked.result():
                (folder / "built").touch()
            guards.pop(folder).close()  # waiters may go on: load it, or build it and see the error


def _precompile(folder: Path, target: str, timeout: float) -> Path | None:
    """`PCH_HEADERS` precompiled for `target` in `folder`: the header to `-include` (its `.gch` beside
    it), or None if that failed (the sources then parse the headers themselves)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = folder / "troupe_pch.h"
    header.write_text("".join(f"#include <{h}>\n" for h in PCH_HEADERS))
    try:
        cmd = [build.compiler_command(), *build.compile_flags(target), "-x", "c++-header", str(header),
               "-o", f"{header}.gch"]
        build.run_compiler(cmd, "the precompiled header", timeout)
    except build.BuildError as exc:
        log.info("precompiling the kernels' headers failed: compiling without", reason=str(exc)[:500])
        return None
    return header
