"""Calibration: from a task's calibration prompts to a tree set of Pareto-optimal trees.

    entmtp calibrate --drafter medusa --task code

1. Decode the calibration prompts greedily; at every position record the drafter's entropy and top-1
   margin for the next position, the target's entropy, and the rank vector of the true continuation
   (see `tree.construct`).
2. Pick the signal that best predicts acceptance (largest |correlation| with the accepted chain length;
   `policy/signals.py`) and split its range into quantile bins.
3. Per bin and node budget, build the tree that maximises the empirical expected accepted length.
4. Measure the step time of the candidate trees in situ (real engine steps, all trees interleaved
   step by step so they share the machine's conditions; batch 1, 8, 32), fit
   seconds = base + per_node * nodes + per_depth * depth, keep the trees that lie on some bin's Pareto
   frontier (cost vs. expected tokens per step) or are some bin's best value, and write the tree set
   with the fitted costs (+ a Pareto plot). With a measured cost table (`--cost-table`, `cost_table.py`)
   the step times of the same grid come from the table (another machine, e.g. a GPU) instead.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine.engine import Engine, static_chooser
from .model.load import Bundle
from .policy.signals import SIGNAL_KINDS, entropy_nats, recorded_signal, top_margin, top_probs
from .tree import Tree
from .tree.acceptance import fit_predictor
from .tree.construct import accepted_on, expected_accepted, greedy_tree, pareto_front
from .tree.records import PositionRecord
from .tree.treeset import TreeEntry, TreeSet

BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
COST_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class CalibrationConfig:
    drafter: str
    task: str
    num_prompts: int = 24
    max_new_tokens: int = 96
    max_depth: int = 5
    max_rank: int = 6
    num_bins: int = 4
    batch_size: int = 8
    max_trees: int = 8
    window: int = 8

    def __post_init__(self):
        if self.num_prompts < 1 or self.max_new_tokens < 2:
            raise ValueError("need at least one prompt and two new tokens")
        if not 1 <= self.max_depth <= 16 or not 1 <= self.max_rank <= 32:
            raise ValueError("max_depth must be in 1..16 and max_rank in 1..32")
        if self.num_bins < 1:
            raise ValueError("num_bins must be >= 1")


def _ranks(logits: torch.Tensor, true: torch.Tensor, max_rank: int) -> torch.Tensor:
    """Rank of true[b] in logits[b] (number of strictly larger logits), capped at max_rank."""
    valid = true >= 0
    own = logits.gather(1, true.clamp(min=0).view(-1, 1))
    rank = (logits > own).sum(1)
    return torch.where(valid, rank.clamp(max=max_rank), torch.full_like(rank, max_rank))


def record_positions(bundle: Bundle, prompts: list[list[int]], cfg: CalibrationConfig, progress=None,
                     make_grammars=None) -> list[PositionRecord]:
    """`make_grammars(indices)`, if given, returns fresh `RequestGrammar`s (or None) for those prompts:
    decoding is then constrained and ranks and entropies are taken after the grammar mask."""
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    out: list[PositionRecord] = []
    plain = Tree.chain(0)
    for start in range(0, len(prompts), cfg.batch_size):
        batch = prompts[start:start + cfg.batch_size]
        idx = list(range(start, start + len(batch)))
        grammars = make_grammars(idx) if make_grammars else None
        outputs = [r.output_ids for r in engine.generate(batch, cfg.max_new_tokens, static_chooser(plain),
                                                         grammars=grammars)]
        grammars = make_grammars(idx) if make_grammars else [None] * len(batch)
        rows: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        plens = [len(p) for p in batch]

        def observer(state, lens, drafting, active):
            k = min(cfg.max_depth, drafting.max_depth)
            true = torch.full((len(batch), k), -1, dtype=torch.int64)
            for i in range(len(batch)):
                g = int(lens[i]) - plens[i]
                cont = outputs[i][g + 1:g + 1 + k]
                true[i, :len(cont)] = torch.tensor(cont, dtype=torch.int64)
            logits = drafting.path_logits(state, true)
            for i, g in enumerate(grammars):
                if g is not None and active[i]:  # rank among the tokens the grammar allows
                    for d in range(k):
                        prefix = [t for t in true[i, :d].tolist() if t >= 0]
                        logits[d][i] = logits[d][i].masked_fill(~g.path_mask(prefix), float("-inf"))
            ranks = torch.stack([_ranks(logits[d], true[:, d], cfg.max_rank) for d in range(k)], 1)
            ent, margin = entropy_nats(logits[0]), top_margin(logits[0])
            top = torch.stack([top_probs(logits[d], cfg.max_rank) for d in range(k)], 1)  # (B, k, max_rank)
            for i in range(len(batch)):
                if active[i]:
                    probs = tuple(tuple(round(p, 3) for p in row) for row in top[i].tolist())
                    rows[(i, int(lens[i]) - plens[i])] = (float(ent[i]), float(margin[i]), tuple(ranks[i].tolist()),
                                                          probs)

        results = engine.generate(batch, cfg.max_new_tokens, static_chooser(plain), observer=observer,
                                  grammars=grammars)
        for i, r in enumerate(results):
            assert r.output_ids == outputs[i], "greedy decoding is not deterministic"
            for s, step in enumerate(r.steps):
                d_ent, margin, ranks, probs = rows[(i, s)]
                out.append(PositionRecord(start + i, s, d_ent, step.target_entropy[0], ranks, margin, probs))
        if progress is not None:
            progress.update(len(batch))
    return out


def signals_of(records: list[PositionRecord], window: int) -> dict[str, list[float]]:
    """Each registered signal (policy/signals.py) at each record, computed only from what the engine would
    know at that step."""
    by_prompt: dict[int, list[PositionRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt, []).append(r)
    out: dict[str, list[float]] = {name: [] for name in SIGNAL_KINDS}
    for r in records:
        prev = [x.target_entropy for x in by_prompt[r.prompt][max(0, r.pos - 4 * window):r.pos]]
        for name, kind in SIGNAL_KINDS.items():
            out[name].append(recorded_signal(kind, r, prev, window))
    for name in list(out):
        if any(math.isnan(v) for v in out[name]):  # records saved before margins were recorded
            del out[name]
    return out


def pearson(x: list[float], y: list[float]) -> float:
    if len(x) < 3:
        return 0.0
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    if sx == 0 or sy == 0:
        return 0.0
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy)


def quantile_edges(values: list[float], bins: int) -> tuple[float, ...]:
    s = sorted(values)
    edges = []
    for q in range(1, bins):
        e = s[min(len(s) - 1, int(len(s) * q / bins))]
        if not edges or e > edges[-1]:
            edges.append(e)
    return tuple(edges)


_COST_CACHE: dict[tuple, float] = {}


def measure_cost(bundle: Bundle, tree: Tree, prompts: list[list[int]], batch_size: int,
                 steps: int = 12) -> float:
    """Median wall time of one engine step (draft + verify + commit) with this tree.

    Cached per (model, drafter, tree, batch size) within a process: cost depends on the shape, not the task."""
    key = (str(bundle.path), bundle.drafter_kind, tree.parents, batch_size)
    if key not in _COST_CACHE:
        _COST_CACHE[key] = _measure_cost(bundle, tree, prompts, batch_size, steps)
    return _COST_CACHE[key]


def _measure_cost(bundle: Bundle, tree: Tree, prompts: list[list[int]], batch_size: int, steps: int) -> float:
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, None)
    batch = [prompts[i % len(prompts)] for i in range(batch_size)]
    # force `steps` steps: each step emits at most depth + 1 tokens, so ask for enough tokens
    res = engine.generate(batch, steps * (tree.max_depth + 1) + 1, static_chooser(tree))
    times = [s.seconds for s in res[0].steps[2:steps + 2]] or [s.seconds for s in res[0].steps]
    return statistics.median(times)


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


def cost_grid(max_depth: int, max_nodes: int = 32) -> list[Tree]:
    """Trees that vary the node count and the depth independently (a chain with extra root children),
    so the fit can separate per-node (verification width) from per-depth (sequential drafting) cost."""
    out = {}
    for d in range(max_depth + 1):
        for n in sorted({d + 1, 8, 16, max_nodes}):
            if n >= d + 1 and (d > 0 or n == 1):
                parents = (-1,) + tuple(range(d)) + (0,) * (n - d - 1)
                out[parents] = Tree(parents, name=f"grid:n{n}d{d}")
    return list(out.values())


def cost_models_of(tree_set: TreeSet) -> dict[int, StepCostModel]:
    """The step-cost models a calibrated set recorded in its provenance, per batch size."""
    raw = tree_set.provenance.get("step_cost_model")
    if not raw:
        raise ValueError(f"tree set {tree_set.drafter}/{tree_set.task} records no step-cost model")
    return {int(b): StepCostModel.from_json(m) for b, m in raw.items()}


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
            _STEP_COST_CACHE[key] = fit_step_cost(grid, [medians[t.parents] for t in grid])
            log(f"batch {bsz}: step seconds ~ {_STEP_COST_CACHE[key].to_json()} (in situ, {len(grid)} trees)")
        out[bsz] = _STEP_COST_CACHE[key]
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware() -> str:
    return f"{platform.machine()} {platform.processor() or 'cpu'}, torch threads {torch.get_num_threads()}"


def build_tree_set(bundle: Bundle | None, records: list[PositionRecord], prompts: list[list[int]],
                   cfg: CalibrationConfig, log=print, signal: str | None = None,
                   models: dict[int, StepCostModel] | None = None,
                   cost_source: dict | None = None, model_name: str | None = None,
                   hardware_name: str | None = None) -> tuple[TreeSet, dict]:
    """`signal` forces the bins' signal (default: the one that best predicts acceptance); `models` reuses
    step-cost models per batch size instead of measuring them (their batch sizes are the set's); `cost_source`
    says where given models came from (a cost table: `cost_table.step_cost_models_from_table`), recorded as
    the set's hardware. Without a `bundle` (records from an SGLang server: `calibrate_sglang.py`) `models`,
    `model_name` and `hardware_name` are required. A rank of -1 in a record (not observed) counts as a miss."""
    if bundle is None and (models is None or model_name is None):
        raise ValueError("build_tree_set without a bundle needs step-cost models and the model's name")
    batches = tuple(sorted(models)) if models else COST_BATCHES
    depth = min(cfg.max_depth, max(len(r.ranks) for r in records))
    sig = signals_of(records, cfg.window)
    acc = [float(r.chain_accepted) for r in records]
    corr = {k: round(pearson(v, acc), 3) for k, v in sig.items()}
    if signal is None:
        # the bins hold empirical trees, so the sign does not matter: take the most informative signal
        signal = max(corr, key=lambda k: (abs(corr[k]), k == "draft_entropy"))
    elif signal not in sig:
        raise ValueError(f"signal {signal!r} is not in these records (they have {sorted(sig)})")
    log(f"correlation of each signal with chain acceptance: {corr}; using {signal}")
    edges = quantile_edges(sig[signal], cfg.num_bins)
    bins = [[] for _ in range(len(edges) + 1)]
    import bisect

    for r, v in zip(records, sig[signal]):
        bins[bisect.bisect_right(edges, v)].append(tuple(cfg.max_rank if x < 0 else x for x in r.ranks))

    cands: dict[tuple[int, ...], Tree] = {(-1,): Tree.chain(0)}
    for b, recs in enumerate(bins):
        for n in BUDGETS:
            t = greedy_tree(recs, n, depth, cfg.max_rank)
            cands.setdefault(t.parents, Tree(t.parents, name=f"b{b}n{t.num_nodes}d{t.max_depth}"))
    for d in range(1, depth + 1):
        cands.setdefault(Tree.chain(d).parents, Tree.chain(d))
    trees = list(cands.values())
    log(f"{len(trees)} candidate trees; step costs from the "
        f"{'cost table ' + cost_source['table'] if cost_source else 'in-situ model'}")
    models = models or step_cost_models(bundle, prompts, batches, depth, log)
    value = {id(t): [[(expected_accepted(t, recs) + 1) / models[bsz](t) for bsz in batches]
                     for recs in bins] for t in trees}
    keep: set[int] = set()
    for b, recs in enumerate(bins):
        points = [(models[1](t), expected_accepted(t, recs) + 1) for t in trees]
        front = pareto_front(points)
        for j in range(len(batches)):  # the best value in this bin at each batch size
            keep.add(max(range(len(trees)), key=lambda i: value[id(trees[i])][b][j]))
        # and the frontier members with the best value at batch 1
        front.sort(key=lambda i: -value[id(trees[i])][b][0])
        keep.update(front[:2])
    keep.discard(0)  # chain:0 (candidate 0) is added below: every set can back off to plain decoding
    chosen = sorted(keep, key=lambda i: trees[i].num_nodes)
    if len(chosen) > cfg.max_trees - 1:
        chosen = sorted(chosen, key=lambda i: -max(max(v) for v in value[id(trees[i])]))[:cfg.max_trees - 1]
    chosen = [0] + chosen
    entries = []
    for i in sorted(chosen, key=lambda i: trees[i].num_nodes):
        t = trees[i]
        costs = {bsz: models[bsz](t) for bsz in batches}
        entries.append(TreeEntry(t, tuple(expected_accepted(t, recs) for recs in bins), costs))
    all_points = {
        "trees": [{"name": t.name, "nodes": t.num_nodes, "cost1": models[1](t),
                   "expected": [expected_accepted(t, recs) + 1 for recs in bins]} for t in trees],
        "kept": [trees[i].name for i in chosen],
    }
    ts = TreeSet(
        model=model_name or bundle.path.name, drafter=bundle.drafter_kind if bundle else cfg.drafter,
        task=cfg.task, signal=signal,
        bin_edges=edges, trees=tuple(entries),
        hardware=hardware_name or (f"{cost_source['device']} (cost table {cost_source['table']})" if cost_source
                                   else hardware()),
        provenance={"prompts": len(prompts), "positions": len(records), "split": "calib",
                    "max_new_tokens": cfg.max_new_tokens, "max_rank": cfg.max_rank,
                    "signal_correlations": corr, "bin_sizes": [len(b) for b in bins],
                    "step_cost_model": {str(b): m.to_json() for b, m in models.items()},
                    "step_cost_source": cost_source or "in situ",
                    "commit": git_commit(), "created": time.strftime("%Y-%m-%d %H:%M:%S")},
        predictor=(fit_predictor(records, depth, cfg.max_rank).to_json()
                   if all(r.draft_probs for r in records) else None))
    return ts, all_points


def paper_tree_set(bundle: Bundle, shipped: TreeSet, records_path: Path, window: int = 8) -> TreeSet:
    """EntMTP as arXiv 2606.27550 writes it (`entmtp-paper`): the set rebuilt from `shipped`'s calibration
    records and step-cost models, binned on the mean target entropy of the last `window` accepted positions
    (each bin keeps its best trees, chain:0 always in)."""
    cfg = CalibrationConfig(shipped.drafter, shipped.task, num_bins=shipped.num_bins, window=window)
    ts, _ = build_tree_set(bundle, load_records(records_path), [], cfg, log=lambda *a: None, signal="target_window",
                           models=cost_models_of(shipped))
    return dataclasses.replace(ts, predictor=None, provenance={**ts.provenance, "rule": "entmtp-paper"})


def plot_pareto(points: dict, ts: TreeSet, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in range(ts.num_bins):
        xs = [p["cost1"] * 1000 for p in points["trees"]]
        ys = [p["expected"][b] for p in points["trees"]]
        ax.scatter(xs, ys, s=10, alpha=0.35)
        kept = [(p["cost1"] * 1000, p["expected"][b]) for p in points["trees"] if p["name"] in points["kept"]]
        lo = "-inf" if b == 0 else f"{ts.bin_edges[b - 1]:.2f}"
        hi = "inf" if b == ts.num_bins - 1 else f"{ts.bin_edges[b]:.2f}"
        ax.plot(*zip(*sorted(kept)), marker="o", label=f"{ts.signal} in [{lo}, {hi})")
    ax.set_xlabel("step cost at batch 1 (ms, fitted)")
    ax.set_ylabel("expected tokens per step")
    ax.set_title(f"{ts.model} {ts.drafter} {ts.task}: candidate trees and kept set")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_records(records: list[PositionRecord], path: Path) -> None:
    import json

    rows = [[r.prompt, r.pos, round(r.draft_entropy, 4), round(r.target_entropy, 4), list(r.ranks),
             round(r.draft_margin, 4)]
            + ([[[round(1000 * p) for p in d] for d in r.draft_probs]] if r.draft_probs else [])
            for r in records]
    path.write_text(json.dumps(rows, separators=(",", ":")))


def load_records(path: Path) -> list[PositionRecord]:
    import json

    # [prompt, pos, draft entropy, target entropy, ranks(, draft margin(, draft probs per mille))]: older files
    # lack the margin or the per-depth probabilities
    return [PositionRecord(row[0], row[1], row[2], row[3], tuple(row[4]), *row[5:6],
                           *([_probs(row[6])] if len(row) > 6 else []))
            for row in json.loads(Path(path).read_text())]


def _probs(rows) -> tuple[tuple[float, ...], ...]:
    """Per-depth draft probabilities as saved: integers per mille (floats in files written before)."""
    return tuple(tuple(p / 1000 if isinstance(p, int) else float(p) for p in d) for d in rows)


def simulate(records: list[PositionRecord], choose) -> tuple[int, int, float]:
    """Replay greedy decoding of recorded positions with a policy `choose(record, history) -> TreeEntry`.

    Returns (tokens, steps, seconds) using each tree's measured batch-1 cost."""
    by_prompt: dict[int, list[PositionRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt, []).append(r)
    tokens = steps = 0
    seconds = 0.0
    for rows in by_prompt.values():
        pos, history = 0, []
        while pos < len(rows):
            entry = choose(rows[pos], history)
            a = accepted_on(entry.tree, rows[pos].ranks)
            a = min(a, len(rows) - pos - 1) if pos + a >= len(rows) else a
            history.append((rows[pos], a))
            tokens += a + 1
            steps += 1
            seconds += entry.cost(1)
            pos += a + 1
    return tokens, steps, seconds
