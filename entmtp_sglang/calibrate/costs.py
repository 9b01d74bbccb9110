"""Step costs: seconds of one engine step with a tree, as base + per_node * nodes + per_depth * depth per batch
size (`StepCostModel`), fitted on the step times of ONE cost grid (`cost_grid`) however they were measured: in
situ on the reference engine (`step_cost_models`), from a measured cost table (`cost_table.py`), or inside an
SGLang server (`through_sglang.py`). The online refit of a serving worker has its own estimator (`costs/online.py`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..engine.engine import Engine
from ..model.load import Bundle
from ..tree import Tree
from ..tree.treeset import TreeSet

COST_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of one engine step: base + per_node * num_nodes + per_depth * max_depth (coefficients >= 0),
    and `plain`, the measured step of chain:0 (no speculation), when known (> 0).

    per_depth carries the sequential drafting of Hydra and EAGLE (one drafter call per tree level). chain:0
    has its own figure because it is another regime, not the line's first point: on a CPU one token per row
    is a matrix-vector product, while two or more are a matrix product that costs about 1.5x as much on
    SmolLM2 and then grows slowly with the node count, so a line through every tree prices chain:0 about a
    quarter too high."""

    base: float
    per_node: float
    per_depth: float
    plain: float = 0.0

    def __call__(self, tree: Tree) -> float:
        if tree.num_nodes == 1 and self.plain > 0:
            return self.plain
        return self.base + self.per_node * tree.num_nodes + self.per_depth * tree.max_depth

    def to_json(self) -> dict:
        out = {"base": round(self.base, 7), "per_node": round(self.per_node, 7),
               "per_depth": round(self.per_depth, 7)}
        if self.plain > 0:
            out["plain"] = round(self.plain, 7)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "StepCostModel":
        return cls(float(d["base"]), float(d["per_node"]), float(d["per_depth"]), float(d.get("plain", 0.0)))


def fit_step_cost(trees: list[Tree], seconds: list[float]) -> StepCostModel:
    """chain:0's measured seconds (the median of its samples) as `plain`, and least squares of the other
    trees' seconds on (1, num_nodes, max_depth) (all trees when fewer than three others were measured); a
    coefficient that comes out negative (noise) is dropped and the rest refitted."""
    plain = [s for t, s in zip(trees, seconds) if t.num_nodes == 1]
    rest = [(t, s) for t, s in zip(trees, seconds) if t.num_nodes > 1]
    if len(rest) >= 3 and plain:
        line = fit_step_cost([t for t, _ in rest], [s for _, s in rest])
        return StepCostModel(line.base, line.per_node, line.per_depth, statistics.median(plain))
    cols = [0, 1, 2]
    feats = [[1.0, float(t.num_nodes), float(t.max_depth)] for t in trees]
    y = torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)
    while True:
        x = torch.tensor([[f[c] for c in cols] for f in feats], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y).solution.squeeze(1).tolist()
        bad = [c for c, v in zip(cols, coef) if v < 0 and c != 0]
        if not bad:
            break
        cols.remove(bad[0])
    full = dict(zip(cols, coef))
    base = max(full.get(0, 0.0), 0.25 * min(seconds))
    return StepCostModel(base, full.get(1, 0.0), full.get(2, 0.0))


def cost_grid(depth: int, widths=(1, 2, 3)) -> list[Tree]:
    """Chains of every depth with `w - 1` extra leaf candidates under each chain node (nodes = 1 + w * d):
    node count and depth vary independently (so the fit separates per-node verification width from per-depth
    sequential drafting) while every draft step expands one row, which every engine's buffers take."""
    out = [Tree.chain(0)]
    for d in range(1, depth + 1):
        for w in widths:
            parents = [-1]
            chain = 0
            for _ in range(d):
                parents.append(chain)
                nxt = len(parents) - 1
                parents += [chain] * (w - 1)
                chain = nxt
            out.append(Tree(tuple(parents), name=f"grid:w{w}d{d}"))
    return out


def fit_cost_models(grid: list[Tree], batch_sizes, seconds: Callable[[Tree, int], float | None], source: str,
                    log=print) -> dict[int, StepCostModel]:
    """`fit_step_cost` per batch size on the grid's step times, `seconds(tree, batch)` (None: not measured);
    RuntimeError when fewer than three trees were measured at a batch size. `source` says how, in the log."""
    models: dict[int, StepCostModel] = {}
    for b in batch_sizes:
        pairs = [(t, s) for t in grid if (s := seconds(t, b)) is not None]
        if len(pairs) < 3:
            raise RuntimeError(f"too few timed steps at batch size {b} to fit a step-cost model")
        models[b] = fit_step_cost([t for t, _ in pairs], [s for _, s in pairs])
        log(f"batch {b}: step seconds ~ {models[b].to_json()} ({source})")
    return models


def measure_step_costs(bundle: Bundle, trees: list[Tree], prompts: list[list[int]], batch_size: int,
                       samples_per_tree: int = 7, max_new_tokens: int = 48) -> dict[tuple[int, ...], float]:
    """Median wall time of one real engine step (draft + verify + commit, as `StepRecord.seconds`) per
    tree, in situ: one `generate` run cycles through all the trees step by step, so every tree is timed
    under the same conditions (contention, cache state, sequence length) instead of in separate loops.

    Returns {tree.parents: median seconds}."""
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, None)
    times: dict[tuple[int, ...], list[float]] = {t.parents: [] for t in trees}
    run = 0
    while min(len(v) for v in times.values()) < samples_per_tree:
        batch = [prompts[(run + i) % len(prompts)] for i in range(batch_size)]
        chosen: list[Tree] = []

        def cycle(view, run=run):
            if view.index == 0:
                chosen.append(trees[(len(view.history) + run) % len(trees)])
            return chosen[-1]

        res = engine.generate(batch, max_new_tokens, cycle)
        full = min(len(r.steps) for r in res)  # steps with the whole batch still running
        for tree, step in list(zip(chosen, res[0].steps[:full]))[1:]:  # the first step warms up
            times[tree.parents].append(step.seconds)
        run += 1
    return {k: statistics.median(v) for k, v in times.items()}


_STEP_COST_CACHE: dict[tuple, StepCostModel] = {}


def step_cost_models(bundle: Bundle, prompts: list[list[int]], batch_sizes=COST_BATCHES, max_depth: int = 5,
                     log=print) -> dict[int, StepCostModel]:
    """In-situ step-cost model per batch size, measured on `cost_grid` (cached per model and drafter
    within a process: the cost depends on the tree's shape, not on the task)."""
    out = {}
    grid = cost_grid(min(max_depth, getattr(bundle.drafter, "max_depth", max_depth)))
    for bsz in batch_sizes:
        key = (str(getattr(bundle, "path", "")), bundle.drafter_kind, bsz)
        if key not in _STEP_COST_CACHE:
            medians = measure_step_costs(bundle, grid, prompts, bsz)
            _STEP_COST_CACHE[key] = fit_cost_models(grid, [bsz], lambda t, b: medians[t.parents],
                                                    f"in situ, {len(grid)} trees", log)[bsz]
        out[bsz] = _STEP_COST_CACHE[key]
    return out


def cost_models_of(tree_set: TreeSet) -> dict[int, StepCostModel]:
    """The step-cost models a calibrated set recorded in its provenance, per batch size."""
    raw = tree_set.provenance.get("step_cost_model")
    if not raw:
        raise ValueError(f"tree set {tree_set.drafter}/{tree_set.task} records no step-cost model")
    return {int(b): StepCostModel.from_json(m) for b, m in raw.items()}
