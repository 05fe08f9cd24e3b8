"""No import cycles between the modules of p2pk3.

The graph has one edge per module-level import (`import p2pk3.x`, `from p2pk3.x import y`, relative
imports; also those under `if TYPE_CHECKING:` — a type-only cycle is still a design cycle). Imports
inside functions are NOT edges: they are the allowed way to load something heavy lazily (torch,
huggingface_hub, a front end) or to reach a higher layer at call time. `from p2pk3.pkg import name`
is an edge to `p2pk3.pkg.name` when that is a module, else to the package `p2pk3.pkg` (its
__init__); packages themselves are modules of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import p2pk3

ROOT = Path(p2pk3.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _top_level_imports(tree: ast.Module):
    """Import nodes executed when the module is imported: the module body and the bodies of
    if / try / with blocks at module level (not functions, not classes' methods)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                stack.extend(getattr(node, field, []) or [])
            for h in getattr(node, "handlers", []) or []:
                stack.extend(h.body)
        elif isinstance(node, ast.ClassDef):  # a class body runs at import
            stack.extend(n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
                names: list[str] = []
            else:
                if node.level:
                    base = package.split(".")
                    if node.level > 1:
                        base = base[: -(node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target]
                names = [a.name for a in node.names]
            for t in targets:
                if not (t == "p2pk3" or t.startswith("p2pk3.")):
                    continue
                subs = [f"{t}.{n}" for n in names if f"{t}.{n}" in mods]
                for dst in subs or ([t] if t in mods else []):
                    if dst != mod:
                        graph[mod].add(dst)
                if names and len(subs) < len(names) and t in mods and t != mod:
                    graph[mod].add(t)  # names taken from the package itself (its __init__)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_imports():
    g = import_graph()
    ring = g["p2pk3.transport.messages.ring"]
    assert "p2pk3.transport.codec" in ring  # from ..codec import ...
    assert "p2pk3.transport.messages.fields" in ring  # from .fields import ...
    assert "p2pk3.params" in ring  # from p2pk3.params import ...
    assert "p2pk3.transport.messages.ring" in g["p2pk3.transport.messages"]  # a package's __init__ importing
    assert "p2pk3.node.daemon" not in g["p2pk3.node.failover"]  # TYPE_CHECKING imports count; none left here


def test_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, (
        "import cycles between p2pk3 modules (move the shared code down a layer, or import "
        "lazily inside the function that needs it):\n" + "\n".join(" <-> ".join(c) for c in found)
    )
