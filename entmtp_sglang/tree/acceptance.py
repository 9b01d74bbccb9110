"""Per-node acceptance predictor: how likely the target is to accept each node of a tree, from the drafter's
own probabilities, calibrated on recorded decoding.

A node at depth d is accepted when its parent is and the target's token at depth d is the node's token. The
predictor estimates, per depth, the conditional probability

    q_d(p) = P(target token at depth d == the drafted candidate | parent accepted, candidate's draft prob p)

as a monotone (isotonic) map fitted on calibration records (`calibrate.PositionRecord.draft_probs`: the top-k
draft probabilities at each depth along the true continuation). A tree's expected accepted length is then
OPT-Tree's objective, the sum over its nodes of the product of q along the node's path:

    E[accepted | tree] = sum_{n != root} prod_{a in path(n)} q_{depth(a)}(p_a)

Before any drafting only the depth-1 distribution is known (the drafter's root logits). For deeper nodes the
predictor then uses `deep`: per depth and rank, P(accepted | parent accepted) within a bin of the depth-1 top
probability (predictable text stays predictable a few tokens on). `node_probs(tree, probs)` uses every depth it
is given and `deep` for the rest.

Pure functions and frozen data; a tree set may carry one (`TreeSet.predictor`), and the policy
(`policy/`) scores its trees with it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from .topology import Tree

ROOT_BINS = 4          # bins of the depth-1 top-1 probability for the deeper-node table
PRIOR_WEIGHT = 4.0     # pseudo-counts pulling a sparse (depth, rank, bin) cell toward its depth's mean
PARENT_WITHIN = None   # fit depth d on positions whose true path stayed within this many candidates per depth


def isotonic(xs: Sequence[float], ys: Sequence[float],
             max_knots: int = 64) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Increasing least-squares fit of ys on xs (pool-adjacent-violators). Returns knots (x, y): the fitted
    value is y[i] for x in [x[i], x[i+1]); at most `max_knots` knots (equal-count blocks merged first)."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"isotonic needs equal, non-empty xs and ys (got {len(xs)} and {len(ys)})")
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    # pre-pool into at most 4 * max_knots equal-count groups so the fit stays small and fast
    groups = max(1, min(len(order), 4 * max_knots))
    blocks: list[list[float]] = []  # [x_start, sum_y, weight]
    for g in range(groups):
        chunk = order[g * len(order) // groups:(g + 1) * len(order) // groups]
        if chunk:
            blocks.append([xs[chunk[0]], sum(ys[i] for i in chunk), float(len(chunk))])
    stack: list[list[float]] = []
    for b in blocks:
        stack.append(b)
        while len(stack) > 1 and stack[-2][1] / stack[-2][2] >= stack[-1][1] / stack[-1][2]:
            top = stack.pop()
            stack[-1][1] += top[1]
            stack[-1][2] += top[2]
    while len(stack) > max_knots:  # merge the lightest adjacent pair (keeps monotonicity)
        i = min(range(len(stack) - 1), key=lambda j: stack[j][2] + stack[j + 1][2])
        a, b = stack[i], stack.pop(i + 1)
        a[1] += b[1]
        a[2] += b[2]
    return tuple(b[0] for b in stack), tuple(b[1] / b[2] for b in stack)


@dataclass(frozen=True)
class IsotonicMap:
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self):
        if not self.xs or len(self.xs) != len(self.ys):
            raise ValueError("an isotonic map needs as many knots as values, at least one")
        if any(b < a for a, b in zip(self.xs, self.xs[1:])) or any(b < a for a, b in zip(self.ys, self.ys[1:])):
            raise ValueError("an isotonic map's knots and values must be non-decreasing")
        if not all(0.0 <= y <= 1.0 for y in self.ys):
            raise ValueError("an isotonic map's values are probabilities in [0, 1]")

    def __call__(self, x: float) -> float:
        return self.ys[max(0, bisect.bisect_right(self.xs, x) - 1)]

    def to_json(self) -> dict:
        return {"x": [round(v, 5) for v in self.xs], "y": [round(v, 5) for v in self.ys]}

    @classmethod
    def from_json(cls, d: dict) -> "IsotonicMap":
        return cls(tuple(float(v) for v in d["x"]), tuple(float(v) for v in d["y"]))


@dataclass(frozen=True)
class AcceptancePredictor:
    """q per depth (`by_depth[d-1]`, a map of the candidate's draft probability) and the deeper-node table
    `deep[d-1][bin][rank]` (bins of the depth-1 top probability at `root_edges`)."""

    by_depth: tuple[IsotonicMap, ...]
    deep: tuple[tuple[tuple[float, ...], ...], ...]
    root_edges: tuple[float, ...]
    positions: int = 0  # calibration positions it was fitted on

    def __post_init__(self):
        if not self.by_depth or len(self.deep) != len(self.by_depth):
            raise ValueError("the predictor needs one map and one table per depth, at least one depth")
        bins = len(self.root_edges) + 1
        for d, table in enumerate(self.deep):
            if len(table) != bins or any(not row or not all(0.0 <= p <= 1.0 for p in row) for row in table):
                raise ValueError(f"depth {d + 1}: the table needs {bins} bins of probabilities in [0, 1]")

    @property
    def max_depth(self) -> int:
        return len(self.by_depth)

    @property
    def max_rank(self) -> int:
        return len(self.deep[0][0])

    def root_bin(self, top1: float) -> int:
        return bisect.bisect_right(self.root_edges, top1)

    def node_q(self, depth: int, rank: int, probs: Sequence[Sequence[float]]) -> float:
        """P(accepted | parent accepted) of the rank-`rank` node at `depth`, given the top-k draft
        probabilities of the first len(probs) depths (probs[0] is the depth-1 distribution, required)."""
        if depth > self.max_depth or rank >= self.max_rank:
            return 0.0
        if depth <= len(probs) and rank < len(probs[depth - 1]):
            return self.by_depth[depth - 1](probs[depth - 1][rank])
        return self.deep[depth - 1][self.root_bin(probs[0][0])][rank]

    def node_probs(self, tree: Tree, probs: Sequence[Sequence[float]],
                   drafted: Sequence[float | None] | None = None) -> list[float]:
        """P(node accepted) for every node of `tree` (the root: 1).

        `drafted[n]`, where given and not None, is node n's own draft probability under its parent's
        distribution, known once the drafter has run on the parent (a staged decision); it replaces the
        estimate from `probs` for that node."""
        if not probs or not probs[0]:
            raise ValueError("node_probs needs at least the depth-1 draft probabilities")
        if drafted is not None and len(drafted) != tree.num_nodes:
            raise ValueError(f"drafted has {len(drafted)} entries for a tree of {tree.num_nodes} nodes")
        out = [1.0] * tree.num_nodes
        depth = tree.depths
        for n in range(1, tree.num_nodes):
            d = depth[n]
            known = drafted[n] if drafted is not None else None
            if known is not None and d <= self.max_depth:
                q = self.by_depth[d - 1](known)
            else:
                q = self.node_q(d, tree.sibling_rank[n], probs)
            out[n] = out[tree.parents[n]] * q
        return out

    def expected_accepted(self, tree: Tree, probs: Sequence[Sequence[float]],
                          drafted: Sequence[float | None] | None = None) -> float:
        """E[accepted drafts] of one step with `tree` (OPT-Tree's objective)."""
        return sum(self.node_probs(tree, probs, drafted)) - 1.0

    def to_json(self) -> dict:
        return {"by_depth": [m.to_json() for m in self.by_depth],
                "deep": [[[round(p, 5) for p in row] for row in table] for table in self.deep],
                "root_edges": [round(e, 5) for e in self.root_edges], "positions": self.positions}

    @classmethod
    def from_json(cls, d: dict) -> "AcceptancePredictor":
        try:
            return cls(tuple(IsotonicMap.from_json(m) for m in d["by_depth"]),
                       tuple(tuple(tuple(float(p) for p in row) for row in table) for table in d["deep"]),
                       tuple(float(e) for e in d["root_edges"]), int(d.get("positions", 0)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed acceptance predictor: {e}") from None


def fit_predictor(records: Sequence, max_depth: int | None = None, max_rank: int | None = None,
                  root_bins: int = ROOT_BINS, parent_within: int | None = PARENT_WITHIN) -> AcceptancePredictor:
    """Fit on calibration records carrying `draft_probs` (teacher-forced: the rank-r candidate at depth d is
    accepted, given its parent, exactly when the recorded rank at depth d is r).

    `parent_within`: depth d's maps are fitted only on positions whose true path to depth d - 1 stayed within
    the drafter's top `parent_within` candidates at every depth, i.e. where the parent could have been
    drafted and accepted; acceptance is correlated along a path, so this is the condition that matters
    (None: every position)."""
    recs = [r for r in records if r.draft_probs]
    if not recs:
        raise ValueError("no calibration record carries draft probabilities; record them again with "
                         "`entmtp calibrate ... --records-only`")
    depth = max(len(r.draft_probs) for r in recs)
    depth = depth if max_depth is None else min(depth, max_depth)
    rank = min(len(row) for r in recs for row in r.draft_probs)
    rank = rank if max_rank is None else min(rank, max_rank)

    def reached(r, d):  # depth d was observed (records from served steps: rank -1 where a step cannot
        # tell), and the true path to depth d - 1 was draftable
        if len(r.draft_probs) <= d or r.ranks[d] < 0:
            return False
        return parent_within is None or all(x < parent_within for x in r.ranks[:d])

    by_depth = []
    for d in range(depth):
        xs, ys = [], []
        for r in recs:
            if not reached(r, d):
                continue
            for k in range(rank):
                xs.append(r.draft_probs[d][k])
                ys.append(1.0 if r.ranks[d] == k else 0.0)
        by_depth.append(IsotonicMap(*isotonic(xs, ys)) if xs else IsotonicMap((0.0,), (0.0,)))
    tops = sorted(r.draft_probs[0][0] for r in recs)
    edges = tuple(sorted({tops[min(len(tops) - 1, len(tops) * q // root_bins)] for q in range(1, root_bins)}))
    deep = []
    for d in range(depth):
        hits = [[0.0] * rank for _ in range(len(edges) + 1)]
        counts = [0] * (len(edges) + 1)
        for r in recs:
            if not reached(r, d):
                continue
            b = bisect.bisect_right(edges, r.draft_probs[0][0])
            counts[b] += 1
            if r.ranks[d] < rank:
                hits[b][r.ranks[d]] += 1
        total = max(1, sum(counts))
        mean = [sum(h[k] for h in hits) / total for k in range(rank)]
        deep.append(tuple(tuple((h[k] + PRIOR_WEIGHT * mean[k]) / (c + PRIOR_WEIGHT) for k in range(rank))
                          for h, c in zip(hits, counts)))
    return AcceptancePredictor(tuple(by_depth), tuple(deep), edges, len(recs))
