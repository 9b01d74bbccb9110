"""Tree construction from calibration data, and the Pareto frontier.

A calibration record for one decoding position is its *rank vector*: for depth k = 1..K, the rank of
the true next token x_{n+k} among the drafter's candidates at depth k, drafting along the true path
(rank >= max_rank means not among the candidates). Under greedy verification a tree accepts exactly
the deepest node whose path of sibling ranks is a prefix of the rank vector, so the expected accepted
length of any tree on any set of records is an exact empirical average, with no independence
assumption.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Sequence

from .topology import Tree, from_medusa_choices


def accepted_on(tree: Tree, ranks: Sequence[int]) -> int:
    """Drafted tokens the tree accepts at a position with this rank vector (greedy verification)."""
    node, depth = 0, 0
    while depth < len(ranks):
        want = ranks[depth]
        nxt = next((c for c in tree.children[node] if tree.sibling_rank[c] == want), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def expected_accepted(tree: Tree, records: Sequence[Sequence[int]]) -> float:
    if not records:
        return 0.0
    return sum(accepted_on(tree, r) for r in records) / len(records)


def prefix_counts(records: Sequence[Sequence[int]], max_rank: int) -> Counter:
    """How many records start with each rank path (paths of ranks < max_rank only)."""
    counts: Counter = Counter()
    for r in records:
        path: tuple[int, ...] = ()
        for rank in r:
            if rank >= max_rank:
                break
            path = path + (int(rank),)
            counts[path] += 1
    return counts


def greedy_tree(records: Sequence[Sequence[int]], num_nodes: int, max_depth: int, max_rank: int,
                name: str = "") -> Tree:
    """The tree of `num_nodes` nodes (root included) maximising the empirical expected accepted length.

    A node's value is the fraction of records whose rank vector starts with its path; values never
    increase from a parent to its child, so taking the best frontier node each time (a child of a
    chosen node whose lower-ranked siblings are chosen) is optimal for prefix-closed trees when
    sibling values also decrease with rank, as they do for ranked drafts (Sequoia's argument).
    """
    counts = prefix_counts(records, max_rank)
    chosen: list[tuple[int, ...]] = []
    heap = [(-counts.get((0,), 0), (0,))]
    while heap and len(chosen) < num_nodes - 1:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if path[-1] + 1 < max_rank:
            sib = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-counts.get(sib, 0), sib))
        if len(path) < max_depth:
            child = path + (0,)
            heapq.heappush(heap, (-counts.get(child, 0), child))
    return from_medusa_choices(chosen, name=name or f"greedy:n{len(chosen) + 1}")


def independent_tree(head_accuracy: Sequence[Sequence[float]], num_nodes: int, name: str = "") -> Tree:
    """Medusa/Hydra-style tree from per-head top-k accuracies, assuming heads are independent.

    head_accuracy[k][r] = P(rank of the true token at depth k+1 == r). A node's value is the product
    along its path; the best num_nodes - 1 nodes are kept (Medusa's `generate_medusa_choices`).
    """
    depth_max = len(head_accuracy)
    heap = [(-head_accuracy[0][0], (0,))]
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes - 1:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        value = -neg
        d = len(path) - 1
        r = path[-1]
        if r + 1 < len(head_accuracy[d]):
            prev = value / max(head_accuracy[d][r], 1e-12)
            heapq.heappush(heap, (-prev * head_accuracy[d][r + 1], path[:-1] + (r + 1,)))
        if d + 1 < depth_max:
            heapq.heappush(heap, (-value * head_accuracy[d + 1][0], path + (0,)))
    return from_medusa_choices(chosen, name=name or f"independent:n{len(chosen) + 1}")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (cost, value) that no other point dominates (lower-or-equal cost and
    higher-or-equal value, one strictly)."""
    keep = []
    for i, (c, v) in enumerate(points):
        dominated = any((c2 <= c and v2 >= v) and (c2 < c or v2 > v) for j, (c2, v2) in enumerate(points) if j != i)
        if not dominated:
            keep.append(i)
    return keep
