"""The package's layering, read from the source: no import cycle between troupe's modules, and the
layers import one way only: core -> engine -> process -> actors -> facades -> server / cli / bench
(the concept modules at the top level, output, models, kernels and testing sit below them all)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from troupe.testing.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["troupe.core", "troupe.engine", "troupe.process", "troupe.actors", "troupe.facades",
          ("troupe.server", "troupe.cli", "troupe.bench")]


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
