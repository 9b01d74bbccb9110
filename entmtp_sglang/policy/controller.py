"""The EntMTP policy's state, one object for every engine: the reference engine (`policies.EntMTPPolicy`), the
SGLang worker (`sglang/worker.py`), the CLI and the benchmarks all choose through `TreeController`.

Per decode step an engine gathers one `RequestInput` per request of the batch and calls `choose`; after
verification it calls `record` with each request's accepted drafts; when a request ends, `forget`. Everything
stateful lives here once:

* expectations: per request and tree, E[accepted drafts], from the per-node acceptance predictor when the
  controller has one and the request carries its depth-1 draft probabilities, else from the set's table for
  the request's signal bin (`selector.binned_expected` / `selector.predicted_expected`);
* acceptance feedback: per request, clip((accepted + prior) / (expected + prior)) scales its expectations
  (`selector.acceptance_scale`), so a request whose drafts are accepted less than calibrated backs off;
* one tree for the whole batch (`choose`): argmax over the set of (sum of expected tokens) / step cost at the
  batch's row count (`selector.select_by_expected`), chain:0 included, so it backs off to plain decoding;
  or each request its own tree at a node count the batch shares (`choose_rows`, `budget.allocate_shared`),
  with hysteresis and pins per request;
* hysteresis: the group's current tree is kept unless another is expected to be `hysteresis` faster;
* pins: when every request of the batch names the same tree of the set (`pin`), that tree;
* room: no tree with more nodes than the least room any request has before its context limit;
* rest: after choosing chain:0 the group may decode plainly for a few steps without running the drafter at
  all (`rests`), 1, 2, 4, ... up to `max_rest` steps as the back-offs run on, since a step that runs the
  drafter only to decide not to speculate costs more than a plain one;
* staged decisions (`restage`), for drafters that draft level by level (Hydra, EAGLE): once the drafter has
  run on the chosen tree's first levels, each node drafted so far has its own draft probability, and the
  controller re-chooses among the set's trees that are prefixes of the chosen one (`tree.embedding`), so a
  step whose early drafts look weak verifies, and drafts, less than it chose before it saw them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from ..tree.acceptance import AcceptancePredictor
from ..tree.topology import embedding
from ..tree.treeset import TreeSet
from .budget import (  # budget allocates the trees; the controller keeps the state across steps
    HYSTERESIS,
    UnknownTreeError,
    allocate_ragged,
    allocate_shared,
    budget_config,
    request_options,
    shared_shape_cost,
)
from .selector import acceptance_scale, binned_expected, predicted_expected, select_by_expected

MAX_REST = 4  # the longest run of plain steps without the drafter after a back-off to chain:0


@dataclass(frozen=True)
class RequestInput:
    """What the controller needs about one request at one step."""

    key: Hashable                 # the request's identity (SGLang rid, or a batch row)
    signal: float                 # the value of the tree set's signal (policy/signals.py)
    probs: tuple[float, ...] = () # the drafter's largest probabilities for the next position (predictor input)
    room: int | None = None       # tree nodes that still fit before the request's context limit
    pin: str | None = None        # the name of a tree of the set this request asks for


@dataclass(frozen=True)
class StageInput:
    """One request at a staged decision: `drafted[n]` is the draft probability of node n of the tree chosen
    for this step under its parent's distribution, None where the drafter has not reached it yet."""

    key: Hashable
    probs: tuple[float, ...]          # the depth-1 top-k draft probabilities the step was chosen on
    drafted: tuple[float | None, ...]


@dataclass
class _Feedback:
    accepted: float = 0.0   # drafts accepted over the request's verified steps
    expected: float = 0.0   # what the controller expected for the same steps
    pending: float | None = None  # E[accepted] of the step chosen last, until `record` sees its result


@dataclass
class TreeController:
    tree_set: TreeSet
    hysteresis: float = HYSTERESIS
    feedback: bool = True
    predictor: AcceptancePredictor | None = None
    max_nodes: int | None = None
    max_rest: int = MAX_REST
    requests: dict = field(default_factory=dict)   # key -> _Feedback
    current: dict = field(default_factory=dict)    # group -> index of its current tree
    backoffs: dict = field(default_factory=dict)   # group -> consecutive choices of chain:0
    resting: dict = field(default_factory=dict)    # group -> plain steps left without the drafter

    def __post_init__(self):
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.max_rest < 0:
            raise ValueError(f"max_rest must be >= 0, got {self.max_rest}")
        self._index = {t.tree.name: i for i, t in enumerate(self.tree_set.trees)}
        self._prefixes: dict[int, list] = {}

    @classmethod
    def for_tree_set(cls, tree_set: TreeSet, use_predictor: bool = True, **kwargs) -> "TreeController":
        """With the set's acceptance predictor when it carries one and `use_predictor`."""
        pred = (AcceptancePredictor.from_json(tree_set.predictor)
                if use_predictor and tree_set.predictor is not None else None)
        return cls(tree_set, predictor=pred, **kwargs)

    # -- per step -------------------------------------------------------------------------------
    def expected(self, request: RequestInput) -> list[float]:
        """E[accepted drafts] of this request under each tree of the set."""
        if self.predictor is not None and request.probs:
            return predicted_expected(self.tree_set, self.predictor, [request.probs])
        return binned_expected(self.tree_set, request.signal)

    def scale(self, key: Hashable) -> float:
        st = self.requests.get(key)
        return acceptance_scale(st.accepted, st.expected) if self.feedback and st is not None else 1.0

    def pinned(self, requests: Sequence[RequestInput]) -> int | None:
        """The tree every request pins, if they all pin the same one; UnknownTreeError for a name not in
        the set."""
        names = {r.pin for r in requests}
        for name in names - {None}:
            if name not in self._index:
                raise UnknownTreeError(f"tree {name!r} is not in the tree set; its trees are "
                                       f"{', '.join(self._index)}")
        return self._index[names.pop()] if len(names) == 1 and None not in names else None

    def choose(self, requests: Sequence[RequestInput], rows: int | None = None,
               group: Hashable = "batch") -> int | None:
        """Index (into `tree_set.trees`) of the one tree this step's `requests` run; None when no tree fits
        their room (decode plainly). `rows`: what the engine computes this step (default: the requests);
        `group`: whose current tree hysteresis keeps (a batch, or one request choosing alone)."""
        if not requests:
            raise ValueError("choose needs at least one request")
        limits = [r.room for r in requests if r.room is not None] + [self.max_nodes] * (self.max_nodes is not None)
        cap = min(limits) if limits else None
        trees = self.tree_set.trees
        if cap is not None and cap < min(t.tree.num_nodes for t in trees):
            self._set_pending(requests, None, None)
            return None
        pin = self.pinned(requests)
        expected = [self.expected(r) for r in requests]
        if pin is not None and (cap is None or trees[pin].tree.num_nodes <= cap):
            idx = pin
        else:
            scales = [self.scale(r.key) for r in requests]
            idx = select_by_expected(self.tree_set, expected, rows or len(requests), scales,
                                     self.current.get(group), self.hysteresis, max_nodes=cap)
            self.current[group] = idx
        self._set_pending(requests, expected, idx)
        self._schedule_rest(group, trees[idx].tree.max_depth == 0)
        return idx

    def choose_rows(self, requests: Sequence[RequestInput], rows: int | None = None,
                    group: Hashable = "batch") -> tuple[int, ...] | None:
        """Each request its own tree (indices into `tree_set.trees`, in request order) at a shape the batch
        shares: every row verifies the same node count and the batch drafts its deepest row's levels
        (`budget.allocate_shared`: per request the tree of that size expecting the most tokens for it, the shape
        for the most expected tokens per second of the step). Per request: its expectations scaled by its own
        acceptance feedback, its pin (when the pins leave the batch a size to share; else none this step), its
        room, and hysteresis towards the tree it ran last. chain:0 for every request: the step decodes without
        speculation (and the group's rest is scheduled, as `choose` does). None when no tree fits the room."""
        if not requests:
            raise ValueError("choose_rows needs at least one request")
        trees = self.tree_set.trees
        limits = [r.room for r in requests if r.room is not None] + [self.max_nodes] * (self.max_nodes is not None)
        if limits and min(limits) < min(t.tree.num_nodes for t in trees):
            self._set_pending(requests, None, None)
            return None
        self.pinned(requests)   # UnknownTreeError for a pin the set lacks
        options = request_options(self, requests, {r.key: self.current[r.key] for r in requests
                                                   if r.key in self.current})
        batch = rows or len(requests)
        cost = shared_shape_cost([t.tree for t in trees], lambda i, b: trees[i].cost(b))
        alloc = allocate_shared(options, lambda total, depth, b: cost(total // b * batch, depth, batch),
                                budget_config(self))
        return self._take(requests, alloc, group)

    def _take(self, requests: Sequence[RequestInput], alloc, group: Hashable) -> tuple[int, ...]:
        """Per-request tree ids of an allocation, kept as each request's current tree with its pending feedback,
        and the group's rest scheduled when every row rests."""
        trees = self.tree_set.trees
        ids = tuple(int(i) for i in alloc.trees)
        for r, i in zip(requests, ids):
            self.current[r.key] = i
            st = self.requests.setdefault(r.key, _Feedback())
            st.pending = self.expected(r)[i] if trees[i].tree.max_depth > 0 else None
        self._schedule_rest(group, alloc.all_rest)
        return ids

    def choose_ragged(self, requests: Sequence[RequestInput], shapes, rows: int | None = None,
                      group: Hashable = "batch") -> tuple[Hashable, tuple[int, ...]] | None:
        """Each request its own tree and its own node count inside one of the engine's step shapes (`shapes`:
        key -> (draft levels D, the tree ids a row may take in it)), a resting row (chain:0) beside speculating
        ones: `budget.allocate_ragged` under the set's step costs as a line in the tokens actually verified
        (`ragged_cost.tree_set_cost`), or under the engine's own fit on its ragged steps (`set_ragged_cost`).
        Returns (shape key, per-request tree ids); every id chain:0 means the step decodes without speculation
        (and the group's rest is scheduled). None when no tree fits the room."""
        if not requests:
            raise ValueError("choose_ragged needs at least one request")
        self.pinned(requests)   # UnknownTreeError for a pin the set lacks
        options = request_options(self, requests, {r.key: self.current[r.key] for r in requests
                                                   if r.key in self.current})
        key, alloc = allocate_ragged(options, shapes, self.ragged_step_cost(rows or len(requests)),
                                     budget_config(self))
        return key, self._take(requests, alloc, group)

    def ragged_step_cost(self, batch: int):
        """What a ragged step of `batch` rows costs, `cost(total tokens, max depth, batch) -> seconds`: the engine's
        own fit on its ragged steps (`set_ragged_cost`), else the tree set's line (`ragged_cost.tree_set_cost`) at
        its measured batch size, scaled to `batch` rows."""
        from ..costs.ragged_cost import tree_set_cost

        online = self.__dict__.get("ragged_cost")   # fitted on this server's own ragged steps (set_ragged_cost)
        if online is not None:
            return online
        cached = self.__dict__.get("_ragged_cost")
        if cached is None or cached[0] is not self.tree_set or cached[1] != batch:   # refit sets replace it
            cached = self.__dict__["_ragged_cost"] = (self.tree_set, batch, *tree_set_cost(self.tree_set, batch))
        line, measured = cached[2], cached[3]

        def cost(total, depth, b):
            return line(total * measured / b, depth, measured)
        return cost

    def set_ragged_cost(self, cost) -> None:
        """Price ragged steps (`choose_ragged`) by `cost` (a `ragged_cost.RaggedStepCost` fitted on the engine's own
        timed steps) instead of the tree set's per-tree costs; None goes back to the set's."""
        self.__dict__["ragged_cost"] = cost

    def _schedule_rest(self, group: Hashable, backed_off: bool) -> None:
        """After the group's choice: a back-off to chain:0 rests the drafter 1, 2, 4, ... (at most `max_rest`)
        steps as consecutive back-offs run on; a speculating choice ends the run."""
        run = self.backoffs.get(group, 0) + 1 if backed_off else 0
        self.backoffs[group] = run
        self.resting[group] = min(self.max_rest, 2 ** (run - 1)) if run else 0

    def rests(self, groups: Sequence[Hashable]) -> bool:
        """Whether this step may decode plainly without running the drafter: every group of the step is
        resting after a back-off to chain:0. Counts the step off their rests when it is."""
        if not groups or any(self.resting.get(g, 0) <= 0 for g in groups):
            return False
        for g in groups:
            self.resting[g] -= 1
        return True

    def prefixes(self, idx: int) -> list[tuple[int, tuple[int, ...]]]:
        """(index, image) of every tree of the set that is a prefix of tree `idx` (itself and chain:0
        included), with where its nodes sit in tree `idx`."""
        if idx not in self._prefixes:
            big = self.tree_set.trees[idx].tree
            found = ((i, embedding(t.tree, big)) for i, t in enumerate(self.tree_set.trees))
            self._prefixes[idx] = [(i, image) for i, image in found if image is not None]
        return self._prefixes[idx]

    def restage(self, idx: int, requests: Sequence[StageInput], drafted_depth: int,
                rows: int | None = None) -> tuple[int, tuple[int, ...]]:
        """A staged decision for a step that chose tree `idx` and has drafted its nodes down to
        `drafted_depth`: the prefix of tree `idx` (a tree of the set) with the most expected tokens per
        second now that the drafted nodes' own probabilities are known, and where its nodes sit in tree `idx`.

        A prefix shallower than what was already drafted is charged the drafting levels it no longer needs
        (the set's per-depth step cost): they are spent. The chosen tree is kept unless a prefix is
        `hysteresis` faster. Without a predictor, tree `idx` itself."""
        big = self.tree_set.trees[idx].tree
        whole = tuple(range(big.num_nodes))
        if self.predictor is None or not requests:
            return idx, whole
        rows = rows or len(requests)
        per_depth = self.tree_set.per_depth(rows)
        scales = [self.scale(r.key) for r in requests]
        best, best_value, kept_value, best_expected = idx, -math.inf, -math.inf, []
        for i, image in self.prefixes(idx):
            tree = self.tree_set.trees[i].tree
            expected = [self.predictor.expected_accepted(tree, [r.probs], [r.drafted[m] for m in image])
                        for r in requests]
            tokens = sum(min(s * e, tree.max_depth) + 1.0 for e, s in zip(expected, scales))
            spent = per_depth * max(0, drafted_depth - max(tree.max_depth, 1))  # levels drafted for nothing
            value = tokens / (self.tree_set.trees[i].cost(rows) + spent)
            if i == idx:
                kept_value = value
            if value > best_value:
                best, best_value, best_expected = i, value, expected
        if best == idx or kept_value * (1 + self.hysteresis) >= best_value:
            return idx, whole
        speculates = self.tree_set.trees[best].tree.max_depth > 0
        for r, e in zip(requests, best_expected):
            self.requests.setdefault(r.key, _Feedback()).pending = e if speculates else None
        return best, dict(self.prefixes(idx))[best]

    def _set_pending(self, requests, expected, idx) -> None:
        for k, r in enumerate(requests):
            st = self.requests.setdefault(r.key, _Feedback())
            speculates = idx is not None and self.tree_set.trees[idx].tree.max_depth > 0
            st.pending = expected[k][idx] if speculates else None

    def record(self, key: Hashable, accepted: int | None) -> None:
        """The outcome of `key`'s last chosen step: drafts accepted (None: unknown, e.g. the step was not
        run). Feeds the acceptance feedback."""
        st = self.requests.get(key)
        if st is None or st.pending is None:
            return
        if accepted is not None:
            st.accepted += accepted
            st.expected += st.pending
        st.pending = None

    def forget(self, key: Hashable) -> None:
        """A finished request: drop its feedback and its current tree."""
        self.requests.pop(key, None)
        for state in (self.current, self.backoffs, self.resting):
            state.pop(key, None)

    def keys(self) -> set:
        """Every key the controller holds state for (requests, and the groups it chooses for)."""
        return set(self.requests) | set(self.current) | set(self.backoffs) | set(self.resting)

    def keep_only(self, live) -> None:
        """Forget every request not in `live` (a server's sweep of finished requests)."""
        live = set(live)
        for key in [k for k in self.requests if k not in live]:
            self.forget(key)

