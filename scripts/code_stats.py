"""Code-structure figures for troupe (issue 17's before/after): lines per module, functions over 60
lines, import cycles between troupe's modules, and duplicated blocks (through the `duplicates` tool when
it is on PATH). Usage: `python scripts/code_stats.py [ROOT]` (ROOT: the repository, default: here)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "troupe").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """troupe modules `name` imports, at any depth (function-level too), except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    resolved = set()
    for mod in found:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            resolved.add(mod)
    return resolved


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


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
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    found = cycles(graph)
    print(f"import cycles (strongly connected groups): {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    if shutil.which("duplicates"):
        out = subprocess.run(["duplicates", "--repo", str(root), "--most", "200"], capture_output=True, text=True)
        print(f"duplicates: {out.stdout.strip().splitlines()[0] if out.stdout.strip() else 'none'}")


if __name__ == "__main__":
    main()
