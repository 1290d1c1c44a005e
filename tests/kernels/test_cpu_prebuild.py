"""The pooled build of several kernel extensions and ISAs (`troupe.kernels.cpu.prebuild`), with a fake
compiler: the order of the commands, the precompiled headers, the folders marked built, a failed source,
a folder another process builds, and what a first use hands it."""

from __future__ import annotations

from pathlib import Path

import pytest

from troupe.kernels.cpu import build, prebuild


class FakeCompiler:
    """Stands in for the compiler in `build.run_compiler`: records each command, writes the file it names after
    `-o`, and fails the commands whose text contains any of `fail`."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.commands: list[list[str]] = []
        self.fail = fail

    def __call__(self, cmd: list[str], what: str, timeout: float = 1800) -> None:
        self.commands.append(cmd)
        if any(f in " ".join(cmd) for f in self.fail):
            raise build.BuildError(f"building {what} failed")
        Path(cmd[cmd.index("-o") + 1]).write_text("x")

    def sources(self) -> list[str]:
        return [Path(c[c.index("-c") + 1]).name for c in self.commands if "-c" in c]


EXTS = {"one": ("probe.cpp",), "three": ("attention.cpp", "attention_decode.cpp", "attention_prefill.cpp"),
        "fused": ("fused.cpp",)}


@pytest.fixture
def separate_isas(monkeypatch):
    """The native and AVX2 builds in folders of their own, as on a CPU with AVX-512 (`build.build_target`
    merges them on a CPU without)."""
    monkeypatch.setattr(build, "build_target", lambda target: target)


def test_prebuild_pools_every_source_after_one_precompiled_header_per_isa(monkeypatch, tmp_path, separate_isas):
    """One pool for all of it: per ISA with at least `PCH_MIN_SOURCES` sources to compile, the headers
    are precompiled first and every source of that ISA includes them; then every source (of every
    extension and ISA), the longest first; then one link per extension, whose folder alone is marked
    built. An ISA with fewer sources gets no precompiled header."""
    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    monkeypatch.setattr(prebuild, "PCH_MIN_SOURCES", 5)
    fake = FakeCompiler()
    monkeypatch.setattr(build, "run_compiler", fake)
    prebuild.prebuild(EXTS, ("native", "avx2"), jobs=1)  # one job: the commands run in the order submitted
    kinds = ["pch" if "c++-header" in c else "link" if "-shared" in c else "compile" for c in fake.commands]
    assert kinds == ["pch"] * 2 + ["compile"] * 10 + ["link"] * 6
    headers = {c[-1].removesuffix(".gch") for c in fake.commands[:2]}
    compiles = fake.commands[2:12]
    assert all(c[c.index("-include") + 1] in headers for c in compiles)
    assert {c[c.index("-include") + 1] for c in compiles} == headers  # each ISA its own
    sizes = [(build.CSRC / name).stat().st_size for name in fake.sources()]
    assert sizes == sorted(sizes, reverse=True)
    for target in ("native", "avx2"):
        for name, sources in EXTS.items():
            assert (build.build_folder(name, sources, target) / "built").exists()
    assert not any(tmp_path.glob("**/*.gch"))  # the precompiled headers (~280 MB each) are not kept

    fake.commands.clear()
    prebuild.prebuild({"one": ("probe.cpp",)}, ("native",), jobs=1)
    assert fake.commands == []  # built: nothing to do
    prebuild.prebuild({"two": ("probe.cpp", "fused.cpp")}, ("native",), jobs=1)
    assert [c for c in fake.commands if "c++-header" in c or "-include" in c] == []  # 2 sources: no header


def test_prebuild_builds_for_each_isa_the_extensions_named_for_it(monkeypatch, tmp_path, separate_isas):
    """`isas` as a mapping (ISA -> names of `extensions`): each ISA gets those and no others (the suite's
    AVX2 baseline: every library but `moe`)."""
    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    fake = FakeCompiler()
    monkeypatch.setattr(build, "run_compiler", fake)
    prebuild.prebuild(EXTS, {"native": EXTS, "avx2": ["one"]}, jobs=1)
    for name, sources in EXTS.items():
        assert (build.build_folder(name, sources, "native") / "built").exists()
        assert (build.build_folder(name, sources, "avx2") / "built").exists() == (name == "one")
    assert sorted(fake.sources()) == sorted([s for sources in EXTS.values() for s in sources] + ["probe.cpp"])


def test_an_avx2_build_the_native_one_serves_is_built_once(monkeypatch, tmp_path):
    """Where the native build compiles the same code paths as the AVX2 baseline (`build_target` says
    "native" for "avx2": a CPU without AVX-512), asking for both builds each extension once, with one
    precompiled header, into the folder that both ISAs then load from."""
    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    monkeypatch.setattr(prebuild, "PCH_MIN_SOURCES", 5)
    monkeypatch.setattr(build, "build_target", lambda target: "native")
    fake = FakeCompiler()
    monkeypatch.setattr(build, "run_compiler", fake)
    prebuild.prebuild(EXTS, {"native": EXTS, "avx2": ["one", "fused"]}, jobs=1)
    assert sorted(fake.sources()) == sorted(s for sources in EXTS.values() for s in sources)  # each once
    assert sum("c++-header" in c for c in fake.commands) == 1
    assert all("-march=native" in c for c in fake.commands if "-shared" not in c)
    for name, sources in EXTS.items():
        assert build.build_folder(name, sources, "avx2") == build.build_folder(name, sources, "native")
        assert (build.build_folder(name, sources, "avx2") / "built").exists()


def test_a_worker_the_precompile_leaves_idle_takes_the_longest_source_without_the_header(monkeypatch, tmp_path):
    """Two workers, one ISA: while one precompiles the headers, the other compiles the longest source on
    its own (no `-include`); every other source waits for the header and includes it; all are built."""
    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    monkeypatch.setattr(prebuild, "PCH_MIN_SOURCES", 5)
    fake = FakeCompiler()
    monkeypatch.setattr(build, "run_compiler", fake)
    prebuild.prebuild(EXTS, ("native",), jobs=2)
    compiles = [c for c in fake.commands if "-c" in c]
    bare = [Path(c[c.index("-c") + 1]).name for c in compiles if "-include" not in c]
    everything = [s for sources in EXTS.values() for s in sources]
    assert bare == [max(everything, key=lambda s: (build.CSRC / s).stat().st_size)]
    assert sorted(fake.sources()) == sorted(everything)  # each source once
    assert sum("c++-header" in c for c in fake.commands) == 1
    for name, sources in EXTS.items():
        assert (build.build_folder(name, sources, "native") / "built").exists()


def test_prebuild_leaves_a_failed_build_unmarked_and_builds_the_rest(monkeypatch, tmp_path):
    """A source that fails to compile leaves its extension unlinked and unmarked (`build` reports the
    error where it is used) while the others build; a precompiled header that fails only means the
    sources parse the headers themselves."""
    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    monkeypatch.setattr(prebuild, "PCH_MIN_SOURCES", 2)
    fake = FakeCompiler(fail=("attention_decode.cpp", "c++-header"))
    monkeypatch.setattr(build, "run_compiler", fake)
    prebuild.prebuild(EXTS, ("native",), jobs=2)
    assert not any("-include" in c for c in fake.commands)
    links = [c for c in fake.commands if "-shared" in c]
    assert sorted(Path(c[-1]).name for c in links) == ["troupe_fused.so", "troupe_one.so"]
    assert not (build.build_folder("three", EXTS["three"], "native") / "built").exists()
    assert (build.build_folder("one", EXTS["one"], "native") / "built").exists()


def test_prebuild_skips_a_folder_another_process_is_building(monkeypatch, tmp_path):
    """A folder whose lock another process holds is being built there: `prebuild` leaves it (whoever
    loads it waits on that lock) instead of waiting or building it twice."""
    import fcntl

    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    fake = FakeCompiler()
    monkeypatch.setattr(build, "run_compiler", fake)
    busy = build.build_folder("one", EXTS["one"], "native")
    busy.mkdir(parents=True)
    with open(busy / "troupe.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        prebuild.prebuild({"one": EXTS["one"], "fused": EXTS["fused"]}, ("native",), jobs=1)
    assert fake.sources() == ["fused.cpp"]
    assert not (busy / "built").exists()


def test_a_first_use_builds_only_what_is_missing_and_a_dense_model_no_moe(monkeypatch, tmp_path):
    """`available()` hands every extension a dense model uses that the cache lacks to one `prebuild` (one
    pool, for this ISA), then loads them; the MoE op's library only with `moe=True`, and only it then.
    Nothing is handed over once all are built."""
    import troupe.kernels.cpu as cpu

    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    calls: list[tuple[list[str], tuple[str, ...]]] = []

    def fake_prebuild(extensions, isas, jobs):
        calls.append((list(extensions), tuple(isas)))
        for name, sources in extensions.items():
            folder = build.build_folder(name, sources, isas[0])
            folder.mkdir(parents=True)
            (folder / "built").touch()

    loaded: list[str] = []
    monkeypatch.setattr(prebuild, "prebuild", fake_prebuild)
    monkeypatch.setattr(cpu, "load_ops", lambda name, sources: loaded.append(name) is None)
    monkeypatch.setenv("TROUPE_CPU_ISA", "avx2")
    cpu._build_missing.cache_clear()
    try:
        assert cpu.available()
        assert calls == [(["probe", "qmm", "attention", "fused", "stack"], ("avx2",))]
        assert loaded == ["probe", "qmm", "attention", "fused", "stack"]
        assert cpu.available(moe=True)
        assert calls[1:] == [(["moe"], ("avx2",))] and "moe" in loaded[5:]
        cpu._build_missing.cache_clear()
        assert cpu.available(moe=True) and len(calls) == 2  # all built: no prebuild
    finally:
        cpu._build_missing.cache_clear()
