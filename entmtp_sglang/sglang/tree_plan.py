"""How one EntMTP tree (a parent array) is drafted and verified with SGLang's EAGLE buffers.

Pure functions over `entmtp_sglang.tree.Tree`; no SGLang import. SGLang's EAGLE draft runs
`num_steps - 1` draft forwards with `topk` rows per request and encodes the tree it picked as candidate
indices (`parent_list`, `top_scores_index`). A fixed tree maps onto the same buffers:

* draft step i (0-based) runs the tree's nodes at depth i + 1 that have children ("expanded" nodes),
  one per row (`columns[i]`, padded to `topk` rows);
* node n at depth 1 with sibling rank r is candidate r (the root's draft top-k); node n at depth
  d >= 2 whose parent sits in row c of step d - 2, with rank r, is candidate
  `topk + (d - 2) * topk**2 + c * topk + r`, exactly SGLang's numbering;
* `parent_list[1 + i * topk + c]` is the candidate index of the node in row c of step i (-1: padding);
  `parent_list[0] = -1`;
* the draft K/V of the node in row c of step i lives in draft slot `c * num_steps + i`, and the row
  attends to the slots of its ancestors and itself (`ancestor_offsets`).

Siblings are ordered by rank: a node's k-th child is the drafter's k-th most likely token there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tree import Tree


class TreeShapeError(ValueError):
    pass


@dataclass(frozen=True)
class TreePlan:
    tree: Tree
    topk: int
    num_steps: int
    depth: tuple[int, ...]                 # per node
    rank: tuple[int, ...]                  # sibling rank per node (root: 0)
    columns: tuple[tuple[int, ...], ...]   # per draft step: expanded nodes at depth step + 1
    candidate: tuple[int, ...]             # SGLang candidate index per node (root: -1)
    parent_list: tuple[int, ...]           # length 1 + (num_steps - 1) * topk
    selected: tuple[int, ...]              # sorted candidate indices of the non-root nodes
    selected_nodes: tuple[int, ...]        # the node holding each selected candidate
    ancestor_offsets: tuple[tuple[tuple[int, ...], ...], ...]  # [step][row] -> draft slot offsets

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def draft_steps(self) -> int:
        """Draft forwards this tree needs (its depth minus one)."""
        return len([c for c in self.columns if c])


def required_topk(tree: Tree) -> int:
    """The smallest SGLang `speculative_eagle_topk` that can hold this tree."""
    children: dict[int, int] = {}
    expanded_per_depth: dict[int, int] = {}
    depth = [0] * tree.num_nodes
    for i, p in enumerate(tree.parents):
        if p < 0:
            continue
        depth[i] = depth[p] + 1
        children[p] = children.get(p, 0) + 1
    for n in children:
        if n != 0:
            expanded_per_depth[depth[n]] = expanded_per_depth.get(depth[n], 0) + 1
    return max([1, *children.values(), *expanded_per_depth.values()])


def plan_tree(tree: Tree, topk: int, num_steps: int) -> TreePlan:
    """Lay `tree` out on SGLang's EAGLE buffers of width `topk` and `num_steps` draft steps."""
    n = tree.num_nodes
    parents = tree.parents
    if tree.max_depth > num_steps:
        raise TreeShapeError(f"tree {tree.name} has depth {tree.max_depth} > num_steps {num_steps}")
    if required_topk(tree) > topk:
        raise TreeShapeError(f"tree {tree.name} needs topk >= {required_topk(tree)}, got {topk}")
    depth = [0] * n
    rank = [0] * n
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        rank[i] = len(kids.setdefault(p, []))
        kids[p].append(i)
    columns = []
    row_of: dict[int, int] = {}
    for step in range(num_steps - 1):
        col = tuple(i for i in range(1, n) if depth[i] == step + 1 and i in kids)
        for c, node in enumerate(col):
            row_of[node] = c
        columns.append(col)
    candidate = [-1] * n
    for i in range(1, n):
        if depth[i] == 1:
            candidate[i] = rank[i]
        else:
            candidate[i] = topk + (depth[i] - 2) * topk * topk + row_of[parents[i]] * topk + rank[i]
    parent_list = [-1] * (1 + (num_steps - 1) * topk)
    for step, col in enumerate(columns):
        for c, node in enumerate(col):
            parent_list[1 + step * topk + c] = candidate[node]
    order = sorted(range(1, n), key=lambda i: candidate[i])
    offsets = []
    for step, col in enumerate(columns):
        rows = []
        for c in range(topk):
            if c < len(col):
                chain, node = [], col[c]
                while node != 0:
                    chain.append(row_of[node] * num_steps + depth[node] - 1)
                    node = parents[node]
                rows.append(tuple(sorted(chain)))
            else:
                rows.append((c * num_steps + step,))
        offsets.append(tuple(rows))
    return TreePlan(tree=tree, topk=topk, num_steps=num_steps, depth=tuple(depth), rank=tuple(rank),
                    columns=tuple(columns), candidate=tuple(candidate), parent_list=tuple(parent_list),
                    selected=tuple(candidate[i] for i in order), selected_nodes=tuple(order),
                    ancestor_offsets=tuple(offsets))
