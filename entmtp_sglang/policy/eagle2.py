"""EAGLE-2 style dynamic trees: draft a wide tree, verify only the nodes with the best cumulative draft
confidence (Li et al., 2024). `Eagle2Policy` chooses a `DynamicTree`; the reference engine drafts its wide
tree and prunes it with `prune_by_confidence` (also how grammar-forbidden and staged-away branches go)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tree import Tree
from .chooser import StepView


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 style: draft the `wide` tree, then verify only the `keep` nodes (root included) with the
    highest cumulative draft log-probability (a prefix-closed subtree)."""

    wide: Tree
    keep: int

    @property
    def name(self) -> str:
        return f"dynamic:{self.wide.num_nodes}->{self.keep}"

    @property
    def max_depth(self) -> int:
        return self.wide.max_depth

    def check_depth(self, max_depth: int, what: str) -> None:
        self.wide.check_depth(max_depth, what)


class Eagle2Policy:
    """EAGLE-2 style: draft a wide tree, keep the `keep` nodes with the best cumulative draft
    confidence (the engine prunes after drafting, before verification)."""

    def __init__(self, wide: Tree, keep: int):
        self.tree = DynamicTree(wide, keep)
        self.name = f"eagle2[{wide.num_nodes}->{keep}]"

    def __call__(self, view: StepView):
        return self.tree


def prune_by_confidence(tree: Tree, logprobs: list[float], keep: int) -> list[int]:
    """Node indices (sorted) of the `keep` nodes with the best cumulative log-prob; always the root."""
    cum = [0.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        cum[i] = cum[tree.parents[i]] + logprobs[i]
    order = sorted((i for i in range(1, tree.num_nodes) if cum[i] != float("-inf")), key=lambda i: (-cum[i], i))
    kept = set(order[: max(0, keep - 1)])
    # enforce prefix closure and contiguous sibling ranks against ties
    for i in sorted(kept):
        j = i
        while j > 0 and tree.parents[j] not in kept and tree.parents[j] != 0:
            kept.add(tree.parents[j])
            j = tree.parents[j]
    for kids in tree.children:
        chosen = [c for c in kids if c in kept]
        if chosen:
            kept.update(kids[: kids.index(chosen[-1]) + 1])
    return [0] + sorted(kept)


def subtree(tree: Tree, nodes: list[int]) -> Tree:
    index = {n: i for i, n in enumerate(nodes)}
    return Tree(tuple(-1 if n == 0 else index[tree.parents[n]] for n in nodes), name=f"dyn:n{len(nodes)}")
