"""A generic tree set for a model no set was calibrated for (ENTMTP's zero-setup start).

Chains up to the drafter's depth, and, where the drafter offers more than one candidate per position, trees
two or three wide at the root with a chain under the top candidate. Its acceptance predictor assumes the
drafter is calibrated (a candidate drafted with probability p is accepted with probability p) and its costs
are a prior (each node and level adds to a plain step); both are replaced by measurements as the server
runs (`costs/online.py`).
"""

from __future__ import annotations

from .acceptance import AcceptancePredictor, IsotonicMap
from .topology import Tree
from .treeset import TreeEntry, TreeSet

GENERIC_TASK = "generic"
PRIOR_BASE, PRIOR_PER_NODE, PRIOR_PER_LEVEL = 1.0, 0.08, 0.12   # relative step cost before any is measured
PRIOR_DEEP = (0.5, 0.15, 0.06, 0.03, 0.02, 0.01)                  # P(accept | parent) of a deeper node, by rank
TYPICAL_ROOT = (0.5, 0.2, 0.1, 0.05, 0.03, 0.02)                # a depth-1 draft distribution, for the table


def wide_root(width: int, depth: int) -> Tree:
    """`width` candidates at depth 1 and a chain of top candidates under the first, to `depth`."""
    parents = [-1] + [0] * width
    below = 1
    for _ in range(depth - 1):
        parents.append(below)
        below = len(parents) - 1
    return Tree(tuple(parents), name=f"wide{width}:{depth}")


def generic_trees(max_depth: int, topk: int) -> list[Tree]:
    if not 1 <= max_depth <= 8 or not 1 <= topk <= 8:
        raise ValueError(f"a generic tree set needs depth in 1..8 and topk in 1..8, got {max_depth}, {topk}")
    trees = [Tree.chain(d) for d in range(max_depth + 1)]
    for width in range(2, min(topk, 3) + 1):
        trees += [wide_root(width, d) for d in range(2, max_depth + 1)]
    return trees


def prior_predictor(max_depth: int) -> AcceptancePredictor:
    knots = tuple(i / 10 for i in range(10))
    calibrated = IsotonicMap(knots, tuple(x + 0.05 for x in knots))
    return AcceptancePredictor(tuple(calibrated for _ in range(max_depth)),
                               tuple((PRIOR_DEEP,) for _ in range(max_depth)), (), 0)


def prior_cost(tree: Tree) -> float:
    return PRIOR_BASE + PRIOR_PER_NODE * (tree.num_nodes - 1) + PRIOR_PER_LEVEL * tree.max_depth


def generic_tree_set(model: str, max_depth: int = 4, topk: int = 2, drafter: str = "eagle") -> TreeSet:
    trees = generic_trees(max_depth, topk)
    pred = prior_predictor(max_depth)
    entries = tuple(TreeEntry(t, (min(pred.expected_accepted(t, [TYPICAL_ROOT]), t.max_depth),),
                              {1: prior_cost(t)}) for t in trees)
    return TreeSet(model=model, drafter=drafter, task=GENERIC_TASK, signal="draft_margin", bin_edges=(),
                   trees=entries, hardware="uncalibrated (costs: prior, then measured online)",
                   provenance={"generic": True, "max_depth": max_depth, "topk": topk},
                   predictor=pred.to_json())
