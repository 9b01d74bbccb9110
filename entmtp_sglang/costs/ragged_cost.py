"""Step costs of ragged steps, where each request of a batch verifies its own number of tokens (issue 36): the
cost the batch budget (`policy/budget.py`) divides expected tokens by.

A speculating step (some row drafts, max depth >= 1) costs

    seconds = base + per_token * total_tokens + per_level * max_depth + per_row * batch_size

(total_tokens: the tokens the target verifies, a resting row's one included; max_depth: the levels the batch
drafts), and a step where every row rests (max depth 0) is SGLang's plain decode, another regime
(`calibrate/costs.StepCostModel`'s chain:0): `plain_base + plain_per_row * batch_size` when measured. Every
coefficient is >= 0, so the cost is affine and nondecreasing in total_tokens and nondecreasing in max_depth: what
makes the budget's greedy exact.

`fit_ragged_cost` fits it on timed steps (the median of each (tokens, depth, batch) point, weighted by sqrt of its
count, as `online.fit_costs` weighs its points) by non-negative least squares; with fewer than three distinct
speculating points it scales a prior instead. `OnlineRaggedCost` is the refit a serving worker runs, in the manner
of `online.OnlineCalibration.observe_time`: the first step of each (depth, batch) shape is a warm-up and is
dropped, each point keeps its last `RECENT` times (priced by its fastest while fewer than `online.ROBUST`), and
every `refit_every` steps `refit` fits again, forgetting a point not timed in the last `STALE_REFITS` refit periods:
a fit from a slow stretch (a server timed while others started beside it: every speculating step 90 ms against a
35 ms plain step) made the policy rest every step, so no speculating step was ever timed again to correct it; with
its points forgotten the fit falls back to the prior (None without one), the policy speculates where it pays, and
fresh times price it. The SGLang worker feeds it every ragged step and every resting step, a resting step whose
rows took spans timed as the plain step it would have been (`resting_seconds`), so that the plain regime is measured
and forgetting runs on while the policy rests (`sglang/worker.py`); the prior is the tree set's own fit where it has
one (`set_ragged_prior`), and the policy prices ragged steps by this fit once there is one, by the set's line again
when the fit is dropped.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

RECENT = 32         # step times kept per (tokens, depth, batch) point, as online.RECENT
MIN_POINTS = 3      # distinct speculating points before a fit replaces the scaled prior
# ... for a serving worker with a prior (the set's own fit): its first points are few and often timed while the
# machine is busy (other servers starting), and a least-squares line through 3 or 4 of them for 4 coefficients is
# anything (80 ms flat and no per-token cost; 32 ms a level): the prior, scaled, until twice as many points
PRIOR_MIN_POINTS = 8
STALE_REFITS = 4    # refit periods after which a point not timed again is forgotten


@dataclass(frozen=True)
class RaggedStep:
    """One timed step: the tokens the target verified (sum over rows), the deepest drafted level, the rows."""

    total_tokens: int
    max_depth: int
    batch_size: int
    seconds: float

    def __post_init__(self):
        if self.batch_size < 1 or self.max_depth < 0:
            raise ValueError(f"need batch_size >= 1 and max_depth >= 0, got {self.batch_size}, {self.max_depth}")
        least = self.batch_size + self.max_depth  # every row its root, the deepest row its levels
        if self.total_tokens < least or (self.max_depth == 0 and self.total_tokens != self.batch_size):
            raise ValueError(f"{self.total_tokens} tokens cannot be verified by {self.batch_size} rows at max depth "
                             f"{self.max_depth} (at least {least}; exactly {self.batch_size} when every row rests)")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be positive, got {self.seconds!r}")

    @property
    def point(self) -> tuple[int, int, int]:
        return self.total_tokens, self.max_depth, self.batch_size


@dataclass(frozen=True)
class RaggedStepCost:
    """Seconds of one ragged step (module docstring); plain_base = plain_per_row = 0: the all-resting step is not
    measured and costs what the speculating line says."""

    base: float
    per_token: float
    per_level: float
    per_row: float = 0.0
    plain_base: float = 0.0
    plain_per_row: float = 0.0

    def __post_init__(self):
        for name in ("base", "per_token", "per_level", "per_row", "plain_base", "plain_per_row"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (costs never fall with more work), got {v!r}")
        if self.base + self.per_token + self.per_level + self.per_row <= 0:
            raise ValueError("a step must cost something: base, per_token, per_level and per_row are all 0")

    @property
    def plain_known(self) -> bool:
        return self.plain_base + self.plain_per_row > 0

    def line(self, total_tokens: int, max_depth: int, batch_size: int) -> float:
        return self.base + self.per_token * total_tokens + self.per_level * max_depth + self.per_row * batch_size

    def __call__(self, total_tokens: int, max_depth: int, batch_size: int) -> float:
        if max_depth == 0 and self.plain_known:
            return self.plain_base + self.plain_per_row * batch_size
        return self.line(total_tokens, max_depth, batch_size)

    def scaled(self, factor: float) -> "RaggedStepCost":
        """Every coefficient of the speculating line times `factor` (the plain regime kept)."""
        return RaggedStepCost(self.base * factor, self.per_token * factor, self.per_level * factor,
                              self.per_row * factor, self.plain_base, self.plain_per_row)

    def to_json(self) -> dict:
        return {k: round(getattr(self, k), 9) for k in ("base", "per_token", "per_level", "per_row", "plain_base",
                                                       "plain_per_row")}

    @classmethod
    def from_json(cls, d: dict) -> "RaggedStepCost":
        return cls(float(d["base"]), float(d["per_token"]), float(d["per_level"]), float(d.get("per_row", 0.0)),
                   float(d.get("plain_base", 0.0)), float(d.get("plain_per_row", 0.0)))


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin ||w * (x @ c - y)|| over c >= 0, for a handful of columns: least squares on every subset of the
    columns of full rank, the best whose coefficients are all >= 0 (the others 0). Exact for so few columns."""
    xw, yw = x * w[:, None], y * w
    best, best_res = np.zeros(x.shape[1]), float(yw @ yw)
    for size in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), size):
            sub = xw[:, cols]
            if np.linalg.matrix_rank(sub) < size:
                continue
            coef = np.linalg.lstsq(sub, yw, rcond=None)[0]
            if (coef < 0).any():
                continue
            r = sub @ coef - yw
            res = float(r @ r)
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = np.zeros(x.shape[1]), res
                best[list(cols)] = coef
    return best


def _medians(steps: Sequence[RaggedStep]) -> dict[tuple[int, int, int], tuple[float, int]]:
    by_point: dict = collections.defaultdict(list)
    for s in steps:
        by_point[s.point].append(s.seconds)
    return {p: (statistics.median(v), len(v)) for p, v in by_point.items()}


def fit_ragged_cost(steps: Sequence[RaggedStep], prior: RaggedStepCost | None = None,
                    min_points: int = MIN_POINTS) -> RaggedStepCost:
    """The cost model of the timed `steps`:

        speculating: per (tokens, depth, batch) point its median seconds; with >= min_points distinct points,
                     non-negative least squares on (1, tokens, depth, batch), weights sqrt(count); else the
                     prior's line scaled by the count-weighted mean of measured / prior (the prior's line alone
                     when none was measured)
        all resting: with two or more batch sizes, non-negative least squares on (1, batch); with one, its median
                     through the per-row slope of the prior's plain regime (else the line's per_token + per_row);
                     none, the prior's plain regime

    ValueError when fewer than `min_points` (MIN_POINTS; at least that many) speculating points were measured and
    there is no prior."""
    min_points = max(min_points, MIN_POINTS)
    points = _medians(steps)
    spec = {p: v for p, v in points.items() if p[1] > 0}
    plain = {p: v for p, v in points.items() if p[1] == 0}
    if len(spec) >= min_points:
        x = np.array([[1.0, *p] for p in spec], dtype=np.float64)
        y = np.array([s for s, _ in spec.values()], dtype=np.float64)
        w = np.sqrt(np.array([n for _, n in spec.values()], dtype=np.float64))
        base, per_token, per_level, per_row = nonnegative_lstsq(x, y, w).tolist()
        line = RaggedStepCost(base, per_token, per_level, per_row)
    elif prior is None:
        raise ValueError(f"{len(spec)} distinct speculating step point(s) measured; a fit needs {min_points} "
                         "(or a prior to scale)")
    elif spec:
        ratio = sum(s / prior.line(*p) * n for p, (s, n) in spec.items()) / sum(n for _, n in spec.values())
        line = prior.scaled(ratio)
    else:
        line = prior
    plain_base, plain_per_row = (prior.plain_base, prior.plain_per_row) if prior is not None else (0.0, 0.0)
    if len(plain) >= 2:
        x = np.array([[1.0, p[2]] for p in plain], dtype=np.float64)
        y = np.array([s for s, _ in plain.values()], dtype=np.float64)
        w = np.sqrt(np.array([n for _, n in plain.values()], dtype=np.float64))
        plain_base, plain_per_row = nonnegative_lstsq(x, y, w).tolist()
    elif plain:
        (_, _, batch), (seconds, _) = next(iter(plain.items()))
        slope = plain_per_row if prior is not None and prior.plain_known else line.per_token + line.per_row
        slope = min(slope, seconds / batch)
        plain_base, plain_per_row = seconds - slope * batch, slope
    return RaggedStepCost(line.base, line.per_token, line.per_level, line.per_row, max(plain_base, 0.0),
                          plain_per_row)


@dataclass
class OnlineRaggedCost:
    """The ragged step-cost model a serving worker refits from its own timed steps (see the module docstring).
    `cost` is the model in use: the prior until the first refit."""

    prior: RaggedStepCost | None = None
    refit_every: int = 64
    recent: int = RECENT
    steps: int = 0
    refits: int = 0
    cost: RaggedStepCost | None = None
    times: dict = field(default_factory=dict)   # (tokens, depth, batch) -> deque of its last `recent` seconds
    warm: set = field(default_factory=set)      # (depth, batch) shapes whose warm-up step was dropped
    last: dict = field(default_factory=dict)    # (tokens, depth, batch) -> the step count when it was last timed
    stale_refits: int = STALE_REFITS
    min_points: int = MIN_POINTS   # distinct speculating points before a least-squares fit replaces the prior

    def __post_init__(self):
        if self.refit_every < 1 or self.recent < 1 or self.stale_refits < 1:
            raise ValueError(f"refit_every, recent and stale_refits must be >= 1, got {self.refit_every}, "
                             f"{self.recent}, {self.stale_refits}")
        if self.cost is None:
            self.cost = self.prior

    def observe(self, total_tokens: int, max_depth: int, batch_size: int, seconds: float | None) -> None:
        """One step (None: count the step, time unknown)."""
        self.steps += 1
        if seconds is None:
            return
        step = RaggedStep(total_tokens, max_depth, batch_size, seconds)
        shape = (max_depth, batch_size)
        if shape not in self.warm:
            self.warm.add(shape)
            return
        self.times.setdefault(step.point, collections.deque(maxlen=self.recent)).append(seconds)
        self.last[step.point] = self.steps

    def due(self) -> bool:
        return self.steps >= (self.refits + 1) * self.refit_every

    def observed(self) -> list[RaggedStep]:
        """The kept steps; a point timed fewer than `online.ROBUST` times gives only its fastest step (noise only
        adds time: one step that met a busy machine must not price a point out, as online.py does per shape)."""
        from .online import ROBUST

        return [RaggedStep(*p, s) for p, times in self.times.items()
                for s in (times if len(times) >= ROBUST else [min(times)])]

    def refit(self) -> RaggedStepCost | None:
        """The model fitted on the steps kept so far, or None while too few speculating points are kept and
        there is no prior; it becomes `cost`. A point not timed in the last `stale_refits` refit periods is
        forgotten first (the module docstring): without a prior, a fit whose points are all forgotten is dropped
        (None: the caller prices by its default again, the tree set's own line for the SGLang worker)."""
        self.refits += 1
        cutoff = self.steps - self.stale_refits * self.refit_every
        for p in [p for p, step in self.last.items() if step <= cutoff]:
            del self.times[p], self.last[p]
        if self.prior is not None or sum(1 for p in self.times if p[1] > 0) >= self.min_points:
            self.cost = fit_ragged_cost(self.observed(), self.prior, self.min_points)
        else:   # too few points (never had them, or forgotten): no fit of this server's own; the caller's default
            self.cost = None
        return self.cost


def resting_seconds(seconds: float, span_tokens: int, cost: RaggedStepCost | None) -> float | None:
    """A resting step whose rows took spans (`span_tokens` beyond one a row), timed as the plain step it would have
    been: its span tokens taken off at `cost`'s per-token price; None where no price is known or nothing is left.
    With lookup spans on, nearly every resting step of a mixed batch takes some, so untimed the plain regime kept
    the set's prior (37.6 ms + 2.4 ms a row against the 27 + 1.6 this server's plain steps took), the rest option was
    priced too dear and the policy speculated at 16 requests where resting was 1.2x faster (2026-12-06)."""
    if cost is None or span_tokens < 0:
        return None
    left = seconds - cost.per_token * span_tokens
    return left if math.isfinite(left) and left > 0 else None


def set_ragged_prior(tree_set) -> RaggedStepCost | None:
    """The ragged step cost a tree set was calibrated with through SGLang (`provenance["ragged_step_cost"]`), the
    prior of a server's own fit (`OnlineRaggedCost`); None for a set without one (priced per tree)."""
    fitted = getattr(tree_set, "provenance", {}).get("ragged_step_cost")
    return RaggedStepCost.from_json(fitted) if fitted else None


def tree_set_cost(tree_set, batch_size: int) -> tuple[RaggedStepCost, int]:
    """The ragged cost line of a tree set's per-tree step costs, at the measured batch size m nearest
    `batch_size`: each speculating tree a step of m * nodes tokens at its depth, chain:0 the plain step; returns
    (cost, m). A set's costs were timed on padded `m x N` verifies, so the line prices a ragged step by its
    tokens; with fewer than MIN_POINTS speculating points, a line through the origin at the dearest per token. A set
    calibrated through SGLang with ragged steps (`provenance["ragged_step_cost"]`, calibrate/through_sglang.ragged_cost)
    gives that fit itself, at `batch_size`."""
    fitted = set_ragged_prior(tree_set)
    if fitted is not None:
        return fitted, max(1, batch_size)
    entries = tree_set.trees
    m = min({b for e in entries for b in e.cost_seconds},
            key=lambda b: abs(math.log(b) - math.log(max(1, batch_size))))
    steps = [RaggedStep(m * e.tree.num_nodes, e.tree.max_depth, m, e.cost(m)) for e in entries
             if e.tree.max_depth > 0]
    steps += [RaggedStep(m, 0, m, e.cost(m)) for e in entries if e.tree.max_depth == 0]
    prior = None
    if len({s.point for s in steps if s.max_depth > 0}) < MIN_POINTS:
        prior = RaggedStepCost(0.0, max(s.seconds / s.total_tokens for s in steps), 0.0)
    return fit_ragged_cost(steps, prior), m
