"""Code-structure figures for troupe (issue 17's before/after): lines per module, functions over 60
lines, import cycles between troupe's modules, and duplicated blocks (through the `duplicates` tool when
it is on PATH). Usage: `python scripts/code_stats.py [ROOT]` (ROOT: the repository, default: here)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's troupe
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # its test helpers

from support.import_graph import cycles, import_graph, modules  # noqa: E402


def long_functions(path: Path, limit: int = 60) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > limit:
                out.append((node.name, n))
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    mods = modules(root)
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    print(f"modules: {len(mods)}, lines: {sum(lines.values())}, mean {sum(lines.values()) / len(mods):.0f}, "
          f"over 300: {sum(n > 300 for n in lines.values())}, over 400: {sum(n > 400 for n in lines.values())}")
    for m, n in sorted(lines.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:5d}  {m}")
    longs = [(m, f, n) for m, p in mods.items() for f, n in long_functions(p)]
    print(f"functions over 60 lines: {len(longs)}")
    for m, f, n in sorted(longs, key=lambda t: -t[2]):
        print(f"  {n:5d}  {m}.{f}")
    graph = import_graph(root)
    found = cycles(graph)
    print(f"import cycles (strongly connected groups): {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    if shutil.which("duplicates"):
        out = subprocess.run(["duplicates", "--repo", str(root), "--most", "200"], capture_output=True, text=True)
        print(f"duplicates: {out.stdout.strip().splitlines()[0] if out.stdout.strip() else 'none'}")


if __name__ == "__main__":
    main()
