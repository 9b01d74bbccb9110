"""The package's import graph, read with `ast` (nothing is imported): the policy sits below both engines, and no
import loop anywhere, lazy (function-level) imports included: neither between modules nor between the package's
subpackages (`policy/`, `sglang/`, `calibrate/`, `costs/`, ...; a top-level module such as `cli.py` its own node).

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


def package_of(module: str) -> str:
    """The node a module counts as in the package graph: its subpackage of `entmtp_sglang` (`entmtp_sglang.policy`
    for `entmtp_sglang.policy.controller`), or itself for a top-level module (`entmtp_sglang.cli`)."""
    return ".".join(module.split(".")[:2])


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to subpackages: package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for src, targets in edges.items():
        out.setdefault(package_of(src), set()).update(package_of(t) for t in targets)
        for t in targets:
            out.setdefault(package_of(t), set())
    for pkg, targets in out.items():
        targets.discard(pkg)
    return out


def shortest_loop(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest loop through `component[0]` inside a strongly connected component, first node repeated last."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        reached = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    reached.append(w)
        frontier = reached
    raise ValueError(f"{component} is not strongly connected")


def package_loops(edges: dict[str, set[str]]) -> list[str]:
    """Each import loop between packages, named: the packages around one shortest loop, and for each step the module
    imports that make it."""
    packages = package_edges(edges)
    named = []
    for component in cycles(packages):
        loop = shortest_loop(packages, component)
        steps = []
        for a, b in zip(loop, loop[1:]):
            why = sorted(f"{m} -> {t}" for m, ts in edges.items() if package_of(m) == a
                         for t in ts if package_of(t) == b)
            steps.append(f"  {a} -> {b}: {', '.join(why)}")
        named.append("\n".join([" -> ".join(loop) + f" (the packages in loops: {', '.join(component)})", *steps]))
    return named


def engine_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of the reference engine from the policy or the SGLang adapter."""
    below = ("entmtp_sglang.policy", "entmtp_sglang.sglang")
    return sorted((m, t) for m, ts in edges.items() if m.startswith(below) for t in ts
                  if t.startswith("entmtp_sglang.engine"))


def test_the_policy_and_the_sglang_adapter_do_not_import_the_engine():
    assert engine_edges(import_edges(modules())) == []


def test_no_import_loop_lazy_imports_included():
    assert cycles(import_edges(modules(), lazy=True)) == []


def test_no_import_loop_between_packages_lazy_imports_included():
    loops = package_loops(import_edges(modules(), lazy=True))
    assert not loops, "import loops between packages:\n" + "\n".join(loops)


def test_a_loop_between_packages_without_a_loop_between_modules_is_named():
    """policy/ -> calibrate/ -> sglang/ -> policy/ through three different modules: no module loop, a package loop
    (the shape of the loops before the runtime cost models moved to costs/); cli.py and tasks.py are nodes of their
    own, so cli -> calibrate -> tasks is no loop."""
    edges = {"entmtp_sglang.policy.controller": {"entmtp_sglang.calibrate.ragged_cost"},
             "entmtp_sglang.calibrate.ragged_cost": {"entmtp_sglang.tree.treeset"},
             "entmtp_sglang.calibrate.through_sglang": {"entmtp_sglang.sglang.config", "entmtp_sglang.tasks"},
             "entmtp_sglang.sglang.config": {"entmtp_sglang.policy.registry"},
             "entmtp_sglang.policy.registry": set(), "entmtp_sglang.tree.treeset": set(),
             "entmtp_sglang.cli": {"entmtp_sglang.calibrate.through_sglang"}, "entmtp_sglang.tasks": set()}
    assert cycles(edges) == []
    (loop,) = package_loops(edges)
    assert loop.splitlines() == [
        "entmtp_sglang.calibrate -> entmtp_sglang.sglang -> entmtp_sglang.policy -> entmtp_sglang.calibrate"
        " (the packages in loops: entmtp_sglang.calibrate, entmtp_sglang.policy, entmtp_sglang.sglang)",
        "  entmtp_sglang.calibrate -> entmtp_sglang.sglang: entmtp_sglang.calibrate.through_sglang -> "
        "entmtp_sglang.sglang.config",
        "  entmtp_sglang.sglang -> entmtp_sglang.policy: entmtp_sglang.sglang.config -> entmtp_sglang.policy.registry",
        "  entmtp_sglang.policy -> entmtp_sglang.calibrate: entmtp_sglang.policy.controller -> "
        "entmtp_sglang.calibrate.ragged_cost"]
    del edges["entmtp_sglang.policy.controller"]
    assert package_loops(edges) == []


def test_the_runtime_cost_models_import_nothing_above_them():
    above = tuple(f"entmtp_sglang.{p}" for p in ("policy", "sglang", "engine", "calibrate", "bench"))
    edges = import_edges(modules(), lazy=True)
    assert sorted((m, t) for m, ts in edges.items() if package_of(m) == "entmtp_sglang.costs"
                  for t in ts if package_of(t) in above) == []


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
    print("loops between packages:", "\n".join(package_loops(graph)) or "none")
