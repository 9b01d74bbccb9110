"""Calibration from verification outcomes, for a served model: records of verified steps, and online refits.

A verified step of one request tells, along the path the target actually takes through the drafted tree, the
rank of the target's token among the drafter's candidates at each drafted node on that path (greedy: the
target's argmax), and the drafter's top probabilities there. `position_record` turns one step into the same
`PositionRecord` the offline calibration writes (`calibrate/records.py`), with rank -1 where the step cannot tell
(the path left the drafted tree, or reached a node that was not expanded). Those records feed both
`entmtp calibrate --engine sglang` (a tree set from a recording run, `calibrate/through_sglang.py`) and
`OnlineCalibration`, which ENTMTP runs when it starts with a generic set (`tree/generic.py`), or on a calibrated set
with `ENTMTP_ONLINE_CALIBRATION=1`: every `refit_every` steps it refits the per-node acceptance predictor on the
records so far (depths with too few observations keep the set's own predictor, or for the generic set the
prior that the drafter is calibrated) and the step costs on the timed steps (seconds = base + per_node *
nodes + per_level * depth, least squares once three tree shapes are measured, else the set's own costs scaled
to what was measured).
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from ..tree.acceptance import AcceptancePredictor, fit_predictor
from ..tree.generic import TYPICAL_ROOT, prior_cost, prior_predictor
from ..tree.records import PositionRecord
from ..tree.topology import Tree
from ..tree.treeset import TreeEntry, TreeSet, nearest_batch
from .provenance import amended

MIN_KNOWN = 40          # observations of a depth before its fitted map replaces the prior
RECENT = 32             # step times kept per tree shape and batch bucket
ROBUST = 3              # step times of a shape before their median prices it (until then: their minimum)
BUCKETS = (1, 2, 4, 8, 16, 32)    # batch sizes step costs are kept for (nearest on a log scale)


@dataclass(frozen=True)
class StepObservation:
    """One request's verified step. `expanded[node]`: the drafter's top candidates for the node's children
    (token ids and probabilities, descending; node 0: the root's distribution); `target[node]`: the target's
    token after the node."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    expanded: dict
    target: tuple[int, ...]


def position_record(obs: StepObservation, max_depth: int, max_rank: int, prompt: int = 0, pos: int = 0,
                    draft_entropy: float = math.nan, target_entropy: float = math.nan,
                    draft_margin: float = math.nan) -> PositionRecord:
    tree = Tree(obs.parents)
    ranks: list[int] = []
    probs: list[tuple[float, ...]] = []
    node = 0
    while len(ranks) < max_depth and node in obs.expanded:
        ids, ps = obs.expanded[node]
        want = obs.target[node]
        ids = list(ids)[:max_rank]
        ranks.append(ids.index(want) if want in ids else max_rank)
        probs.append(tuple(round(float(p), 3) for p in list(ps)[:max_rank]))
        node = next((c for c in tree.children[node] if obs.tokens[c] == want), None)
        if node is None:
            break
    ranks += [-1] * (max_depth - len(ranks))
    return PositionRecord(prompt, pos, draft_entropy, target_entropy, tuple(ranks), draft_margin, tuple(probs))


def known_counts(records: Sequence[PositionRecord], depth: int) -> list[int]:
    return [sum(1 for r in records if len(r.draft_probs) > d and r.ranks[d] >= 0) for d in range(depth)]


def bucket(batch_size: int) -> int:
    return nearest_batch(BUCKETS, batch_size)


def fit_costs(trees: Sequence[Tree], measured: dict[tuple[int, int], tuple[float, int]],
              bkt: int, prior: Sequence[float] | None = None) -> list[float] | None:
    """Seconds per step of every tree at batch bucket `bkt` from the (tree index, bucket) -> (mean seconds,
    count) measured so far; None when nothing was measured at that bucket. `prior`: each tree's cost before
    any measurement (default `tree.generic.prior_cost`), scaled to the measurements while fewer than three
    speculative tree shapes are measured."""
    prior = list(prior) if prior is not None else [prior_cost(t) for t in trees]
    pts = [(trees[i], s, n, prior[i]) for (i, b), (s, n) in measured.items() if b == bkt]
    if not pts:
        return None
    # chain:0 (a resting step, SGLang's plain decode) is another regime than a speculative step (its fixed part
    # is larger: calibrate/costs.StepCostModel): the speculative trees are fitted on speculative steps only, and chain:0
    # is its own measurement or, until it is measured here, the set's prior, never scaled by speculative steps
    spec = [p for p in pts if p[0].num_nodes > 1]
    fitted = list(prior)
    if len({(t.num_nodes, t.max_depth) for t, _, _, _ in spec}) >= 3:
        import torch

        x = torch.tensor([[1.0, t.num_nodes - 1, t.max_depth] for t, _, _, _ in spec], dtype=torch.float64)
        w = torch.tensor([math.sqrt(n) for _, _, n, _ in spec], dtype=torch.float64).view(-1, 1)
        y = torch.tensor([[s] for _, s, _, _ in spec], dtype=torch.float64)
        coef = torch.linalg.lstsq(x * w, y * w).solution.view(-1).tolist()
        base, per_node, per_level = coef[0], max(coef[1], 0.0), max(coef[2], 0.0)
        floor = min(s for _, s, _, _ in spec) * 0.5
        fitted = [max(base + per_node * (t.num_nodes - 1) + per_level * t.max_depth, floor) if t.num_nodes > 1
                  else c for t, c in zip(trees, fitted)]
    elif spec:
        scale = sum(s / p * n for _, s, n, p in spec) / sum(n for _, _, n, _ in spec)
        fitted = [c * scale if t.num_nodes > 1 else c for t, c in zip(trees, fitted)]
    for (i, b), (s, n) in measured.items():   # chain:0 at once, a tree measured often enough: its own estimate
        if b == bkt and (n >= 8 or trees[i].num_nodes == 1):
            fitted[i] = s
    return fitted


@dataclass
class OnlineCalibration:
    """Refits a generic tree set's predictor and costs from what the server observes."""

    tree_set: TreeSet
    refit_every: int = 64
    max_records: int = 8192
    max_rank: int = 6
    records: collections.deque = field(default_factory=collections.deque)
    measured: dict = field(default_factory=dict)    # (tree index, bucket) -> (mean seconds, count)
    steps: int = 0
    refits: int = 0

    def __post_init__(self):
        self.records = collections.deque(self.records, maxlen=self.max_records)
        # a calibrated set's own predictor, else the generic prior (the drafter is taken as calibrated)
        self.prior = (AcceptancePredictor.from_json(self.tree_set.predictor) if self.tree_set.predictor
                      else prior_predictor(self.tree_set.max_depth))
        self._recent: dict = {}
        self._warm: set = set()
        self._base_costs = self.tree_set.trees   # the set's own costs: the prior of every refit

    def observe(self, records: Sequence[PositionRecord]) -> None:
        self.records.extend(records)

    def observe_time(self, tree_index: int, batch_size: int, seconds: float | None) -> None:
        """One step's wall time (None: count the step, time unknown). A shape's first step is a warm-up
        (allocations, first-call paths) and is dropped; the estimate is the median of the shape's last
        `RECENT` steps (the machine's load changes), and the fastest of them while fewer than `ROBUST` are
        kept: noise only adds time, and a shape priced by one slow step would not be chosen again to be
        re-timed (a server that rests for a whole request because one early step met a busy machine)."""
        self.steps += 1
        if seconds is None:
            return
        key = (tree_index, bucket(batch_size))
        seen = self._recent.setdefault(key, collections.deque(maxlen=RECENT))
        if key not in self._warm:
            self._warm.add(key)
            return
        seen.append(seconds)
        self.measured[key] = (statistics.median(seen) if len(seen) >= ROBUST else min(seen), len(seen))

    def due(self) -> bool:
        return self.steps >= (self.refits + 1) * self.refit_every

    def predictor(self) -> AcceptancePredictor:
        depth = min(self.tree_set.max_depth, self.prior.max_depth)
        recs = [r for r in self.records if r.draft_probs]
        known = known_counts(recs, depth)
        if not recs or known[0] < MIN_KNOWN:
            return self.prior
        fitted = fit_predictor(recs, depth, self.max_rank)
        fits = [d < fitted.max_depth and known[d] >= MIN_KNOWN for d in range(depth)]
        by_depth = tuple(fitted.by_depth[d] if fits[d] else self.prior.by_depth[d] for d in range(depth))
        deep = tuple(fitted.deep[d] if fits[d]
                     else _rebin(self.prior, d, fitted.root_edges, len(fitted.deep[0][0]))
                     for d in range(depth))
        return AcceptancePredictor(by_depth, deep, fitted.root_edges, len(recs))

    def refit(self) -> TreeSet:
        """The set with its predictor and costs refitted on everything observed so far."""
        self.refits += 1
        pred = self.predictor()
        trees = [e.tree for e in self.tree_set.trees]
        base = self._base_costs
        costs = {b: fit_costs(trees, self.measured, b, [e.cost(b) for e in base]) for b in BUCKETS}
        costs = {b: c for b, c in costs.items() if c is not None}
        entries = []
        for i, e in enumerate(self.tree_set.trees):
            exp = min(pred.expected_accepted(e.tree, [TYPICAL_ROOT]), e.tree.max_depth)
            entries.append(TreeEntry(e.tree, (exp,) * self.tree_set.num_bins,
                                     {b: c[i] for b, c in costs.items()} or dict(e.cost_seconds)))
        self.tree_set = amended(self.tree_set, {"online_positions": len(self.records), "online_steps": self.steps},
                                trees=tuple(entries), predictor=pred.to_json())
        return self.tree_set

    def refit_costs(self) -> TreeSet:
        """The set with only its step costs refitted on the timed steps (its acceptance tables and predictor
        kept); a batch bucket with no timed step keeps the set's own costs. What a calibrated set is served
        with by default inside SGLang (`ENTMTP_ONLINE_COSTS`), so that resting versus speculating is decided on
        what steps cost in this server."""
        self.refits += 1
        trees = [e.tree for e in self.tree_set.trees]
        entries = list(self.tree_set.trees)
        for b in BUCKETS:
            fitted = fit_costs(trees, self.measured, b, [e.cost(b) for e in self._base_costs])
            if fitted is not None:
                entries = [TreeEntry(e.tree, e.expected_accepted, {**e.cost_seconds, b: c})
                           for e, c in zip(entries, fitted)]
        self.tree_set = amended(self.tree_set, {"online_steps": self.steps}, trees=tuple(entries))
        return self.tree_set

    def summary(self) -> str:
        depth = self.tree_set.max_depth
        recs = list(self.records)
        known = known_counts(recs, depth)
        rates = []
        for d in range(depth):
            hits = sum(1 for r in recs if len(r.ranks) > d and r.ranks[d] == 0)
            rates.append(f"{hits / known[d]:.2f}" if known[d] else "?")
        c1 = {self.tree_set.trees[i].tree.name: f"{s * 1e3:.1f}ms" for (i, b), (s, _) in
              sorted(self.measured.items()) if b == 1}
        return (f"{len(recs)} positions; top-1 draft accepted by depth [{', '.join(rates)}] (observations "
                f"{known}); step time at batch 1 {c1 or 'not yet measured'}")


def _rebin(prior: AcceptancePredictor, d: int, edges: Sequence[float], width: int) -> tuple[tuple[float, ...], ...]:
    """The prior's depth-`d` table on other root bins: each new bin takes the prior's row for its lowest edge."""
    lows = [0.0, *edges]
    return tuple(_pad(prior.deep[d][prior.root_bin(low)], width) for low in lows)


def _pad(row: Sequence[float], n: int) -> tuple[float, ...]:
    row = tuple(row)[:n]
    return row + (row[-1],) * (n - len(row))
