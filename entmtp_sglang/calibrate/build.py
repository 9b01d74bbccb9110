"""Building a tree set from calibration records: the signal that best predicts acceptance, its quantile bins,
per bin and node budget the tree that maximises the empirical expected accepted length, and of those the trees
on some bin's Pareto frontier (step cost vs. expected tokens per step) or with some bin's best value, with
their step costs (`costs.py`) and the per-node acceptance predictor."""

from __future__ import annotations

import bisect
import math
import statistics
from pathlib import Path

from ..costs import provenance
from ..model.load import Bundle
from ..policy.signals import SIGNAL_KINDS, recorded_signal
from ..tree import Tree
from ..tree.acceptance import fit_predictor
from ..tree.construct import expected_accepted, greedy_tree, pareto_front
from ..tree.records import PositionRecord
from ..tree.treeset import TreeEntry, TreeSet
from .costs import COST_BATCHES, StepCostModel, cost_models_of, step_cost_models
from .records import CalibrationConfig, load_records

BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)


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


def build_tree_set(bundle: Bundle | None, records: list[PositionRecord], prompts: list[list[int]],
                   cfg: CalibrationConfig, log=print, signal: str | None = None,
                   models: dict[int, StepCostModel] | None = None,
                   cost_source: dict | None = None, model_name: str | None = None,
                   hardware_name: str | None = None) -> tuple[TreeSet, dict]:
    """`signal` forces the bins' signal (default: the one that best predicts acceptance); `models` reuses
    step-cost models per batch size instead of measuring them (their batch sizes are the set's); `cost_source`
    says where given models came from (a cost table: `cost_table.step_cost_models_from_table`), recorded as
    the set's hardware. Without a `bundle` (records from an SGLang server: `through_sglang.py`) `models`,
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
                                   else provenance.hardware()),
        provenance=provenance.calibrated(len(prompts), len(records), cfg.max_new_tokens, cfg.max_rank, corr,
                                         [len(b) for b in bins], models, cost_source),
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
    return provenance.amended(ts, {"rule": "entmtp-paper"}, predictor=None)


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
