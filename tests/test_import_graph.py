"""The import graph of megatron_qrl has no cycle (trace/'s own aside): each layer imports only layers below it.

The graph is read with ast, nothing is imported: an edge for every `import` / `from ... import` anywhere in a
module (function-local imports included: a lazy import is still a dependency). `from . import x` is an edge to
the package itself (its __init__) as well as to x, which is why sibling modules import each other by name
(`from .cpu import install`), not through their package.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_qrl"

# Cycles other #29 branches are removing; the lead deletes an entry when its branch merges. A cycle is tolerated
# only inside one entry (a smaller cycle of the same modules included).
BEING_FIXED = {
}
OWN_CYCLES_ALLOWED = ("megatron_qrl.trace",)   # TRACE's cache/builder/serialize may keep theirs


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py below root/package (a package is named by its __init__)."""
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = path
    return mods


def _imported(node: ast.AST, base: str) -> list[str]:
    """The dotted names one import statement refers to (relative imports resolved against `base`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = base.split(".")
        module = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name that is no module counts as its nearest module)."""
    mods = module_names(root, package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, base):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _tolerated(component: set[str]) -> bool:
    own = any(all(m == p or m.startswith(p + ".") for m in component) for p in OWN_CYCLES_ALLOWED)
    return own or any(component <= allowed for allowed in BEING_FIXED.values())


def test_megatron_qrl_has_no_import_cycle():
    bad = [sorted(c) for c in cycles(import_graph(ROOT)) if not _tolerated(c)]
    assert not bad, ("import cycles in megatron_qrl (import the lower module from the higher one only; a sibling "
                     f"by its own name, not through the package): {bad}")


def test_each_tolerated_cycle_still_exists():
    """An entry of BEING_FIXED whose cycle is gone is stale: delete it so the cycle cannot come back unseen."""
    present = cycles(import_graph(ROOT))
    stale = [name for name, allowed in BEING_FIXED.items() if not any(c <= allowed for c in present)]
    assert not stale, f"these cycles are fixed: remove {stale} from BEING_FIXED in tests/test_import_graph.py"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_sees_package_relative_and_function_local_imports(tmp_path):
    """`from . import b` reaches the package's __init__ (which imports a): a cycle, found though the import in
    b is inside a function; the same code importing its sibling by name has none."""
    _write(tmp_path, {"pkg/__init__.py": "from .a import f\n",
                      "pkg/a.py": "def f():\n    from . import b\n    return b\n",
                      "pkg/b.py": "X = 1\n"})
    assert cycles(import_graph(tmp_path, "pkg")) == [{"pkg", "pkg.a"}]
    _write(tmp_path, {"pkg/a.py": "def f():\n    from .b import X\n    return X\n"})
    assert cycles(import_graph(tmp_path, "pkg")) == []
    assert import_graph(tmp_path, "pkg")["pkg.a"] == {"pkg.b"}
