"""The package's layering, read from the source: no import cycle between troupe's modules, and the
layers import one way only: core -> process -> engine -> engine_side -> actors -> facades -> server /
cli / bench (the concept modules at the top level, output, models and kernels sit below them all); and
no production module imports a test helper: tests step in only through the hook points (troupe.hooks)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from support.import_graph import cycles, import_graph, imported_names, modules

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["troupe.core", "troupe.process", "troupe.engine", "troupe.engine_side", "troupe.actors", "troupe.facades",
          ("troupe.server", "troupe.cli", "troupe.bench")]
TEST_HELPERS = ("troupe.testing", "support", "tests", "conftest", "factories", "engines")


def layer(module: str) -> int:
    """0 for the modules below core, else 1 + the position of the module's layer in LAYERS."""
    for rank, names in enumerate(LAYERS, start=1):
        for name in (names,) if isinstance(names, str) else names:
            if module == name or module.startswith(name + "."):
                return rank
    return 0


def test_no_import_cycle_between_troupes_modules() -> None:
    """Tarjan over every module's imports (function-level ones too): no group of modules imports itself."""
    assert cycles(import_graph(ROOT)) == []


def test_layers_import_downwards_only() -> None:
    """No module imports one of a higher layer (the package's `__init__`, a lazy facade of the public
    names, is the one exception)."""
    graph = import_graph(ROOT)
    upward = sorted((m, d) for m, deps in graph.items() if m != "troupe"
                    for d in deps if d != "troupe" and layer(d) > layer(m))
    assert upward == []


def test_the_cycle_check_finds_a_function_level_cycle_but_not_a_type_only_one(tmp_path: Path) -> None:
    """A cycle held together by an import inside a function is found; an import under
    `if TYPE_CHECKING:` is not an import at run time and makes no cycle."""
    pkg = tmp_path / "troupe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from troupe.b import g\n")
    (pkg / "b.py").write_text(textwrap.dedent("""
        def g():
            from troupe import a
            return a
    """))
    (pkg / "c.py").write_text("from troupe.d import h\n")
    (pkg / "d.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from troupe.c import x
        def h(): ...
    """))
    assert cycles(import_graph(tmp_path)) == [["troupe.a", "troupe.b"]]


def helper_imports(root: Path) -> list[tuple[str, str]]:
    """(module, test helper it imports) for every module of the package under `root`."""
    return sorted((m, d) for m, path in modules(root).items() for d in imported_names(m, path)
                  if any(d == h or d.startswith(h + ".") for h in TEST_HELPERS))


def test_no_production_module_imports_a_test_helper() -> None:
    """No module of any layer (bench and cli included) imports test code: not `troupe.testing` (gone:
    its tiny models are `troupe.models.tiny`), nor tests/support/ or the test folder's helpers. Test
    faults reach an engine only as a plugin a config names (troupe.hooks)."""
    assert helper_imports(ROOT) == []


def test_the_test_helper_check_finds_a_function_level_import(tmp_path: Path) -> None:
    """The check sees an import of a test helper inside a function, relative or absolute."""
    pkg = tmp_path / "troupe"
    (pkg / "testing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "testing" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .testing import faults\n    return faults\n")
    (pkg / "b.py").write_text("def g():\n    import support.faults\n")
    (pkg / "c.py").write_text("import troupe.hooks\n")
    assert helper_imports(tmp_path) == [("troupe.a", "troupe.testing"), ("troupe.a", "troupe.testing.faults"),
                                      ("troupe.b", "support.faults")]
