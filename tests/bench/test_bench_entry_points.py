"""Every `troupe.bench` tool that docs/benchmarks.md runs as `python -m troupe.bench.<tool>` runs when
called that way: a module with a `main()` ends in the `if __name__ == "__main__":` guard that calls
it (without one, `python -m` imports the module and exits 0, printing nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "troupe" / "bench"


def calls_main_when_run(tree: ast.Module) -> bool:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "main"
                        for n in node.body for c in ast.walk(n))):
            return True
    return False


def test_every_bench_tool_with_a_main_runs_it_under_python_m() -> None:
    """Read from the source (nothing imported): each module defining `main` calls it under the guard."""
    tools = {path.stem: ast.parse(path.read_text()) for path in sorted(BENCH.glob("*.py"))
             if not path.stem.startswith("_")}
    with_main = {name for name, tree in tools.items()
                 if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)}
    assert {"harness", "offline", "kernel_sets", "accuracy"} <= with_main  # the check sees the tools
    assert sorted(name for name in with_main if not calls_main_when_run(tools[name])) == []
