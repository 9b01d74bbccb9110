"""Which signal should pick the tree? A replay study on the shipped calibration records (no decoding).

    .venv/bin/python bench/experiments/signals.py        # under a minute; writes bench/results/signals.{json,md}

For every shipped (drafter, task) record file (greedy decoding of the calibration prompts: each
position's drafter entropy and margin, target entropy, and the rank vector of the true continuation):

* the Pearson correlation of each signal with the accepted chain length;
* a two-fold cross-validated replay, split by prompt: on one half, split the signal into quantile bins
  and keep, per bin, the tree with the most expected tokens per second (the calibration's own greedy
  trees and the chains, costed with the set's batch-1 step-cost model); replay greedy decoding of the
  other half with that policy. Reported relative to the best single tree in hindsight on the replayed
  half (static-best), beside "one bin" (a static tree chosen on the other half) and the oracle (the best
  tree of the pool at every step).

This is the ceiling of any policy that maps one scalar signal to a tree: the replay has no timing noise
and no hysteresis, and the policy sees each signal exactly as calibration recorded it.

Where the records carry per-depth draft probabilities (`entmtp calibrate ... --records-only` records them),
the same folds also replay the per-node acceptance predictor (tree/acceptance.py, fitted on the other
half): each step takes the tree of the pool with the most (expected accepted length + 1) / cost, where
the expected length sums, over the tree's nodes, the product of calibrated acceptance along the path.
Two variants: `predictor` uses the draft probabilities of every depth (what Medusa's heads give before
any tree is drafted), `predictor-d1` only the depth-1 distribution (what a sequential drafter, Hydra or
EAGLE, knows before drafting; deeper nodes use the predictor's per-depth table). `staged` chooses as
predictor-d1 does, then after each drafted level re-chooses among the prefixes of its tree in the pool with
the drafted nodes' own probabilities (the `entmtp-staged` policy; the records tell a node's probability only
where its parent is on the true continuation, the predictor's table stands in elsewhere; levels drafted
for nothing are charged at the set's per-depth cost). `corr` columns: the Pearson correlation of the
predicted with the accepted length of the deepest chain.

Two bounds sit between the policies and the oracle: the best tree per exact value (fitted on the other
half) of the sibling rank the target takes at depth 1 (`knows depth-1 rank`), or of the deepest chain's
accepted length (`knows chain length`, a perfect scalar signal). No policy knows either before verifying;
they say how much a better predictor of that one quantity could gain.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from entmtp_sglang.calibrate.build import pearson, signals_of
from entmtp_sglang.calibrate.costs import cost_models_of
from entmtp_sglang.calibrate.records import load_records
from entmtp_sglang.calibrate.replay import simulate
from entmtp_sglang.policy.controller import RequestInput, StageInput, TreeController
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.acceptance import fit_predictor
from entmtp_sglang.tree.construct import accepted_on, greedy_tree
from entmtp_sglang.tree.records import PositionRecord
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet, load_tree_set

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("code", "math", "chat", "prose", "json", "json-grammar", "mixed")
BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
BINS = (2, 4, 8)


def replay(records: list[PositionRecord], choose, cost) -> float:
    """Tokens per second of greedy decoding of the recorded prompts (`calibrate.simulate`), with
    `choose(record) -> Tree` at every step and `cost(tree)` seconds per step."""
    entries: dict[tuple[int, ...], TreeEntry] = {}

    def pick(record, history):
        t = choose(record)
        t, seconds = t if isinstance(t, tuple) else (t, cost(t))  # a staged choice says what its step cost
        if (t.parents, seconds) not in entries:
            entries[(t.parents, seconds)] = TreeEntry(t, (0.0,), {1: seconds})
        return entries[(t.parents, seconds)]

    tokens, _, seconds = simulate(records, pick)
    return tokens / seconds


def best_tree(ranks: list, pool: dict, depth: int, max_rank: int, cost) -> Tree:
    cands = dict(pool)
    for n in BUDGETS:
        t = greedy_tree(ranks, n, depth, max_rank)
        cands.setdefault(t.parents, t)
    return max(cands.values(), key=lambda t: (sum(accepted_on(t, r) for r in ranks) / max(1, len(ranks)) + 1)
               / cost(t))


def drafted_probs(tree: Tree, rec: PositionRecord, depth: int) -> list[float | None]:
    """What a staged decision knows after drafting `tree` down to `depth`, as far as the record tells: a node's
    own draft probability where its parent lies on the true continuation (the record keeps the drafter's top-k
    there), None elsewhere (the predictor's table stands in)."""
    out: list[float | None] = [1.0] + [None] * (tree.num_nodes - 1)
    on_path = [True] + [False] * (tree.num_nodes - 1)
    for n in range(1, tree.num_nodes):
        d, r, p = tree.depths[n], tree.sibling_rank[n], tree.parents[n]
        on_path[n] = on_path[p] and d <= len(rec.ranks) and rec.ranks[d - 1] == r
        if d <= depth and on_path[p] and d <= len(rec.draft_probs) and r < len(rec.draft_probs[d - 1]):
            out[n] = rec.draft_probs[d - 1][r]
    return out


def staged_choice(pred, pool: dict, cost, per_depth: float):
    """The staged policy for replay: `TreeController` on the pool (costs from `cost`, drafting levels at
    `per_depth`, no hysteresis or feedback) chooses on the depth-1 probabilities, then `restage`s after each
    drafted level with what the record tells of the drafted nodes. Returns record -> (tree, the step's seconds)."""
    entries = tuple(TreeEntry(t, (0.0,), {1: cost(t)}) for t in pool.values())
    model = {"step_cost_model": {"1": {"per_depth": per_depth}}}
    ts = TreeSet("replay", "eagle", "replay", "draft_margin", (), entries, provenance=model)
    controller = TreeController(ts, hysteresis=0.0, feedback=False, predictor=pred, max_rest=0)

    def choose(rec: PositionRecord):
        d1 = tuple(rec.draft_probs[:1][0]) if rec.draft_probs else ()
        idx = controller.choose([RequestInput("r", 0.0, d1)], group="r")
        depth = 1
        while depth < ts.trees[idx].tree.max_depth:
            depth += 1
            drafted = tuple(drafted_probs(ts.trees[idx].tree, rec, depth))
            idx, _ = controller.restage(idx, [StageInput("r", d1, drafted)], depth)
        tree = ts.trees[idx].tree
        return tree, cost(tree) + per_depth * max(0, depth - max(tree.max_depth, 1))
    return choose


def fold_policy(values: list[float], train: list[int], records, bins: int, pool, depth, max_rank, cost):
    """Quantile bins of the signal on `train`; per bin the best tree; returns record -> Tree."""
    s = sorted(values[i] for i in train)
    edges = sorted({s[min(len(s) - 1, len(s) * q // bins)] for q in range(1, bins)})
    groups: list[list] = [[] for _ in range(len(edges) + 1)]
    for i in train:
        groups[bisect.bisect_right(edges, values[i])].append(records[i].ranks)
    trees = [best_tree(g, pool, depth, max_rank, cost) for g in groups]
    value_of = {(r.prompt, r.pos): v for r, v in zip(records, values)}
    return lambda rec: trees[bisect.bisect_right(edges, value_of[(rec.prompt, rec.pos)])]


def group_policy(key, train: list[int], records, pool, depth, max_rank, cost):
    """A bound, not a policy one can run: per exact value of `key(record)` (something a policy cannot know
    before verifying) the best tree on `train`; returns record -> Tree."""
    groups: dict = {}
    for i in train:
        groups.setdefault(key(records[i]), []).append(records[i].ranks)
    fallback = best_tree([records[i].ranks for i in train], pool, depth, max_rank, cost)
    trees = {k: best_tree(g, pool, depth, max_rank, cost) for k, g in groups.items()}
    return lambda rec: trees.get(key(rec), fallback)


# Bounds: what a policy would gain if it knew, before drafting, ...
KNOWS = {
    "knows depth-1 rank": lambda rec: min(rec.ranks[0], 6) if rec.ranks else -1,  # which sibling depth 1 takes
    "knows chain length": lambda rec: rec.chain_accepted,  # the accepted length of the deepest chain
}


def study(records: list[PositionRecord], cost, window: int = 8, max_rank: int = 6, per_depth: float = 0.0) -> dict:
    depth = max(len(r.ranks) for r in records)
    sig = signals_of(records, window)
    acc = [float(r.chain_accepted) for r in records]
    out = {"positions": len(records), "correlation": {k: round(pearson(v, acc), 3) for k, v in sig.items()}}
    prompts = sorted({r.prompt for r in records})
    fold_of = {p: k % 2 for k, p in enumerate(prompts)}
    ratios: dict[str, list[float]] = {}
    for fold in (0, 1):
        test = [i for i, r in enumerate(records) if fold_of[r.prompt] == fold]
        train = [i for i, r in enumerate(records) if fold_of[r.prompt] != fold]
        sub = [records[i] for i in test]
        pool = {Tree.chain(d).parents: Tree.chain(d) for d in range(depth + 1)}
        for n in BUDGETS:
            t = greedy_tree([records[i].ranks for i in train], n, depth, max_rank)
            pool.setdefault(t.parents, t)
        static_best = max(replay(sub, lambda rec, t=t: t, cost) for t in pool.values())
        oracle = replay(sub, lambda rec: max(pool.values(), key=lambda t: (accepted_on(t, rec.ranks) + 1) / cost(t)),
                        cost)
        ratios.setdefault("oracle", []).append(oracle / static_best)
        for name, key in KNOWS.items():
            bound = group_policy(key, train, records, pool, depth, max_rank, cost)
            ratios.setdefault(name, []).append(replay(sub, bound, cost) / static_best)
        one = fold_policy([0.0] * len(records), train, records, 1, pool, depth, max_rank, cost)
        ratios.setdefault("one bin", []).append(replay(sub, one, cost) / static_best)
        if all(r.draft_probs for r in records):
            pred = fit_predictor([records[i] for i in train], max_depth=depth, max_rank=max_rank)
            chain = Tree.chain(depth)
            views = (("predictor", lambda rec: rec.draft_probs), ("predictor-d1", lambda rec: rec.draft_probs[:1]))
            for name, view in views:
                def choose(rec, view=view):
                    probs = view(rec)
                    return max(pool.values(), key=lambda t: (pred.expected_accepted(t, probs) + 1) / cost(t))
                ratios.setdefault(name, []).append(replay(sub, choose, cost) / static_best)
                predicted = [pred.expected_accepted(chain, view(r)) for r in sub]
                ratios.setdefault(f"corr {name}", []).append(pearson(predicted, [float(r.chain_accepted) for r in sub]))
            ratios.setdefault("staged", []).append(
                replay(sub, staged_choice(pred, pool, cost, per_depth), cost) / static_best)
        for name, values in sig.items():
            for bins in BINS:
                pol = fold_policy(values, train, records, bins, pool, depth, max_rank, cost)
                ratios.setdefault(f"{name}/{bins}", []).append(replay(sub, pol, cost) / static_best)
    out["vs_static_best"] = {k: round(statistics.fmean(v), 3) for k, v in ratios.items()}
    return out


def markdown(results: dict) -> str:
    signals = ("draft_entropy", "draft_margin", "target_window", "target_ema")
    lines = ["| drafter | task | positions | corr: " + " | ".join(signals) + " | oracle | one bin | "
             + " | ".join(f"{s}/4" for s in signals) + " | best scalar | predictor | predictor-d1 | staged | "
             "corr: predictor / d1 | predictor's share of the oracle's headroom | bound: knows depth-1 rank | "
             "bound: knows chain length |",
             "|---|---|---|" + "---|" * (2 * len(signals) + 10)]
    for key, r in results.items():
        d, t = key.split("/", 1)
        v = r["vs_static_best"]
        per = {k: x for k, x in v.items() if "/" in k}
        best = max(per, key=per.get)
        pred = lambda k: f"{v[k]:.2f}x" if k in v else "-"  # noqa: E731
        corr = (f"{v['corr predictor']:+.2f} / {v['corr predictor-d1']:+.2f}" if "corr predictor" in v else "-")
        share = (f"{(max(v['predictor'], v['predictor-d1']) - 1) / (v['oracle'] - 1):.0%}"
                 if "predictor" in v and v["oracle"] > 1 else "-")
        lines.append(f"| {d} | {t} | {r['positions']} | "
                     + " | ".join(f"{r['correlation'].get(s, float('nan')):+.2f}" for s in signals)
                     + f" | {v['oracle']:.2f}x | {v['one bin']:.2f}x | "
                     + " | ".join(f"{v[f'{s}/4']:.2f}x" if f"{s}/4" in v else "-" for s in signals)
                     + f" | {best} {per[best]:.2f}x | {pred('predictor')} | {pred('predictor-d1')} | "
                     f"{pred('staged')} | {corr} "
                     f"| {share} | {pred('knows depth-1 rank')} | {pred('knows chain length')} |")
    lines += ["", "corr: Pearson correlation with the accepted chain length. Other columns: cross-validated replay "
              "tokens/s relative to static-best in hindsight (see the script's docstring); `/4` = 4 quantile "
              "bins; best scalar = the best signal and bin count (2, 4 or 8); predictor: the per-node "
              "acceptance predictor with every depth's draft probabilities, predictor-d1 with the depth-1 "
              "distribution only (its corr: predicted vs accepted length of the deepest chain); staged: "
              "predictor-d1's choice re-chosen among its prefixes after each drafted level. Bounds (no policy can "
              "know these before verifying): the best tree per exact value, on the other half, of the rank the "
              "target takes among the depth-1 drafts, or of the deepest chain's accepted length."]
    means = {}
    for r in results.values():
        for k, x in r["vs_static_best"].items():
            if not k.startswith("corr"):
                means.setdefault(k, []).append(x)
    order = sorted(means, key=lambda k: -statistics.fmean(means[k]))
    lines += ["", "Mean over cells: " + ", ".join(f"{k} {statistics.fmean(means[k]):.3f}x ({len(means[k])} cells)"
                                                  for k in order) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="entmtp-tiny",
                    help="whose shipped tree sets and records: entmtp-tiny (default) or smollm2-135m-instruct")
    ap.add_argument("--drafters", nargs="+", default=None,
                    help="default: hydra medusa (entmtp-tiny); eagle hydra medusa (other models)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/signals (entmtp-tiny) or bench/results/signals_<model>")
    ap.add_argument("--plain-step", nargs="+", default=None, metavar="[DRAFTER=]SECONDS",
                    help="price chain:0 at this measured step (seconds; per drafter as eagle=0.07) where a set's "
                         "cost model has no measured chain:0 of its own (sets calibrated before chain:0 was "
                         "measured apart from the line)")
    args = ap.parse_args(argv)
    model = "smollm2-135m-instruct" if args.model == "smollm2" else args.model
    drafters = args.drafters or (["hydra", "medusa"] if model == "entmtp-tiny" else ["eagle", "hydra", "medusa"])
    args.out = args.out or ROOT / "bench" / "results" / ("signals" if model == "entmtp-tiny" else f"signals_{model}")
    plain_steps: dict[str | None, float] = {}
    for item in args.plain_step or ():
        key, _, value = item.rpartition("=")
        try:
            plain_steps[key or None] = float(value)
        except ValueError:
            ap.error(f"--plain-step {item!r}: expected SECONDS or DRAFTER=SECONDS")
    results = {}
    for drafter in drafters:
        for task in args.tasks:
            path = ROOT / "trees" / f"{model}-{drafter}-{task}.json"
            if not path.exists():
                continue
            ts = load_tree_set(path, drafter=drafter)
            cost = cost_models_of(ts)[1]
            plain = plain_steps.get(drafter, plain_steps.get(None))
            if plain and not cost.plain:
                cost = dataclasses.replace(cost, plain=plain)
            results[f"{drafter}/{task}"] = study(load_records(path.with_suffix(".records.jsonl")), cost,
                                                 per_depth=cost.per_depth)
            print(f"{drafter}/{task}: {results[f'{drafter}/{task}']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
