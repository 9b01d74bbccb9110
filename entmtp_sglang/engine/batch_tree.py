"""Per-request trees padded into batch tensors (each request in a batch may use its own tree)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..kernels import tree_ancestor_mask
from ..tree import Tree, build_buffers


@lru_cache(maxsize=512)
def _buffers(tree: Tree):
    return build_buffers(tree)


@dataclass(frozen=True)
class PaddedTrees:
    """B trees padded to N = max nodes. Padding nodes have parent -1, depth 0 and attend to themselves."""

    trees: tuple[Tree, ...]
    parents: torch.Tensor  # (B, N) int64, -1 for root and padding
    depths: torch.Tensor  # (B, N) int64
    ranks: torch.Tensor  # (B, N) int64 sibling rank
    valid: torch.Tensor  # (B, N) bool
    has_children: torch.Tensor  # (B, N) bool
    ancestors: torch.Tensor  # (B, N, N) bool, ancestor-or-self

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.trees)

    def level(self, depth: int, need_children: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices (B, M) of the nodes at `depth` (only those with children if asked), padded with 0,
        and their validity mask (B, M)."""
        sel = self.valid & (self.depths == depth)
        if need_children:
            sel = sel & self.has_children
        count = int(sel.sum(1).max()) if sel.numel() else 0
        # stable order: the selected nodes first, in index order
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True)[:, :count]
        ok = torch.gather(sel, 1, order)
        return torch.where(ok, order, torch.zeros_like(order)), ok


def pad_trees(trees: list[Tree]) -> PaddedTrees:
    b = len(trees)
    n = max(t.num_nodes for t in trees)
    parents = torch.full((b, n), -1, dtype=torch.int64)
    depths = torch.zeros((b, n), dtype=torch.int64)
    ranks = torch.zeros((b, n), dtype=torch.int64)
    valid = torch.zeros((b, n), dtype=torch.bool)
    has_children = torch.zeros((b, n), dtype=torch.bool)
    for i, t in enumerate(trees):
        buf = _buffers(t)
        k = t.num_nodes
        parents[i, :k] = buf.parents
        depths[i, :k] = buf.positions
        ranks[i, :k] = buf.sibling_rank
        valid[i, :k] = True
        has_children[i, :k] = buf.retrieve_next_token >= 0
    anc, _ = tree_ancestor_mask(parents, valid.sum(1))  # padding nodes see only themselves
    return PaddedTrees(tuple(trees), parents, depths, ranks, valid, has_children, anc)


def tree_attention_mask(prefix_lens: torch.Tensor, trees: PaddedTrees, queries: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Boolean mask (B, 1, Q, S) for tree nodes stored at slots prefix_lens[b] + node.

    A query node may see every committed slot < prefix_lens[b] and its ancestors (and itself) in the
    tree. `queries` (B, Q) selects which nodes are the queries (default: all N nodes).
    """
    b, n = trees.parents.shape
    span = int(prefix_lens.max()) + n
    slots = torch.arange(span).view(1, span)
    prefix = slots < prefix_lens.view(b, 1)  # (B, S)
    anc = trees.ancestors
    if queries is not None:
        anc = torch.gather(anc, 1, queries.unsqueeze(-1).expand(b, queries.shape[1], n))
    q = anc.shape[1]
    rel = slots - prefix_lens.view(b, 1)  # (B, S) node index of each slot, if in the tree window
    in_tree = (rel >= 0) & (rel < n)
    tree_part = torch.gather(anc, 2, rel.clamp(0, n - 1).unsqueeze(1).expand(b, q, span))
    mask = prefix.unsqueeze(1) | (in_tree.unsqueeze(1) & tree_part)
    return mask.unsqueeze(1)
