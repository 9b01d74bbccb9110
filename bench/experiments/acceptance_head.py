"""Next-best design for the per-node acceptance predictor (issue 13): a small learned acceptance head.

    .venv/bin/python bench/experiments/acceptance_head.py trees/smollm2-135m-instruct-*-*.json   # minutes, no decoding

Per depth, a logistic regression of "the target accepts the rank-r candidate, given its parent" on: the
candidate's draft probability and its depth's top-1 probability (where known: every depth for `logit-full`,
the first only for `logit-d1`), the depth-1 top-1 probability, margin and entropy, the target-entropy window
and the rank; fitted on positions whose true path stayed within the top 3 candidates. `logit-full+hist` adds
the acceptance history: how often the drafter's top-1 matched the target's token over the previous 8 positions
and at the last one (known at run time: a drafter's depth-1 guess exists at every accepted position). Compared
in the same two-fold cross-validated replay as bench/experiments/signals.py (tokens/s relative to static-best in
hindsight) with the isotonic predictor of tree/acceptance.py (`iso-full`, `iso-d1`). Prints one line per tree set
and the mean.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import torch

from entmtp_sglang.calibrate.build import signals_of
from entmtp_sglang.calibrate.costs import cost_models_of
from entmtp_sglang.calibrate.records import load_records
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.acceptance import fit_predictor
from entmtp_sglang.tree.construct import greedy_tree
from entmtp_sglang.tree.treeset import load_tree_set

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_signals", HERE / "signals.py")
signals = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(signals)
MAX_RANK = 6
HISTORY = 8


def hit_history(records) -> dict[tuple[int, int], tuple[float, float]]:
    """Per (prompt, position): the drafter's depth-1 top-1 hit rate over the previous HISTORY positions and
    whether it hit at the previous one (0.5 where there is none yet)."""
    out, hits = {}, {}
    for r in records:
        past = hits.setdefault(r.prompt, [])
        recent = past[-HISTORY:]
        out[(r.prompt, r.pos)] = (statistics.fmean(recent), recent[-1]) if recent else (0.5, 0.5)
        past.append(1.0 if r.ranks and r.ranks[0] == 0 else 0.0)
    return out


def features(rec, window: float, depth: int, rank: int, full: bool, history=None) -> list[float]:
    p1 = rec.draft_probs[0]
    f = [1.0, math.log(p1[0] + 1e-4), rec.draft_margin, rec.draft_entropy, window, float(rank == 0), float(rank == 1)]
    if history is not None:
        f += list(history[(rec.prompt, rec.pos)])
    if full or depth == 0:
        pd = rec.draft_probs[depth]
        return f + [math.log(pd[rank] + 1e-4), math.log(pd[0] + 1e-4)]
    return f + [0.0, 0.0]


def fit_head(train, windows, depth: int, full: bool, history=None):
    """Per depth: (weights, feature means, feature scales) of an L2-regularised logistic regression."""
    heads = []
    for d in range(depth):
        xs, ys = [], []
        for rec, w in zip(train, windows):
            if all(x < 3 for x in rec.ranks[:d]):
                for r in range(MAX_RANK):
                    xs.append(features(rec, w, d, r, full, history))
                    ys.append(1.0 if rec.ranks[d] == r else 0.0)
        x, y = torch.tensor(xs), torch.tensor(ys)
        mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
        mu[0], sd[0] = 0.0, 1.0
        xn = (x - mu) / sd
        weights = torch.zeros(x.shape[1], requires_grad=True)
        opt = torch.optim.LBFGS([weights], max_iter=100)

        def closure():
            opt.zero_grad()
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(xn @ weights, y)
                    + 1e-3 * (weights ** 2).sum())
            loss.backward()
            return loss

        opt.step(closure)
        heads.append((weights.detach(), mu, sd))
    return heads


def head_expected(heads, tree: Tree, rec, window: float, full: bool, history=None) -> float:
    """Sum over the tree's nodes of the product of the head's acceptance along the path."""
    prob = [1.0] * tree.num_nodes
    q: dict[tuple[int, int], float] = {}
    for n in range(1, tree.num_nodes):
        d, r = tree.depths[n] - 1, tree.sibling_rank[n]
        if d >= len(heads) or r >= MAX_RANK:
            prob[n] = 0.0
            continue
        if (d, r) not in q:
            weights, mu, sd = heads[d]
            x = (torch.tensor(features(rec, window, d, r, full, history)) - mu) / sd
            q[(d, r)] = float(torch.sigmoid(x @ weights))
        prob[n] = prob[tree.parents[n]] * q[(d, r)]
    return sum(prob) - 1.0


def study(path: Path) -> dict[str, float]:
    ts = load_tree_set(path)
    cost = cost_models_of(ts)[1]
    records = load_records(path.with_suffix(".records.jsonl"))
    window = dict(zip(((r.prompt, r.pos) for r in records), signals_of(records, 8)["target_window"]))
    history = hit_history(records)
    depth = max(len(r.ranks) for r in records)
    prompts = sorted({r.prompt for r in records})
    fold_of = {p: k % 2 for k, p in enumerate(prompts)}
    ratios: dict[str, list[float]] = {}
    for fold in (0, 1):
        test = [r for r in records if fold_of[r.prompt] == fold]
        train = [r for r in records if fold_of[r.prompt] != fold]
        pool = {Tree.chain(d).parents: Tree.chain(d) for d in range(depth + 1)}
        for n in signals.BUDGETS:
            t = greedy_tree([r.ranks for r in train], n, depth, MAX_RANK)
            pool.setdefault(t.parents, t)
        static_best = max(signals.replay(test, lambda rec, t=t: t, cost) for t in pool.values())
        iso = fit_predictor(train, depth, MAX_RANK)
        for name, view in (("iso-full", lambda r: r.draft_probs), ("iso-d1", lambda r: r.draft_probs[:1])):
            choose = lambda rec, view=view: max(  # noqa: E731
                pool.values(), key=lambda t: (iso.expected_accepted(t, view(rec)) + 1) / cost(t))
            ratios.setdefault(name, []).append(signals.replay(test, choose, cost) / static_best)
        for name, full, hist in (("logit-full", True, None), ("logit-d1", False, None),
                                 ("logit-full+hist", True, history)):
            heads = fit_head(train, [window[(r.prompt, r.pos)] for r in train], depth, full, hist)
            choose = lambda rec, heads=heads, full=full, hist=hist: max(  # noqa: E731
                pool.values(),
                key=lambda t: (head_expected(heads, t, rec, window[(rec.prompt, rec.pos)], full, hist) + 1) / cost(t))
            ratios.setdefault(name, []).append(signals.replay(test, choose, cost) / static_best)
    return {k: round(statistics.fmean(v), 3) for k, v in ratios.items()}


def main(argv=None) -> int:
    torch.set_num_threads(1)
    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:]) if not a.endswith(".records.jsonl")]
    if not paths:
        print("usage: bench/experiments/acceptance_head.py TREE_SET.json ...", file=sys.stderr)
        return 2
    means: dict[str, list[float]] = {}
    for path in paths:
        out = study(path)
        for k, v in out.items():
            means.setdefault(k, []).append(v)
        print(path.stem, out, flush=True)
    print("mean over", len(paths), "sets:", {k: round(statistics.fmean(v), 3) for k, v in means.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
