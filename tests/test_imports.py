"""The package's import graph, read with `ast` (nothing is imported): the policy sits below both engines, and no
import loop anywhere, lazy (function-level) imports included.

    python tests/test_imports.py [-v]     # prints the edges from policy/ and sglang/ to engine/, and the cycles
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# where each installed package's files sit in the checkout (pyproject's package-dir)
PACKAGE_DIRS = {"entmtp_sglang": REPO / "entmtp_sglang", "entmtp_sglang.kernels": REPO / "kernels",
                "entmtp_sglang.trees": REPO / "trees"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            parts = parts[:-1] if is_pkg else parts
            out[".".join([pkg, *parts])] = (f, is_pkg)
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def import_edges(mods: dict[str, tuple[Path, bool]], lazy: bool = True) -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level; with `lazy`, inside functions too).
    Imports under `if TYPE_CHECKING:` do not run and are left out."""
    edges: dict[str, set[str]] = {m: set() for m in mods}

    def add(src: str, target: str) -> None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        if target and target != src:
            edges[src].add(target)

    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        stack = list(ast.parse(path.read_text()).body)
        while stack:
            node = stack.pop()
            if _type_checking(node):
                continue
            if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(name, alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                for alias in node.names:
                    add(name, f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
            else:
                stack.extend(ast.iter_child_nodes(node))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def engine_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of the reference engine from the policy or the SGLang adapter."""
    below = ("entmtp_sglang.policy", "entmtp_sglang.sglang")
    return sorted((m, t) for m, ts in edges.items() if m.startswith(below) for t in ts
                  if t.startswith("entmtp_sglang.engine"))


def test_the_policy_and_the_sglang_adapter_do_not_import_the_engine():
    assert engine_edges(import_edges(modules())) == []


def test_no_import_loop_lazy_imports_included():
    assert cycles(import_edges(modules(), lazy=True)) == []


def test_the_wheel_has_no_test_only_modules_and_no_top_level_kernels():
    names = modules()
    assert "entmtp_sglang.testing" not in names and "entmtp_sglang.sglang.tiny_checkpoints" not in names
    assert not (REPO / "kernels.py").exists() and "kernels" not in PACKAGE_DIRS


if __name__ == "__main__":
    graph = import_edges(modules())
    if "-v" in sys.argv:
        for src in sorted(graph):
            for dst in sorted(graph[src]):
                print(f"{src} -> {dst}")
    print("edges from policy/ or sglang/ to engine/:", engine_edges(graph) or "none")
    print("cycles (lazy imports included):", cycles(graph) or "none")
