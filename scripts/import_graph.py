"""The import graph of the package: which module imports which, cycles, and arrows against the layers.

    python scripts/import_graph.py            # summary: modules, arrows, cycles, upward arrows, long modules
    python scripts/import_graph.py --dot      # Graphviz of the package-level graph

Every `import` / `from ... import` in the source counts, at module level or inside a function (a
function-level import is still a dependency; hiding a cycle inside a function does not break it).
Modules are files; a package's `__init__.py` is the package itself.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mlx_engine", "app", "metal_kernels")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` depends on the submodule; `from pkg import name` on pkg itself
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        for n in names:
            target = _resolve(n, known)
            if target and target != mod:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
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
    for v in g:
        if v not in index:
            visit(v)
    return out


LAYERS = [  # top to bottom: a module may import its own floor's package or any floor below
    ("commands", ("app", "mlx_engine.__main__", "mlx_engine.cli", "mlx_engine.convert", "mlx_engine.bench",
                  "mlx_engine.serve", "mlx_engine.train")),
    ("set-up", ("mlx_engine.prepare",)),  # the model and drafter the commands load, their shared flags
    ("engine", ("mlx_engine.core", "mlx_engine")),
    ("grammar", ("mlx_engine.grammar",)),
    ("drafters", ("mlx_engine.drafters",)),
    ("target", ("mlx_engine.target_model",)),
    ("kernels / models", ("mlx_engine.kernels", "mlx_engine.models", "mlx_engine.sampling", "metal_kernels")),
    ("base", ("mlx_engine._platform", "mlx_engine.text", "mlx_engine.args", "mlx_engine.host")),
]


def layer_of(mod: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows from a lower layer to a higher one."""
    out = []
    for a, targets in g.items():
        ra = layer_of(a)
        for b in targets:
            rb = layer_of(b)
            if ra is not None and rb is not None and rb < ra:
                out.append((a, b))
    return sorted(out)


def long_modules(limit: int) -> list[tuple[str, int]]:
    out = []
    for m, p in modules().items():
        n = sum(1 for _ in p.open(encoding="utf-8"))
        if n > limit and m.startswith(("mlx_engine", "app")):
            out.append((m, n))
    return sorted(out, key=lambda t: -t[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dot", action="store_true", help="print the package-level graph in Graphviz format")
    ap.add_argument("--limit", type=int, default=400, help="report modules longer than this many lines")
    args = ap.parse_args(argv)
    g = graph()
    if args.dot:
        pk = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
        edges = {(pk(a), pk(b)) for a, ts in g.items() for b in ts if pk(a) != pk(b)}
        print("digraph imports {")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    print(f"{len(g)} modules, {sum(len(t) for t in g.values())} import arrows")
    cyc = cycles(g)
    print(f"cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    up = upward(g)
    print(f"arrows against the layers: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    longs = long_modules(args.limit)
    print(f"modules over {args.limit} lines: {len(longs)}")
    for m, n in longs:
        print(f"  {m}: {n}")
    return 1 if cyc else 0


if __name__ == "__main__":
    raise SystemExit(main())
