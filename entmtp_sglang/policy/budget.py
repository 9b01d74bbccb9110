"""A batch's verification budget across its requests: each request its own tree, the step's expected tokens per
second as high as the options allow (issue 36, item 3).

Per request the engine knows a few options, one per tree it could draft for it (`TreeOption`: tree id, nodes it
would verify, depth, E[tokens the step commits for it], bonus token included), always with the resting option
(one node, depth 0, exactly one token); per batch a step cost `cost(total_tokens, max_depth, batch_size)` in
seconds, where `total_tokens` is the sum of the chosen node counts (a resting row verifies its one token) and
`max_depth` the deepest chosen tree (the levels the batch drafts). `allocate` chooses one option per request:

    best = None
    for D in the depths the options have (the batch's deepest level, capped):
        per request: the upper concave hull of its (nodes, expected) options of depth <= D, from its fewest
                     nodes up to its most expected tokens
        state = every request at its hull's first point (the resting option unless pinned)
        for each hull segment, across the batch, by marginal tokens per verified token, descending:
            move its request one hull point up
            value = sum(expected) / cost(sum(nodes), deepest depth now chosen, batch size)
            best = the state of the highest value so far (a tie: the first seen, shallower and fewer tokens)
    when every request may rest, also each assignment where one request alone leaves the resting option
    (for any of its options: a plain step dearer than a speculating one can make a lone small upgrade best)
    then hysteresis (`_keep_previous`): a request goes back to its previous tree where that keeps the step
    within a factor (1 + hysteresis) of the best value

The contract (tested against `allocate_exhaustive`, which enumerates every assignment):

* exact when, at each (max_depth, batch_size), the cost is affine in total_tokens and nondecreasing in it, and
  it is nondecreasing in max_depth from depth 1 on (the all-resting step, depth 0, may cost anything): the
  result's value equals the best over *every* assignment, options under their request's hull (non-concave
  option curves) included. Why (Dinkelbach): at the optimal value v*, the best assignment, of depth D, maximises
  sum(expected) - v* * cost(., D, .) over the assignments of depth <= D, which with an affine cost is a
  separable sum; each request's part, expected - v* * slope * nodes, is maximised at a hull vertex, and the hull
  vertices whose segments beat v* * slope are a prefix of the greedy order at cap D, whose real cost is no more
  than at depth D. When that prefix is empty (the all-resting step, which has depth 0, not D), the best of
  depth >= 1 moves exactly one request, to the option that loses least: a single move. `RaggedStepCost` is
  such a cost.
* for any cost nondecreasing in both: every state the greedy passes through (`frontier`) expects the most tokens
  of any assignment with at most its tokens and depth cap (a budget's fractional knapsack, integral at hull
  vertices), so the result is the best of those states and the single moves; it can miss an assignment whose
  token count falls between two states, which a cost with a jump there favours (a test shows one).

Pins (`RequestOptions.pin`) fix a request's tree, rest included; room (`RequestOptions.room`, and the config's
`max_nodes`) caps its nodes; a pin that does not fit is dropped, as `TreeController.choose` does. The function is
pure and deterministic: every tensor-parallel rank given the same inputs makes the same choice.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Iterator, Mapping, Sequence

HYSTERESIS = 0.02  # keep the current tree unless another is expected to be this much faster


class UnknownTreeError(ValueError):
    """A request pinned a tree the set does not hold; the message lists the set's trees."""


if TYPE_CHECKING:
    from ..tree import Tree
    from .controller import RequestInput, TreeController

StepCost = Callable[[int, int, int], float]  # (total tokens verified, max depth, batch size) -> seconds
EXHAUSTIVE_LIMIT = 1_000_000  # assignments `allocate_exhaustive` enumerates at most
_EPS = 1e-9


@dataclass(frozen=True)
class TreeOption:
    """One tree a request could run this step. `expected_tokens`: E[tokens the step commits for the request],
    the bonus token included, so in [1, max_depth + 1] (the selector's `min(scale * E[accepted], depth) + 1`)."""

    tree: Hashable        # the tree's id (its index in the tree set, or its name)
    num_nodes: int        # tokens the request verifies (1: resting, the root alone)
    max_depth: int        # drafting levels the tree needs
    expected_tokens: float

    def __post_init__(self):
        if not (isinstance(self.num_nodes, int) and self.num_nodes >= 1):
            raise ValueError(f"option {self.tree!r}: num_nodes must be an integer >= 1, got {self.num_nodes!r}")
        if not (isinstance(self.max_depth, int) and 0 <= self.max_depth <= self.num_nodes - 1):
            raise ValueError(f"option {self.tree!r}: max_depth must be an integer in [0, num_nodes - 1] = "
                             f"[0, {self.num_nodes - 1}], got {self.max_depth!r}")
        e = self.expected_tokens
        if not (math.isfinite(e) and 1.0 - _EPS <= e <= self.max_depth + 1.0 + _EPS):
            raise ValueError(f"option {self.tree!r}: expected_tokens must lie in [1, max_depth + 1] = "
                             f"[1, {self.max_depth + 1}] (the bonus token included), got {e!r}")

    @property
    def resting(self) -> bool:
        return self.num_nodes == 1


def rest_option(tree: Hashable = "chain:0") -> TreeOption:
    """The resting option: the root alone, one token."""
    return TreeOption(tree, 1, 0, 1.0)


@dataclass(frozen=True)
class RequestOptions:
    """One request's options for this step, with what constrains its choice.

    pin: a tree id among `options` the request must run (the resting option's id: it rests);
    room: the most nodes it may verify (what fits before its context limit), >= 1;
    previous: the tree id it ran last step (hysteresis keeps it when it costs little)."""

    options: tuple[TreeOption, ...]
    pin: Hashable | None = None
    room: int | None = None
    previous: Hashable | None = None

    def __post_init__(self):
        object.__setattr__(self, "options", tuple(self.options))
        if not self.options:
            raise ValueError("a request needs at least its resting option")
        ids = [o.tree for o in self.options]
        if len(set(ids)) != len(ids):
            raise ValueError(f"tree ids repeat among a request's options: {ids}")
        rests = [o.tree for o in self.options if o.resting]
        if len(rests) != 1:
            raise ValueError(f"a request needs exactly one resting option (1 node, depth 0, 1 token) among its "
                             f"options, got {len(rests)} ({ids})")
        if self.pin is not None and self.pin not in ids:
            raise ValueError(f"pinned tree {self.pin!r} is not among the request's options {ids}")
        if self.room is not None and not (isinstance(self.room, int) and self.room >= 1):
            raise ValueError(f"room must be an integer >= 1 (a resting row verifies one token), got {self.room!r}")

    def index_of(self, tree: Hashable) -> int | None:
        return next((k for k, o in enumerate(self.options) if o.tree == tree), None)


@dataclass(frozen=True)
class BudgetConfig:
    """hysteresis: a request keeps its previous tree while that leaves the step within a factor (1 + hysteresis)
    of the best value; max_nodes: the most nodes any request may verify (None: no cap); max_depth: the deepest
    level the batch may draft (None: no cap)."""

    hysteresis: float = HYSTERESIS
    max_nodes: int | None = None
    max_depth: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 0):
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.max_depth is not None and self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")


@dataclass(frozen=True)
class Allocation:
    """The step's choice: per request the index of its option (`choices`) and that option's tree id (`trees`),
    nodes (`num_nodes`) and depth; the batch's totals and its value."""

    choices: tuple[int, ...]
    trees: tuple[Hashable, ...]
    num_nodes: tuple[int, ...]
    total_tokens: int
    max_depth: int
    expected_tokens: float
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.seconds

    @property
    def resting(self) -> tuple[bool, ...]:
        return tuple(n == 1 for n in self.num_nodes)

    @property
    def all_rest(self) -> bool:
        """Every request rests: the step is a plain decode step (the drafter need not run)."""
        return self.max_depth == 0


def evaluate(requests: Sequence[RequestOptions], choices: Sequence[int], cost: StepCost) -> Allocation:
    """The allocation of `choices` (per request, an index into its options), with its step cost."""
    if len(choices) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(choices)} choices")
    chosen = [r.options[k] for r, k in zip(requests, choices)]
    total = sum(o.num_nodes for o in chosen)
    depth = max(o.max_depth for o in chosen)
    return Allocation(tuple(choices), tuple(o.tree for o in chosen), tuple(o.num_nodes for o in chosen), total,
                      depth, math.fsum(o.expected_tokens for o in chosen), _seconds(cost, total, depth, len(requests)))


def _seconds(cost: StepCost, total: int, depth: int, batch: int) -> float:
    s = float(cost(total, depth, batch))
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"step cost must be a positive number of seconds, got {s!r} for {total} tokens, "
                         f"max depth {depth}, batch size {batch}")
    return s


def _allowed(req: RequestOptions, config: BudgetConfig) -> list[int]:
    """Indices of the options this request may take: within its room, the config's max_nodes and max_depth; only
    the pinned one when it is among them (a pin that does not fit is dropped). The resting option always fits."""
    caps = [c for c in (req.room, config.max_nodes) if c is not None]
    cap = min(caps) if caps else None
    ok = [k for k, o in enumerate(req.options) if (cap is None or o.num_nodes <= cap)
          and (config.max_depth is None or o.max_depth <= config.max_depth)]
    pinned = req.index_of(req.pin) if req.pin is not None else None
    return [pinned] if pinned in ok else ok


def upper_hull(points: Sequence[tuple[int, float]]) -> list[int]:
    """Indices of the upper concave hull of (nodes, expected) points, from the fewest nodes (the most expected
    among them) to the most expected tokens, strictly rising: the options a budget ever takes. A point on a
    segment of the hull (collinear) is left out; ties go to the lower index."""
    order = sorted(range(len(points)), key=lambda k: (points[k][0], -points[k][1], k))
    rising: list[int] = []
    for k in order:  # fewer nodes and at least as many tokens dominate
        if not rising or points[k][1] > points[rising[-1]][1]:
            rising.append(k)
    hull: list[int] = []
    for k in rising:
        x2, y2 = points[k]
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = points[hull[-2]], points[hull[-1]]
            if (y1 - y0) * (x2 - x1) <= (y2 - y1) * (x1 - x0):  # slope into hull[-1] <= slope out: not a vertex
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def _walk(requests: Sequence[RequestOptions], allowed: Sequence[list[int]], cap: int
          ) -> tuple[list[list[int]], list[tuple[float, int, int]]]:
    """Per request the option indices of its hull with depth capped at `cap`, and every hull segment across the
    batch, (-slope, request, step onto hull point), in the greedy's order."""
    hulls, segments = [], []
    for i, (req, ks) in enumerate(zip(requests, allowed)):
        ks = [k for k in ks if req.options[k].max_depth <= cap]
        hull = [ks[h] for h in upper_hull([(req.options[k].num_nodes, req.options[k].expected_tokens) for k in ks])]
        hulls.append(hull)
        slope = math.inf
        for step in range(1, len(hull)):
            a, b = req.options[hull[step - 1]], req.options[hull[step]]
            slope = min(slope, (b.expected_tokens - a.expected_tokens) / (b.num_nodes - a.num_nodes))  # rounding
            segments.append((-slope, i, step))
    segments.sort()  # by marginal tokens per verified token, descending; a request's own segments keep their order
    return hulls, segments


def _states(requests: Sequence[RequestOptions], hulls: list[list[int]], segments: list[tuple[float, int, int]]
            ) -> Iterator[tuple[int, int, float, int]]:
    """The greedy's states, (segments taken, total tokens, expected tokens, deepest depth), from every request at
    its hull's first point to every request at its last."""
    opts = [req.options[h[0]] for req, h in zip(requests, hulls)]
    total = sum(o.num_nodes for o in opts)
    expected = math.fsum(o.expected_tokens for o in opts)
    depths = collections.Counter(o.max_depth for o in opts)  # requests at each depth
    yield 0, total, expected, max(depths)
    for done, (_, i, step) in enumerate(segments, start=1):
        a, b = requests[i].options[hulls[i][step - 1]], requests[i].options[hulls[i][step]]
        total += b.num_nodes - a.num_nodes
        expected += b.expected_tokens - a.expected_tokens
        depths[a.max_depth] -= 1
        depths[b.max_depth] += 1
        if not depths[a.max_depth]:
            del depths[a.max_depth]
        yield done, total, expected, max(depths)


def _choices(hulls: list[list[int]], segments: list[tuple[float, int, int]], taken: int) -> tuple[int, ...]:
    state = [0] * len(hulls)
    for _, i, step in segments[:taken]:
        state[i] = step
    return tuple(h[s] for h, s in zip(hulls, state))


def frontier(requests: Sequence[RequestOptions], cap: int, config: BudgetConfig = BudgetConfig()
             ) -> list[tuple[int, float, tuple[int, ...]]]:
    """The states `allocate` weighs with the batch's depth capped at `cap`, (total tokens, expected tokens,
    choices), fewest tokens first; each expects the most tokens of any assignment within its total and the cap."""
    hulls, segments = _walk(requests, [_allowed(r, config) for r in requests], cap)
    return [(total, expected, _choices(hulls, segments, done))
            for done, total, expected, _ in _states(requests, hulls, segments)]


def allocate(requests: Sequence[RequestOptions], cost: StepCost, config: BudgetConfig = BudgetConfig()
             ) -> Allocation:
    """One option per request, for the most expected tokens per second of the whole step (see the module
    docstring for the method and its contract), then hysteresis towards each request's previous tree."""
    if not requests:
        raise ValueError("allocate needs at least one request")
    allowed = [_allowed(r, config) for r in requests]
    floor = max(min(r.options[k].max_depth for k in ks) for r, ks in zip(requests, allowed))  # pins force depth
    caps = sorted({r.options[k].max_depth for r, ks in zip(requests, allowed) for k in ks} - set(range(floor)))
    batch, best, best_choices = len(requests), -math.inf, None
    for cap in caps:
        hulls, segments = _walk(requests, allowed, cap)
        taken = None
        for done, total, expected, deepest in _states(requests, hulls, segments):
            v = expected / _seconds(cost, total, deepest, batch)
            if v > best:
                best, taken = v, done
        if taken is not None:
            best_choices = _choices(hulls, segments, taken)
    if floor == 0:  # every request may rest: also each single request's move off the all-resting step
        rest = [next(k for k in ks if r.options[k].resting) for r, ks in zip(requests, allowed)]
        for i, (req, ks) in enumerate(zip(requests, allowed)):
            for k in ks:
                o = req.options[k]
                if k != rest[i]:
                    v = (batch - 1 + o.expected_tokens) / _seconds(cost, batch - 1 + o.num_nodes, o.max_depth, batch)
                    if v > best:
                        best, best_choices = v, tuple(rest[:i]) + (k,) + tuple(rest[i + 1:])
    return _keep_previous(requests, allowed, evaluate(requests, best_choices, cost), cost, config.hysteresis)


def _keep_previous(requests: Sequence[RequestOptions], allowed: Sequence[list[int]], best: Allocation,
                   cost: StepCost, hysteresis: float) -> Allocation:
    """In request order, each request whose previous tree is allowed and differs from its choice goes back to
    it when the step's value stays >= best / (1 + hysteresis) (so the result does too)."""
    out = best
    for i, (req, ks) in enumerate(zip(requests, allowed)):
        prev = req.index_of(req.previous) if req.previous is not None else None
        if prev is None or prev not in ks or prev == out.choices[i]:
            continue
        trial = evaluate(requests, out.choices[:i] + (prev,) + out.choices[i + 1:], cost)
        if trial.tokens_per_second * (1 + hysteresis) >= best.tokens_per_second:
            out = trial
    return out


def allocate_exhaustive(requests: Sequence[RequestOptions], cost: StepCost, config: BudgetConfig = BudgetConfig(),
                        shared: bool = False) -> Allocation:
    """The reference: every assignment of allowed options evaluated (no hysteresis; the first best in
    lexicographic order of choices). For tests and small batches (at most EXHAUSTIVE_LIMIT assignments).
    `shared`: only the assignments `allocate_shared` may make (every request the same node count, its pins
    `_shared_allowed`'s)."""
    if not requests:
        raise ValueError("allocate_exhaustive needs at least one request")
    allowed = _shared_allowed(requests, config) if shared else [_allowed(r, config) for r in requests]
    if math.prod(len(ks) for ks in allowed) > EXHAUSTIVE_LIMIT:
        raise ValueError(f"more than {EXHAUSTIVE_LIMIT} assignments to enumerate")
    best = None
    for choices in itertools.product(*allowed):
        if shared and len({r.options[k].num_nodes for r, k in zip(requests, choices)}) > 1:
            continue
        a = evaluate(requests, choices, cost)
        if best is None or a.tokens_per_second > best.tokens_per_second:
            best = a
    return best


# -- one node count for every row (SGLang's strided `bs x N` verify) -------------------------------------------
def _shared_feasible(requests: Sequence[RequestOptions], allowed: Sequence[list[int]]) -> bool:
    """Whether some node count is allowed to every request (their pins included)."""
    counts = [{r.options[k].num_nodes for k in ks} for r, ks in zip(requests, allowed)]
    return bool(set.intersection(*counts))


def _shared_allowed(requests: Sequence[RequestOptions], config: BudgetConfig) -> list[list[int]]:
    """Each request's allowed options when every row takes one node count. Pins that leave no count every request
    may take (pins of different sizes): the pins of the size pinned most often are kept, the others dropped this
    step; with no such size (a tie), or when the kept pins still leave no count, every pin is dropped."""
    allowed = [_allowed(r, config) for r in requests]
    if _shared_feasible(requests, allowed):
        return allowed
    unpinned = [dataclasses.replace(r, pin=None) for r in requests]
    sizes = [r.options[r.index_of(r.pin)].num_nodes for r in requests if r.pin is not None]
    ranked = sorted(set(sizes), key=sizes.count, reverse=True)
    if len(ranked) == 1 or sizes.count(ranked[0]) > sizes.count(ranked[1]):
        kept = [r if r.pin is not None and r.options[r.index_of(r.pin)].num_nodes == ranked[0] else u
                for r, u in zip(requests, unpinned)]
        allowed = [_allowed(r, config) for r in kept]
        if _shared_feasible(requests, allowed):
            return allowed
    return [_allowed(r, config) for r in unpinned]


def allocate_shared(requests: Sequence[RequestOptions], cost: StepCost, config: BudgetConfig = BudgetConfig()
                    ) -> Allocation:
    """One option per request when every row of the step verifies the same N nodes (SGLang's strided `bs x N`
    verify: no resting row inside a speculating step) and the batch drafts the deepest chosen level D; each
    request its own tree of N nodes:

        for N in the node counts every request may take, ascending (N = 1: the all-resting step):
            for D in the depths of those N-node options, ascending:
                per request: its allowed option of N nodes and depth <= D expecting the most tokens
                             (ties: the shallower, then the first)
                value = sum(expected) / cost(batch * N, deepest chosen depth, batch)
        best = the highest value (a tie: the first seen, fewer nodes and shallower)
        then hysteresis (`_keep_previous`) among the options of the best's N nodes and depth <= its D

    Exact (equals `allocate_exhaustive(..., shared=True)`) when the cost is nondecreasing in max_depth at each
    (total tokens, batch size). Pins, room and the config's caps as `allocate`'s; pins of different sizes: those
    of the size pinned most often are kept and the others dropped this step (`_shared_allowed`)."""
    if not requests:
        raise ValueError("allocate_shared needs at least one request")
    allowed = _shared_allowed(requests, config)
    batch, best, best_choices, shape = len(requests), -math.inf, None, None
    counts = set.intersection(*({r.options[k].num_nodes for k in ks} for r, ks in zip(requests, allowed)))
    for n in sorted(counts):
        fits = [[k for k in ks if r.options[k].num_nodes == n] for r, ks in zip(requests, allowed)]
        for cap in sorted({r.options[k].max_depth for r, ks in zip(requests, fits) for k in ks}):
            choices = []
            for r, ks in zip(requests, fits):
                ok = [k for k in ks if r.options[k].max_depth <= cap]
                if not ok:
                    break
                choices.append(max(ok, key=lambda k, r=r: (r.options[k].expected_tokens, -r.options[k].max_depth,
                                                             -k)))
            else:
                deepest = max(r.options[k].max_depth for r, k in zip(requests, choices))
                v = math.fsum(r.options[k].expected_tokens for r, k in zip(requests, choices)) / _seconds(
                    cost, batch * n, deepest, batch)
                if v > best:
                    best, best_choices, shape = v, tuple(choices), (n, deepest)
    n, depth = shape
    kept = [[k for k in ks if r.options[k].num_nodes == n and r.options[k].max_depth <= depth]
            for r, ks in zip(requests, allowed)]
    return _keep_previous(requests, kept, evaluate(requests, best_choices, cost), cost, config.hysteresis)


def shared_shape_cost(trees: Sequence[Tree], tree_cost: Callable[[int, int], float]) -> StepCost:
    """The step cost of a shared shape from a tree set's per-tree costs: a step whose every row verifies N nodes
    with the deepest drafted level D costs what the set's (dearest) tree of N nodes and depth D costs at that
    batch size, `tree_cost(tree index, batch size)`."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(trees):
        by_shape.setdefault((t.num_nodes, t.max_depth), []).append(i)

    def cost(total_tokens: int, max_depth: int, batch_size: int) -> float:
        n = total_tokens // batch_size
        ids = by_shape.get((n, max_depth))
        if ids is None or n * batch_size != total_tokens:
            raise ValueError(f"no tree of the set has {n} nodes and depth {max_depth} (a shared shape of "
                             f"{total_tokens} tokens over {batch_size} rows)")
        return max(tree_cost(i, batch_size) for i in ids)

    return cost


# -- from the policy's state --------------------------------------------------------------------------------------
def options_of(trees: Sequence[Tree], expected_accepted: Sequence[float], scale: float = 1.0
               ) -> tuple[TreeOption, ...]:
    """One option per tree, its id the tree's index in `trees`: expected tokens min(scale * E[accepted], depth)
    + 1, as the selector counts them (`selector.batch_tokens`). `expected_accepted`: `TreeController.expected`."""
    if len(trees) != len(expected_accepted):
        raise ValueError(f"{len(trees)} trees but {len(expected_accepted)} expectations")
    return tuple(TreeOption(i, t.num_nodes, t.max_depth, min(scale * e, t.max_depth) + 1.0)
                 for i, (t, e) in enumerate(zip(trees, expected_accepted)))


def budget_config(controller: TreeController, max_depth: int | None = None) -> BudgetConfig:
    """The controller's hysteresis and max_nodes as a `BudgetConfig` (max_depth: the deepest level the engine
    drafts, if capped)."""
    return BudgetConfig(controller.hysteresis, controller.max_nodes, max_depth)


def request_options(controller: TreeController, requests: Sequence[RequestInput],
                    previous: Mapping[Hashable, int] | None = None) -> list[RequestOptions]:
    """What `allocate` needs per request, from the controller that holds the policy's state: its expectations
    (predictor or signal bins) scaled by its acceptance feedback, its pin (a tree name; UnknownTreeError for a
    name the set lacks), its room, and `previous[key]`, the index of the tree it ran last step."""
    trees = [t.tree for t in controller.tree_set.trees]
    index = {t.name: i for i, t in enumerate(trees)}
    previous = previous or {}
    out = []
    for r in requests:
        if r.pin is not None and r.pin not in index:
            raise UnknownTreeError(f"tree {r.pin!r} is not in the tree set; its trees are {', '.join(index)}")
        out.append(RequestOptions(options_of(trees, controller.expected(r), controller.scale(r.key)),
                                  pin=index.get(r.pin), room=r.room, previous=previous.get(r.key)))
    return out


# -- ragged node counts inside a shared shape (resting rows in speculating steps) ----------------------------------
def allocate_ragged(requests: Sequence[RequestOptions], shapes: Mapping[Hashable, tuple[int, frozenset]],
                    cost: StepCost, config: BudgetConfig = BudgetConfig()) -> tuple[Hashable, Allocation]:
    """One option per request when each row verifies its own node count (a resting row its root alone) inside one
    of the engine's step shapes: `shapes[key] = (D, trees)`, the draft levels D the shape runs and the tree ids a
    row may take in it (those that fit it, padded). A speculating step costs `cost(total tokens, D, batch)`
    whatever its rows' own depths (the shape drafts D levels); every row resting costs `cost(batch, 0, batch)`:

        for key in shapes (in order):
            per request: its options among the shape's trees (its pin, if the shape holds it; only the shapes
                         holding the most pins are tried, and a pin such a shape lacks is dropped this step:
                         pins of different shapes in one batch keep as many as one step can run)
            alloc = allocate(those options, (total, d, b) -> cost(total, D if d > 0 else 0, b))
        best = the highest tokens per second (a tie: the first key)

    Exact (equals `allocate_ragged_exhaustive`) under `allocate`'s condition, which a `RaggedStepCost` meets: per
    shape the cost is affine in total tokens and the same at every speculating depth."""
    if not requests or not shapes:
        raise ValueError("allocate_ragged needs at least one request and one shape")

    best_key, best = None, None
    for key, (depth, ids) in _most_pins(requests, shapes):
        reqs = [_within(r, ids) for r in requests]
        if any(r is None for r in reqs):
            continue
        a = allocate(reqs, _at_depth(cost, depth), config)
        if best is None or a.tokens_per_second > best.tokens_per_second:
            best_key, best = key, a
    if best is None:
        raise ValueError("no shape holds a resting option for every request")
    return best_key, best


def _at_depth(cost: StepCost, depth: int) -> StepCost:
    return lambda total, d, batch: cost(total, depth if d > 0 else 0, batch)


def _most_pins(requests: Sequence[RequestOptions], shapes: Mapping[Hashable, tuple[int, frozenset]]
               ) -> list[tuple[Hashable, tuple[int, frozenset]]]:
    """The shapes (in order) holding the most of the requests' pinned trees: every pin when one shape holds them
    all; otherwise the pins one step can honour, the others dropped this step."""
    held = {key: sum(r.pin is not None and r.pin in ids for r in requests) for key, (_, ids) in shapes.items()}
    most = max(held.values())
    return [(key, shape) for key, shape in shapes.items() if held[key] == most]


def _within(req: RequestOptions, ids) -> RequestOptions | None:
    """`req` with only the options among `ids` (None when its resting option is not among them); its pin kept if
    `ids` holds it."""
    options = tuple(o for o in req.options if o.tree in ids)
    if not any(o.resting for o in options):
        return None
    return RequestOptions(options, pin=req.pin if req.pin in ids else None, room=req.room,
                          previous=req.previous if req.previous in ids else None)


def allocate_ragged_exhaustive(requests: Sequence[RequestOptions], shapes: Mapping[Hashable, tuple[int, frozenset]],
                               cost: StepCost, config: BudgetConfig = BudgetConfig()) -> tuple[Hashable, Allocation]:
    """The reference for `allocate_ragged`: every shape, every assignment of its options (no hysteresis)."""
    best_key, best = None, None
    for key, (depth, ids) in _most_pins(requests, shapes):
        reqs = [_within(r, ids) for r in requests]
        if any(r is None for r in reqs):
            continue
        a = allocate_exhaustive(reqs, _at_depth(cost, depth), config)
        if best is None or a.tokens_per_second > best.tokens_per_second + _EPS * best.tokens_per_second:
            best_key, best = key, a
    return best_key, best
