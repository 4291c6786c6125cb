"""The import graph of the package (and of other code that imports it), read from the source.

Every import counts: at the top of a module, inside a function, and under ``TYPE_CHECKING``
(an annotation-only cycle is still a cycle for whoever reads or moves the code). The edges
are between modules: ``from .pkg import name`` points at ``pkg.name`` when that is a module,
else at ``pkg``. Python's implicit import of a module's parent packages is not an edge.

    python tests/importgraph.py            # subpackage -> subpackage edges, with counts
    python tests/importgraph.py --modules  # every module -> module edge
    python tests/importgraph.py --cycles   # the import cycles (strongly connected modules)

tests/test_import_cycles.py holds the package to no cycles.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "agentzip_blk"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name; demo/scripts are standalone programs."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        if "scripts" in path.relative_to(root).parts:
            continue
        found[module_name(path, root)] = path
    return found


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:  # import a.b.c of a non-module c: a.b
                    name = name.rpartition(".")[0]
                if name:
                    out.add(name)
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node, is_package)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif source in known:
                    out.add(source)
    out.discard(module)
    return out


def graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    mods = modules(root, package)
    known = set(mods)
    return {name: imports(path, name, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted; a set
    holds every module that can reach every other one of it through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursive: the package is a few hundred modules deep at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def subpackage(module: str, depth: int = 2) -> str:
    return ".".join(module.split(".")[:depth])


def subpackage_edges(edges: dict[str, set[str]]) -> Counter:
    """(from, to) subpackage pairs (agentzip_blk.X), with how many module edges each has."""
    pairs: Counter = Counter()
    for src, dsts in edges.items():
        for dst in dsts:
            a, b = subpackage(src), subpackage(dst)
            if a != b:
                pairs[(a, b)] += 1
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", action="store_true", help="every module -> module edge")
    ap.add_argument("--cycles", action="store_true", help="the import cycles")
    args = ap.parse_args()
    edges = graph()
    if args.cycles:
        for group in cycles(edges):
            print(" <-> ".join(group))
    elif args.modules:
        for src in sorted(edges):
            for dst in sorted(edges[src]):
                print(f"{src} -> {dst}")
    else:
        for (a, b), n in sorted(subpackage_edges(edges).items()):
            print(f"{a} -> {b} ({n})")


if __name__ == "__main__":
    main()
