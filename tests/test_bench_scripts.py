"""The bench scripts' own logic: bench/policies.py's table and goal count on rows written by hand, and
bench/experiments/signals.py's cross-validated replay on synthetic records (the runs themselves are benchmarks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent




@pytest.fixture(scope="module")
def policies_bench():
    return load_script("policies")


def rows(task, **tps):
    return [{"drafter": "hydra", "task": task, "policy": p, "tokens_per_s": v, "mean_accepted": 1.0,
             "repeats": [v, v * 1.1], "signal": "draft_margin"} for p, v in tps.items()]


def test_table_ratios_goals_and_ablation(policies_bench):
    data = (rows("code", **{"default-static": 80.0, "static-best": 90.0, "adaptive-ema": 85.0, "eagle2": 70.0,
                            "entmtp": 100.0, "oracle": 108.0, "entmtp-entropy": 90.0, "entmtp-paper": 94.0,
                            "entmtp-predictor": 104.0})
            + rows("mixed", **{"default-static": 80.0, "static-best": 100.0, "adaptive-ema": 100.0,
                               "eagle2": 100.0, "entmtp": 100.0, "oracle": 100.0}))
    md = policies_bench.markdown(data)
    code = next(line for line in md.splitlines() if line.startswith("| hydra | code"))
    # the default (the predictor) / default static; bins / static-best; predictor / static-best; the default /
    # paper, / adaptive, / EAGLE-2; the default's share of the oracle's headroom (14 of 18 tok/s)
    assert "| 1.30x | 1.11x | 1.16x | 1.11x | 1.22x | 1.49x | 78% |" in code
    assert "100.0 (1.00)" in code and "70.0 (1.00)" in code and "94.0 (1.00)" in code
    goals = policies_bench.goals_line(data)
    assert ("entmtp: >= 1.10x static-best in 1 of 1 task cells, >= 1.15x on the mixed stream in 0 of 1, "
            ">= half the oracle's headroom in 1 of 1, >= 1.05x entmtp-paper in 1 of 1") in goals
    assert "entmtp-predictor: >= 1.10x static-best in 1 of 1 task cells" in goals
    assert "hydra code 1.11x" in md  # the signal ablation line
    assert "EntMTP's signal per cell: hydra code draft_margin, hydra mixed draft_margin." in md
    assert "Outputs equal to plain" not in md   # rows without the check say nothing
    for r in data:
        r["equal_to_plain"] = [3, 3] if r["policy"] != "eagle2" else [2, 3]
    md = policies_bench.markdown(data)
    assert "Outputs equal to plain decoding's: 43 of 45 (policy, segment) runs." in md


def test_plain_decoding_stands_as_static_best_where_it_is_faster(policies_bench):
    """chain:0 is a static tree: where plain decoding beat the measured static trees, the goals and the ratios
    compare with plain decoding (marked *), not with the slower tree."""
    data = rows("chat", **{"plain": 100.0, "static-best": 80.0, "entmtp-predictor": 96.0, "oracle": 110.0})
    md = policies_bench.markdown(data)
    chat = next(line for line in md.splitlines() if line.startswith("| hydra | chat"))
    assert "| 100.0* (1.00) |" in chat and "| 0.96x |" in chat and "1.20x" not in chat
    assert "entmtp-predictor: >= 1.10x static-best in 0 of 1 task cells" in policies_bench.goals_line(data)
    data = rows("chat", **{"plain": 70.0, "static-best": 80.0, "entmtp-predictor": 96.0})
    assert "| 80.0 (1.00) |" in policies_bench.markdown(data)   # a faster static tree stays


def test_signal_study_finds_the_informative_signal():
    """Acceptance follows the margin exactly and the entropy not at all: binning on the margin recovers
    nearly all of the oracle's edge in replay, binning on the entropy none of it."""
    import random

    from entmtp_sglang.calibrate.costs import StepCostModel
    from entmtp_sglang.tree.records import PositionRecord

    signals = load_script("signals", "bench/experiments")
    rng = random.Random(0)
    recs = []
    for prompt in range(8):
        for pos in range(60):
            m = rng.random()
            ranks = (0, 0, 0) if m > 0.5 else (3, 3, 3)
            probs = tuple((round(m, 3), round((1 - m) / 2, 3), 0.01) for _ in range(3))
            recs.append(PositionRecord(prompt, pos, rng.uniform(0, 5), rng.uniform(0, 5), ranks, m, probs))
    out = signals.study(recs, StepCostModel(0.01, 0.001, 0.004))
    v = out["vs_static_best"]
    assert out["correlation"]["draft_margin"] > 0.8 and abs(out["correlation"]["draft_entropy"]) < 0.2
    assert v["oracle"] > 1.2
    assert v["draft_margin/2"] > 0.97 * v["oracle"]
    assert v["draft_entropy/4"] < 1.02 and v["one bin"] < 1.02
    # the per-node predictor sees the same information in the draft probabilities
    assert v["predictor"] > 0.97 * v["oracle"] and v["predictor-d1"] > 0.97 * v["oracle"]
    assert v["staged"] > 0.97 * v["oracle"]
    assert v["corr predictor"] > 0.8
    # the bounds: here the depth-1 rank and the chain length each tell the whole step
    assert v["knows depth-1 rank"] > 0.97 * v["oracle"] and v["knows chain length"] > 0.97 * v["oracle"]
    md = signals.markdown({"hydra/code": out})
    row = next(line for line in md.splitlines() if line.startswith("| hydra | code | 480 |"))
    assert row.split("|")[-9].strip().startswith("draft_margin/")  # the best scalar signal
    assert row.split("|")[-4].strip() in ("100%", "99%", "98%")  # the predictor's share of the headroom
    assert row.split("|")[-3].strip() == f"{v['knows depth-1 rank']:.2f}x"


def test_the_bounds_know_only_their_own_quantity():
    """Acceptance is decided at depth 2 (the depth-1 draft is always taken): knowing the depth-1 rank gains
    nothing over the best static tree, knowing the chain length gains the oracle's edge."""
    import random

    from entmtp_sglang.calibrate.costs import StepCostModel
    from entmtp_sglang.tree.records import PositionRecord

    signals = load_script("signals", "bench/experiments")
    rng = random.Random(1)
    recs = []
    for prompt in range(8):
        for pos in range(60):
            ranks = (0, 0, 0) if rng.random() > 0.5 else (0, 4, 4)
            probs = tuple((0.5, 0.25, 0.01) for _ in range(3))
            recs.append(PositionRecord(prompt, pos, 1.0, 1.0, ranks, 0.25, probs))
    v = signals.study(recs, StepCostModel(0.01, 0.001, 0.004))["vs_static_best"]
    assert v["oracle"] > 1.1
    assert v["knows depth-1 rank"] < 1.01
    assert v["knows chain length"] > 0.97 * v["oracle"]


def test_the_stream_oracle_starts_each_segment_on_its_own_ranks(policies_bench, random_models):
    """A mixed stream's oracle: segment 1 is plain in hindsight (it rests the drafter to the end), segment 2
    speculates from its first step (a rest left over from segment 1 must not carry into it)."""
    from entmtp_sglang.engine.engine import Engine
    from entmtp_sglang.tree import Tree
    from entmtp_sglang.tree.treeset import TreeEntry, TreeSet

    target, drafters = random_models
    entries = (TreeEntry(Tree.chain(0), (0.0,), {1: 1.0}), TreeEntry(Tree.chain(2), (1.0,), {1: 1.5}))
    ts = TreeSet("m", "eagle", "t", "draft_margin", (), entries)
    segs = [[3, 4, 5], [6, 7, 8, 9]]
    oracle = policies_bench.StreamOracle(ts, [[[5, 5]] * 20, [[0, 0]] * 20], [len(s) for s in segs])
    into = policies_bench.run_stream(Engine(target, "eagle", drafters["eagle"]), 0, segs, lambda k: oracle, 10, {})
    assert oracle.seg == 1
    assert into["trees_chosen"].get("chain:2", 0) >= 1 and into["trees_chosen"]["chain:0"] >= 1


def test_the_backoff_benchmark_serves_a_set_of_chain0_alone(tmp_path):
    from entmtp_sglang.tree.treeset import load_tree_set
    backoff = load_script("sglang_backoff", "bench/experiments")
    shipped = ROOT / "trees" / "smollm2-135m-instruct-eagle-mixed.json"
    ts = load_tree_set(backoff.chain0_only(shipped, tmp_path / "chain0.json"))
    assert [t.tree.name for t in ts.trees] == ["chain:0"]
    assert ts.trees[0].cost_seconds == load_tree_set(shipped).trees[0].cost_seconds
    assert ts.predictor is None


def test_the_mixed_stream_at_batch_1_and_4_is_summed_per_repeat_too():
    """bench/sglang_speed.py's mixed rows: tokens over seconds added up over the tasks, for the median row and for
    each repeat (every task's tokens over its seconds in that repeat), so the paired ratio covers them."""
    from entmtp_sglang.bench.sglang_benchmark import Row, paired_ratio

    speed = load_script("sglang_speed")
    rows = [Row("plain", 1, 100, 10.0, requests=4, repeat_tokens_per_s=[10.0, 5.0], task="code"),
            Row("plain", 1, 300, 10.0, requests=4, repeat_tokens_per_s=[30.0, 15.0], task="json"),
            Row("entmtp", 1, 100, 5.0, requests=4, equal_to_plain=4, repeat_tokens_per_s=[20.0, 10.0], task="code"),
            Row("entmtp", 1, 300, 15.0, requests=4, equal_to_plain=3, repeat_tokens_per_s=[20.0, 10.0],
                task="json")]
    plain, ent = speed.mixed_rows(rows, (1,))
    assert (plain.system, plain.task, plain.tokens, plain.seconds) == ("plain", "mixed", 400, 20.0)
    assert plain.repeat_tokens_per_s == [20.0, 10.0]          # 400 tokens over 10 + 10 s, then 20 + 20 s
    assert ent.repeat_tokens_per_s == [20.0, 10.0] and ent.equal_to_plain == 7 and ent.requests == 8
    assert paired_ratio(ent, plain) == 1.0


def test_the_mixed_stream_pairs_with_plain_run_beside_it_in_waves():
    """A system measured in a later wave carries plain's runs of that wave; its mixed row sums them as it sums its
    own, and the results get ENTMTP's table against the best static setting and adaptive."""
    from entmtp_sglang.bench.sglang_benchmark import Row, paired_ratio

    speed = load_script("sglang_speed")
    rows = [Row("plain", 1, 100, 10.0, requests=4, repeat_tokens_per_s=[10.0, 10.0, 5.0, 5.0], task="code"),
            Row("plain", 1, 300, 10.0, requests=4, repeat_tokens_per_s=[30.0, 30.0, 15.0, 15.0], task="json"),
            Row("entmtp", 1, 100, 5.0, requests=4, equal_to_plain=4, repeat_tokens_per_s=[20.0, 20.0], task="code",
                plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("entmtp", 1, 300, 10.0, requests=4, equal_to_plain=4, repeat_tokens_per_s=[30.0, 30.0],
                task="json", plain_repeat_tokens_per_s=[30.0, 30.0]),
            Row("eagle-s1-k1-n2", 1, 100, 10.0, requests=4, equal_to_plain=4, repeat_tokens_per_s=[5.0, 5.0],
                task="code", plain_repeat_tokens_per_s=[5.0, 5.0]),
            Row("eagle-s1-k1-n2", 1, 300, 20.0, requests=4, equal_to_plain=4, repeat_tokens_per_s=[15.0, 15.0],
                task="json", plain_repeat_tokens_per_s=[15.0, 15.0])]
    mixed = {r.system: r for r in speed.mixed_rows(rows, (1,))}
    assert mixed["entmtp"].plain_repeat_tokens_per_s == [20.0, 20.0]      # 400 tokens over 10 + 10 s
    assert paired_ratio(mixed["entmtp"], mixed["plain"]) == pytest.approx(400 / 15 / 20, abs=1e-3)
    assert paired_ratio(mixed["eagle-s1-k1-n2"], mixed["plain"]) == 1.0
    text = speed.tables(rows + list(mixed.values()))
    assert "| mixed | 1 | 1.33x (eagle-s1-k1-n2) |  |" in text, text


def test_the_readme_headline_is_the_committed_product_run():
    """The README's headline tables are what `bench/sglang_speed.py --render ... --headline` draws from the committed
    product run (bench/results/sglang_speed.jsonl.gz): a new run's file and the README change together."""
    from entmtp_sglang.bench.sglang_benchmark import meta_from_jsonl

    speed = load_script("sglang_speed")
    path = ROOT / "bench" / "results" / "sglang_speed.jsonl.gz"
    steps, systems, per_batch, *more = speed.headline(speed.rendered(path), meta_from_jsonl(path)).split("\n\n")
    readme = (ROOT / "README.md").read_text()
    assert "| rung |" in steps and "ENTMTP as served" in steps
    assert systems.count("\n") >= 3 and "**ENTMTP**" in systems and "| 1 | " in per_batch
    assert steps in readme, "README's ladder is not the committed run's:\n" + steps
    assert systems in readme, "README's systems table is not the committed run's:\n" + systems
    assert per_batch in readme, "README's per-workload headline table is not the committed run's:\n" + per_batch
    for part in more:   # what speculation adds per workload, the goals, and the prose figures of "where it stands"
        assert part in readme, "README's headline is not the committed run's:\n" + part
    assert any(part.startswith("**Where ENTMTP stands**") for part in more)


def test_the_headline_names_the_best_static_setting_and_skips_what_did_not_run():
    from entmtp_sglang.bench.sglang_benchmark import Row

    speed = load_script("sglang_speed")
    rows = [Row("plain-stock", 1, 100, 10.0, requests=4, repeat_tokens_per_s=[10.0, 10.0], task="mixed"),
            Row("entmtp", 1, 200, 10.0, requests=4, repeat_tokens_per_s=[20.0, 20.0], task="mixed",
                plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("eagle-s1-k1-n2", 1, 120, 10.0, requests=4, repeat_tokens_per_s=[12.0, 12.0], task="mixed",
                plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("eagle-s2-k1-n3", 1, 150, 10.0, requests=4, repeat_tokens_per_s=[15.0, 15.0], task="mixed",
                plain_repeat_tokens_per_s=[10.0, 10.0])]
    steps, systems, per_batch = speed.headline(rows, {"layers": {"eagle-s1-k1-n2": "sglang",
                                                                  "eagle-s2-k1-n3": "sglang"}}).split("\n\n")
    # the ladder: the rungs the run has, the best static setting by name, no gain where the rung below did not run
    assert "| SGLang EAGLE, the best static setting (`s2-k1-n3`; SGLang's own layers) |  | 15.0 |" in steps
    assert "| **ENTMTP as served** (`make serve`) |  | 20.0 |" in steps and "NGRAM" not in steps
    assert "(`s2-k1-n3`, best by the paired ratio; SGLang's own layers) | 15.0 | 1.50x (1.50x) |" in systems
    assert "| **20.0** | **2.00x (2.00x)** |" in systems
    assert "adaptive" not in systems and "plain SGLang with this package" not in systems
    # ENTMTP over the best static setting (1.5x stock): 2.0 / 1.5
    assert per_batch.splitlines()[2].startswith("| 1 |" + "  |" * 7 + " 2.00x (2.00x) |  |  |  |  | 1.33x |")


def test_the_ladder_gives_each_rung_its_paired_gain_over_the_rung_it_builds_on():
    """bench/sglang_speed.py `ladder`: every rung over the one named in LADDER (the first of them the run has),
    paired per repeat; across waves through stock (the run's baseline) where the two did not run side by side."""
    from entmtp_sglang.bench.sglang_benchmark import Row

    speed = load_script("sglang_speed")

    def row(system, tps, beside=None, stock=None, task="mixed", batch=1):
        return Row(system, batch, int(tps[0] * 10), 10.0, requests=4, repeat_tokens_per_s=list(tps), task=task,
                   plain_repeat_tokens_per_s=list(stock or []), beside=beside or {})

    stock = [10.0, 20.0]   # the machine twice as fast in repeat 2: paired ratios cancel it
    plain = [12.0, 24.0]
    rows = [row("plain-stock", stock),
            row("plain-stock-bf16", [11.0, 22.0], stock=stock),
            row("plain-entmtp", plain, stock=stock),
            row("ngram", [13.0, 24.0], beside={"plain-entmtp": plain}, stock=stock),
            row("entmtp-no-spans", [15.0, 27.0], beside={"plain-entmtp": plain}, stock=stock),
            # another wave: its own stock and plain runs, slower
            row("entmtp", [18.0, 36.0], beside={"plain-entmtp": [10.0, 20.0]}, stock=[8.0, 16.0])]
    text = speed.ladder(rows)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}
    assert lines["stock SGLang, float32"].endswith("|  | 10.0 |")
    assert "`plain-stock` | 11.0 **1.10x** |" in lines["stock SGLang, bfloat16 (what `--dtype auto` serves)"]
    # plain on entmtp_torch without the torch_native rung: its own line, over stock
    assert "`plain-stock` | 12.0 **1.20x** |" in lines[speed.LADDER_ALONE["plain-entmtp"]]
    assert "`plain-entmtp` | 13.0 **1.04x** |" in lines["SGLang NGRAM (12 draft tokens a step)"]   # (13/12, 24/24)
    assert "`plain-entmtp` | 15.0 **1.19x** |" in lines["ENTMTP, the drafter's trees only"]   # (15/12, 27/24)
    # ENTMTP (lookup-span rung missing) over the drafter-only rung, from another wave: through stock,
    # (18/8 / 1.5, 36/16 / 1.35) -> median 1.58
    assert "`entmtp-no-spans` | 18.0 **1.58x** |" in lines[speed.LADDER_ALONE["entmtp"]]
    assert speed.ladder(rows[:1]) == ""   # one rung: no ladder


def test_the_ladder_run_measures_every_rung_on_the_mixed_workloads_and_three_baselines_and_entmtp_per_task():
    """`--ladder`'s passes: every rung (NGRAM and ENTMTP's span kinds among them, EAGLE on the package's layers) on a
    mixed stream of `--ladder-per-task` prompts of each task at batch 1 and 4 and on the mixed batch, ENTMTP's rungs
    in one wave; then stock in both dtypes, plain on entmtp_torch and ENTMTP per task; then the compact layout."""
    import argparse

    from entmtp_sglang.bench.sglang_benchmark import waves

    speed = load_script("sglang_speed")
    systems = speed.systems_for(list(speed.LADDER_SYSTEMS), "package")
    assert {s.name for s in systems} == set(speed.LADDER_SYSTEMS)
    assert {s.layers for s in systems if s.speculative in ("EAGLE", "NGRAM")} == {"package"}
    tasks = {t: [{"text": f"{t} {i}"} for i in range(8)] for t in speed.TASKS}
    args = argparse.Namespace(ladder_per_task=2, per_task=8, mixed_batch_batches=(4, 16))
    work = {t: (items, (1,)) for t, items in tasks.items()}
    compact_work = {f"{t}-compact": (tasks[t], (1,)) for t in speed.COMPACT_TASKS}
    compact = [s for s in systems if s.name in speed.COMPACT_SYSTEMS]
    passes = speed.ladder_passes(systems, tasks, args, work, compact_work, compact)
    assert [p[0] for p in passes] == ["ladder", "cells", "compact"]
    label, ladder_systems, ladder_work, every = passes[0]
    assert every == ("plain-stock", "plain-entmtp")
    assert ladder_work["mixed"][1] == (1, 4) and len(ladder_work["mixed"][0]) == 2 * len(speed.TASKS)
    payloads, batches, labels = ladder_work["mixed-batch"]
    assert batches == (4, 16) and len(payloads) == 4 * len(speed.MIXED_BATCH_TASKS) and len(labels) == len(payloads)
    plan = waves(ladder_systems, 5, every)
    assert [s.name for s in plan[0]] == ["plain-stock", "plain-entmtp", "entmtp", "entmtp-no-forced", "entmtp-no-spans"]
    assert sorted(s.name for w in plan for s in w if s.name not in every) == sorted(
        set(speed.LADDER_SYSTEMS) - set(every))
    assert {s.name for s in passes[1][1]} == {"plain-stock", "plain-stock-bf16", "plain-entmtp", "entmtp"}
    assert set(passes[1][2]) == set(speed.TASKS) and {s.name for s in passes[2][1]} == set(speed.LADDER_CELL_SYSTEMS)
    with pytest.raises(SystemExit, match="--ladder-per-task 5"):
        speed.ladder_passes(systems, tasks, argparse.Namespace(ladder_per_task=5, per_task=8,
                                                               mixed_batch_batches=(4,)), work, compact_work, compact)


def test_step_profile_pairs_each_step_with_the_plain_step_of_its_repeat_and_renders_again(tmp_path):
    import json

    prof = load_script("sglang_step_profile")
    plain = {"tree": "plain", "batch": 1, "nodes": 1, "depth": 0, "step_ms": 60.0, "repeats_ms": [50.0, 60.0, 90.0],
             "decode_ms": 55.0, "decode_repeats_ms": [45.0, 55.0, 85.0]}
    rest = {"tree": "rest (chain:0)", "batch": 1, "nodes": 1, "depth": 0, "step_ms": 60.0,
            "repeats_ms": [51.0, 60.0, 60.0], "decode_ms": 55.0, "decode_repeats_ms": [45.9, 56.1, 60.0]}
    # the ratio of medians is 1.00x; within each repeat rest costs 1.02x, 1.00x and 0.67x: paired median 1.00x
    assert prof.paired(rest, plain, "repeats_ms") == pytest.approx(1.0)
    assert prof.paired(rest, plain, "decode_repeats_ms") == pytest.approx(56.1 / 55.0)
    path = tmp_path / "run.jsonl"
    stages = {"stages_of": "rest", "batch": 1, **{s: 1.0 for s in prof.STAGES}, "total_mean": 2.0}
    path.write_text("\n".join(json.dumps(r) for r in (plain, rest, stages)) + "\n")
    lines = prof.render(path)
    assert "| 1 | rest (chain:0) | 1 | 0 | 60.0 | 1.00x (1.00x) | 55.0 | 1.00x (1.02x) |" in lines
    assert "| rest | 1 | " + " | ".join("1.0" for _ in prof.STAGES) + " | 2.0 |" in lines


def test_the_product_benchmark_runs_stock_sglang_as_its_baseline_in_every_wave():
    """bench/sglang_speed.py: stock SGLang and plain with the package on entmtp_torch always run (even when --systems
    leaves them out) and stay up in every wave; ENTMTP's wave comes first, plain on torch_native last; EAGLE and
    adaptive run on SGLang's own linear layers unless asked."""
    from entmtp_sglang.bench.sglang_benchmark import waves

    speed = load_script("sglang_speed")
    specs = speed.systems_for(list(speed.DEFAULT))
    plan = waves(specs, speed.AT_ONCE, speed.EVERY_WAVE)
    base = ["plain-stock", "plain-stock-bf16", "plain-entmtp"]
    assert [[s.name for s in w] for w in plan] == [
        [*base, "entmtp", "eagle-adaptive"],
        [*base, "eagle-s1-k1-n2", "eagle-s2-k1-n3"],
        [*base, "eagle-s3-k1-n4", "eagle-s3-k2-n6"],
        [*base, "plain"]]
    by = {s.name: s for s in specs}
    assert by["plain-stock"].stock and dict(by["plain-stock"].env) == {"SGLANG_PLUGINS": "entmtp_cpu_ops"}
    # stock in bfloat16: the same stock server told to serve bfloat16 after the run's --dtype float32
    bf16 = by["plain-stock-bf16"]
    assert bf16.stock and bf16.env == by["plain-stock"].env and bf16.dtype == "bfloat16" and by["plain"].dtype is None
    args = bf16.server(Path("/tmp"), ("--dtype", "float32")).args
    assert args[len(args) - 1 - args[::-1].index("--dtype") + 1] == "bfloat16"
    assert {n: s.layers for n, s in by.items()} == {"plain-stock": "sglang", "plain-stock-bf16": "sglang",
                                                    "plain": "package", "entmtp": "package",
                                                    "plain-entmtp": "package",
                                                    **{n: "sglang" for n in by if n.startswith("eagle-")}}
    assert [s.name for s in speed.systems_for(["entmtp"])] == ["plain-stock", "plain-stock-bf16", "plain-entmtp",
                                                               "entmtp"]
    package = {s.name: s.layers for s in speed.systems_for(["eagle-adaptive"], "package")}
    assert package == {"plain-stock": "sglang", "plain-stock-bf16": "sglang", "plain-entmtp": "package",
                       "eagle-adaptive": "package"}
    # --compare-draft: ENTMTP on another drafter's weights, in ENTMTP's wave, the folder given in full
    compared = speed.with_compare_draft(speed.systems_for(["plain", "entmtp"]), Path("some/eagle"))
    assert [s.name for s in compared] == [*base, "entmtp", "entmtp-compare-draft", "plain"]
    assert compared[4].speculative == "ENTMTP" and compared[4].draft == str(Path("some/eagle").resolve())
    assert compared[4].env == ()
    other = speed.with_compare_draft([], Path("x"), Path("old-set.json"))[0]
    assert other.name == "entmtp-compare-draft"
    assert dict(other.env) == {"ENTMTP_TREE_SET": str(Path("old-set.json").resolve())}


def test_the_mixed_stream_and_the_tables_divide_by_stock_when_the_run_has_it():
    """With stock rows the mixed rows pair with stock's runs (stock's tokens over its seconds beside each repeat),
    sum the outputs equal to stock, and the tables say the ratios are over stock."""
    from entmtp_sglang.bench.sglang_benchmark import Row, paired_ratio

    speed = load_script("sglang_speed")
    rows = [Row("plain-stock", 1, 100, 10.0, requests=4, repeat_tokens_per_s=[10.0, 10.0], task="code",
                equal_to_plain=4),
            Row("plain-stock", 1, 300, 10.0, requests=4, repeat_tokens_per_s=[30.0, 30.0], task="json",
                equal_to_plain=3),
            Row("plain", 1, 100, 5.0, requests=4, repeat_tokens_per_s=[20.0, 20.0], task="code",
                plain_repeat_tokens_per_s=[10.0, 10.0], equal_to_stock=4),
            Row("plain", 1, 300, 5.0, requests=4, repeat_tokens_per_s=[60.0, 60.0], task="json",
                plain_repeat_tokens_per_s=[30.0, 30.0], equal_to_stock=3),
            Row("entmtp", 1, 100, 5.0, requests=4, equal_to_plain=4, equal_to_stock=4,
                repeat_tokens_per_s=[20.0, 20.0], task="code", plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("entmtp", 1, 300, 10.0, requests=4, equal_to_plain=4, equal_to_stock=2,
                repeat_tokens_per_s=[30.0, 30.0], task="json", plain_repeat_tokens_per_s=[30.0, 30.0]),
            Row("eagle-adaptive", 1, 100, 10.0, requests=4, equal_to_plain=4, equal_to_stock=4,
                repeat_tokens_per_s=[10.0, 10.0], task="code", plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("eagle-adaptive", 1, 300, 10.0, requests=4, equal_to_plain=4, equal_to_stock=4,
                repeat_tokens_per_s=[30.0, 30.0], task="json", plain_repeat_tokens_per_s=[30.0, 30.0])]
    mixed = {r.system: r for r in speed.mixed_rows(rows, (1,))}
    assert mixed["entmtp"].plain_repeat_tokens_per_s == [20.0, 20.0]        # stock: 400 tokens over 10 + 10 s
    assert (mixed["entmtp"].equal_to_stock, mixed["entmtp"].equal_to_plain) == (6, 8)
    assert paired_ratio(mixed["plain"], mixed["plain-stock"]) == 2.0
    assert paired_ratio(mixed["entmtp"], mixed["plain-stock"]) == pytest.approx(400 / 15 / 20, abs=1e-3)
    text = speed.tables(rows + list(mixed.values()), {"processor": "Some CPU (avx2)", "cpus": 2, "commit": "abc1234",
                                                      "layers": {"eagle-adaptive": "sglang"}})
    assert text.startswith("Processor: Some CPU (avx2); 2 CPUs; commit abc1234.")
    assert "Every ratio divides by stock SGLang" in text and "EAGLE and adaptive: SGLang's own layers" in text
    assert "| mixed | plain | 1 | 40.0 | 2.00x | 2.00x |  |  | 7/8 |" in text, text
    assert "ENTMTP's paired ratio to stock over each system's" in text
    assert "| mixed | 1 |  | 1.33x (eagle-adaptive) |" in text, text


def test_step_profile_reports_each_step_against_the_stock_plain_step_and_the_goals():
    """With a stock plain step, every step is over it (and over plain with the package); the batch-1 goals are
    checked against it: the smallest tree at most 1.15x, each 6-node tree at most 1.25x."""
    prof = load_script("sglang_step_profile")

    def row(tree, nodes, depth, ms):
        return {"tree": tree, "batch": 1, "nodes": nodes, "depth": depth, "step_ms": ms, "repeats_ms": [ms, ms],
                "decode_ms": ms - 2, "decode_repeats_ms": [ms - 2, ms - 2]}

    rows = [row("b0n6d1", 6, 1, 52.0), row("plain", 1, 0, 50.0), row("b0n2d1", 2, 1, 44.0),
            row("plain-stock", 1, 0, 40.0), row("b1n6d2", 6, 2, 49.0)]
    lines = prof.table(rows, {})
    assert lines[0].startswith("| batch | step | nodes | depth | ms per step, prefill shared (median) | vs stock plain "
                               "step (paired) | vs plain step with the package (paired) |")
    assert [ln.split(" | ")[1] for ln in lines[2:7]] == ["plain-stock", "plain", "b0n2d1", "b0n6d1", "b1n6d2"]
    assert "| 1 | b0n2d1 | 2 | 1 | 44.0 | 1.10x (1.10x) | 0.88x (0.88x) | 42.0 | 1.11x (1.11x) | 0.88x (0.88x) |" \
        in lines, lines
    goal = next(ln for ln in lines if ln.startswith("Goals at batch 1"))
    assert "the smallest tree (2 nodes), goal at most 1.15x: b0n2d1 1.11x (1.10x): met" in goal, goal
    assert "6-node trees, goal at most 1.25x: b0n6d1 1.32x (1.30x): NOT met, b1n6d2 1.24x (1.23x): met" in goal, goal
    # a run from before the stock server: the plain step is the reference, as the committed results show
    old = prof.table([r for r in rows if r["tree"] != "plain-stock"], {})
    assert "vs plain step (paired)" in old[0] and "stock" not in old[0] and not any("Goals" in ln for ln in old)


def test_the_mixed_batch_takes_the_tasks_in_turn_and_reports_each_kinds_trees(tmp_path):
    """bench/sglang_speed.py's mixed batch: JSON, tool calls, code and chat taken in turn (so every batch in flight
    mixes them), labelled per request; its rows are not summed into the mixed stream; the per-kind tree table reads
    ENTMTP's tree names (nodes and depth) and survives a round trip through the run's JSON lines."""
    import collections

    from entmtp_sglang.bench.sglang_benchmark import Row, rows_from_jsonl, write

    speed = load_script("sglang_speed")
    tasks = {t: [{"text": f"{t}{i}"} for i in range(3 if t == "chat" else 2)] for t in speed.TASKS}
    payloads, labels = speed.interleave(tasks)
    assert labels == ["json", "tool-call", "code", "chat"] * 2 + ["chat"]
    assert [p["text"] for p in payloads[:5]] == ["json0", "tool-call0", "code0", "chat0", "json1"]
    assert speed.tree_size("b3n3d2") == (3, 2) and speed.tree_size("chain:2") == (3, 2)
    assert speed.tree_size("rest") == (1, 0) and speed.tree_size("odd") is None
    row = Row("entmtp", 4, 100, 5.0, requests=9, task="mixed-batch",
              trees_by_label={"chat": collections.Counter({"rest": 3, "b0n2d1": 1}),
                              "json": collections.Counter({"b3n3d2": 2, "b1n6d2": 2})})
    plain = Row("plain-stock", 4, 100, 10.0, requests=9, task="mixed-batch")
    assert speed.mixed_rows([row, plain], (4,)) == []
    table = speed.trees_per_label([row])
    assert table.index("| json |") < table.index("| chat |")      # in the mixed batch's task order
    assert "| entmtp | 4 | json | 4 | 4.50 | 2.00 | 0% | b3n3d2 2, b1n6d2 2 |" in table, table
    assert "| entmtp | 4 | chat | 4 | 1.25 | 0.25 | 75% | rest 3, b0n2d1 1 |" in table, table
    write([row, plain], tmp_path, {"run": 1}, name="run")
    back = {r.system: r for r in rows_from_jsonl(tmp_path / "run.jsonl.gz")}
    assert back["entmtp"].trees_by_label == row.trees_by_label and back["plain-stock"].trees_by_label == {}
    assert "Inside the mixed batch" in speed.tables(list(back.values()))


def test_forced_spans_and_the_compact_layout_in_the_product_table(tmp_path):
    """bench/sglang_speed.py: ENTMTP's forced spans (meta_info's [verified, accepted] per step, summed into
    `Row.forced`) get a column (share of output tokens, acceptance, tokens per span) that survives the run's JSON
    lines and adds up over the mixed stream; the compact layout's rows (json-compact, tool-call-compact) divide by
    stock's compact row and stay out of the mixed stream; the layouts are checked."""
    from entmtp_sglang.bench.sglang_benchmark import Row, rows_from_jsonl, write

    speed = load_script("sglang_speed")
    assert speed.COMPACT == "--constrained-json-disable-any-whitespace"
    assert set(speed.COMPACT_TASKS) <= set(speed.TASKS) and speed.STOCK.name in speed.COMPACT_SYSTEMS

    def row(system, task, tps, forced=None):
        return Row(system, 1, 100, 100 / tps, requests=2, task=task, repeat_tokens_per_s=[tps, tps], forced=forced,
                   plain_repeat_tokens_per_s=[] if system == "plain-stock" else [10.0, 10.0])

    rows = [row("plain-stock", "json", 10.0), row("entmtp", "json", 15.0, [10, 40, 30]),
            row("plain-stock", "tool-call", 10.0), row("entmtp", "tool-call", 20.0, [5, 20, 10]),
            row("plain-stock", "json-compact", 10.0), row("entmtp", "json-compact", 25.0, [8, 64, 48])]
    assert rows[1].forced_summary == "30% of tokens, 75% accepted, 4.0 a span"
    rows[1].lookup = [4, 20, 5]   # lookup spans (meta_info["entmtp_lookup"]): shown after the grammar's
    assert rows[1].forced_summary == "30% of tokens, 75% accepted, 4.0 a span; repeats: 5% of tokens, 25% " \
        "accepted, 5.0 a span"
    assert row("entmtp", "code", 12.0).forced_summary == ""
    mixed = {r.system: r for r in speed.mixed_rows(rows, (1,))}
    assert mixed["entmtp"].forced == [15, 60, 40] and mixed["entmtp"].tokens == 200    # compact rows left out
    assert mixed["entmtp"].lookup == [4, 20, 5]
    write(rows, tmp_path, {"run": 1}, name="run")
    back = rows_from_jsonl(tmp_path / "run.jsonl.gz")
    assert [(r.forced, r.lookup) for r in back] == [(r.forced, r.lookup) for r in rows]
    text = speed.tables(back + list(mixed.values()))
    assert "forced spans |" in next(line for line in text.splitlines() if line.startswith("| task | system |"))
    assert "| json-compact | entmtp | 1 | 25.0 | 2.50x | 2.50x |" in text and "48% of tokens, 75% accepted, 8.0 a " \
        "span |" in text, text


def test_every_wave_of_the_product_benchmark_holds_both_baselines_within_at_once():
    """However the systems are chosen (the default, every optional one, --compare-draft, --eagle-layers package, the
    compact layout's pass), no wave holds more than AT_ONCE servers, stock and plain on entmtp_torch are in every
    wave, and every other system runs in exactly one. plain-entmtp is plain decoding with the package on the
    entmtp_torch attention with SGLang's overlap scheduling left on: its server is started without
    --disable-overlap-schedule."""
    from entmtp_sglang.bench.sglang_benchmark import PLAIN, PLAIN_ENTMTP, STOCK, STOCK_BF16, waves

    speed = load_script("sglang_speed")
    assert speed.EVERY_WAVE == (STOCK.name, STOCK_BF16.name, PLAIN_ENTMTP.name) and speed.AT_ONCE == 5
    assert PLAIN_ENTMTP in speed.SYSTEMS and PLAIN in speed.SYSTEMS and PLAIN_ENTMTP.name in speed.COMPACT_SYSTEMS
    everything = [s.name for s in speed.SYSTEMS + speed.OPTIONAL]
    choices = {"default": speed.systems_for(list(speed.DEFAULT)),
               "all": speed.systems_for(everything),
               "package": speed.systems_for(list(speed.DEFAULT), "package"),
               "compare": speed.with_compare_draft(speed.systems_for(list(speed.DEFAULT)), Path("d")),
               "smoke": speed.systems_for(["plain", "entmtp"]),
               "compact": [s for s in speed.systems_for(everything) if s.name in speed.COMPACT_SYSTEMS]}
    for what, specs in choices.items():
        every = tuple(n for n in speed.EVERY_WAVE if n in {s.name for s in specs})
        assert every == speed.EVERY_WAVE, what
        plan = waves(specs, speed.AT_ONCE, every)
        assert all(len(w) <= speed.AT_ONCE for w in plan), (what, plan)
        assert all([s.name for s in w[:3]] == list(speed.EVERY_WAVE) for w in plan), (what, plan)
        others = [s.name for w in plan for s in w[3:]]
        assert sorted(others) == sorted(s.name for s in specs if s.name not in speed.EVERY_WAVE), what
    assert len(waves(choices["compact"], speed.AT_ONCE, speed.EVERY_WAVE)) > 1   # ablations named: more waves
    compact = [s for s in choices["default"] if s.name in speed.COMPACT_SYSTEMS]
    assert [s.name for s in compact] == ["plain-stock", "plain-stock-bf16", "plain-entmtp", "entmtp", "plain"]
    assert len(waves(compact, speed.AT_ONCE, speed.EVERY_WAVE)) == 1   # one wave of five
    assert (PLAIN_ENTMTP.speculative, PLAIN_ENTMTP.attention, PLAIN_ENTMTP.stock, PLAIN_ENTMTP.layers) == (
        None, "entmtp_torch", False, "package")
    args = PLAIN_ENTMTP.server(Path("/tmp"), ("--dtype", "float32")).args
    assert args[args.index("--attention-backend") + 1] == "entmtp_torch"
    assert "--disable-overlap-schedule" not in args and "--speculative-algorithm" not in args
    assert PLAIN.attention == "torch_native" and PLAIN_ENTMTP.name != PLAIN.name


def _speculation_rows():
    """A run with plain on entmtp_torch (plain-entmtp) in every wave, code at batch 1, two repeats a wave: ENTMTP and
    adaptive in wave 1, a static setting in wave 2, plain on torch_native in the last. Each row carries stock's runs
    beside it (`plain_repeat_tokens_per_s`) and plain-entmtp's (`beside`)."""
    from entmtp_sglang.bench.sglang_benchmark import Row

    def row(system, tps, runs, stock=(), pe=None, eq=None):
        return Row(system, 1, int(round(10 * tps)), 10.0, requests=4, task="code", repeat_tokens_per_s=list(runs),
                   plain_repeat_tokens_per_s=list(stock), equal_to_plain=eq,
                   beside={} if pe is None else {"plain-entmtp": list(pe)})

    return [row("plain-stock", 10.0, [10.0] * 6, eq=4),
            row("plain-entmtp", 19.0, [20.0, 16.0, 20.0, 20.0, 18.0, 18.0], [10.0] * 6),
            row("entmtp", 31.0, [30.0, 32.0], [10.0, 10.0], [20.0, 16.0], eq=4),      # 1.5x, 2.0x plain-entmtp
            row("eagle-adaptive", 21.0, [22.0, 20.0], [10.0, 10.0], [20.0, 16.0], eq=4),
            row("eagle-s1-k1-n2", 24.0, [24.0, 24.0], [10.0, 10.0], [20.0, 20.0], eq=4),
            row("plain", 15.0, [15.0, 15.0], [10.0, 10.0], [18.0, 18.0], eq=4)]


def test_what_speculation_adds_divides_by_plain_on_entmtp_torch_when_the_run_has_it(tmp_path):
    """ENTMTP's paired ratio over plain-entmtp is over plain-entmtp's run beside it in the same wave and repeat
    (median of 1.5 and 2.0 = 1.75x; through stock it would be 3.1 / 1.9 = 1.63x, the ratio of medians 31 / 19); the
    table gets a column of it, ENTMTP and EAGLE compare through it, and the headline gets a column, the ENTMTP vs
    plain column and a third table over it. It survives the run's JSON lines and the mixed stream's sums."""
    import dataclasses

    from entmtp_sglang.bench.sglang_benchmark import (
        paired_over,
        rows_from_jsonl,
        speculation_baseline,
        to_markdown,
        versus,
        write,
    )

    speed = load_script("sglang_speed")
    rows = _speculation_rows()
    by = {r.system: r for r in rows}
    assert speculation_baseline(rows) == "plain-entmtp"
    assert paired_over(rows, by["entmtp"], "plain-entmtp") == pytest.approx(1.75)
    assert paired_over(rows, by["plain"], "plain-entmtp") == pytest.approx(15 / 18)
    assert paired_over(rows, by["plain-entmtp"], "plain-entmtp") == 1.0
    assert paired_over(rows, by["plain-stock"], "plain-entmtp") == pytest.approx(1 / 1.9)   # through stock
    assert paired_over(rows, by["entmtp"], "plain-stock") == pytest.approx(3.1)
    table = to_markdown(rows)
    assert "| vs stock | vs stock, paired | vs plain-entmtp, paired | mean accepted length |" in table, table
    assert "| code | entmtp | 1 | 31.0 | 3.10x | 3.10x | 1.75x |  | 4/4 |" in table, table
    assert "| code | plain | 1 | 15.0 | 1.50x | 1.50x | 0.83x |  | 4/4 |" in table, table
    statics = {"best static EAGLE": ["eagle-s1-k1-n2"], "adaptive": ["eagle-adaptive"]}
    # through plain-entmtp: 1.75 / 1.2 and 1.75 / 1.175; through stock it would be 3.1 / 2.4 and 3.1 / 2.1
    assert "| code | 1 | 1.46x (eagle-s1-k1-n2) | 1.49x (eagle-adaptive) |" in versus(rows, "entmtp", statics,
                                                                                     "plain-entmtp")
    text = speed.tables(rows)
    assert "What speculation adds divides by `plain-entmtp`" in text
    assert "ENTMTP's paired ratio to `plain-entmtp` over each system's" in text
    assert "| code | 1 | 1.46x (eagle-s1-k1-n2) | 1.49x (eagle-adaptive) |" in text, text

    write(rows, tmp_path, {"run": 1}, name="run")
    back = rows_from_jsonl(tmp_path / "run.jsonl.gz")
    assert [r.beside for r in back] == [r.beside for r in rows]
    mixed = speed.mixed_rows(back, (1,))
    assert {r.system: r.beside for r in mixed}["entmtp"] == {"plain-entmtp": [20.0, 16.0]}
    steps, systems, per_batch, adds, said, where = speed.headline(back + mixed).split("\n\n")
    assert systems.splitlines()[0].endswith("| vs stock SGLang (paired) | vs plain with the package on "
                                            "`entmtp_torch` (paired) |")
    assert "| **31.0** | **3.10x (3.10x)** | **1.63x (1.75x)** |" in systems, systems
    assert "on SGLang's `torch_native` attention (its CPU linear layers and row-wise ops) | 15.0 | 1.50x (1.50x) | " \
        "0.79x (0.83x) |" in systems, systems
    assert "overlap on (ENTMTP's layers and attention: the baseline of what speculation adds) | 19.0 | 1.90x (1.90x) " \
        "| 1.00x (1.00x) |" in systems, systems
    assert "(`s1-k1-n2`, best by the paired ratio) | 24.0 | 2.40x (2.40x) | 1.26x (1.20x) |" in systems, systems
    head, _, line = per_batch.splitlines()
    assert ("| plain with the package, `torch_native` (mixed) | plain with the package, `entmtp_torch` (mixed) | "
            "mixed, ENTMTP vs plain on `entmtp_torch` (paired) | mixed vs adaptive |") in head
    assert line.endswith("| 3.10x (3.10x) |  | 1.50x (1.50x) | 1.90x (1.90x) | 1.63x (1.75x) | 1.49x | 1.46x |  |  |")
    assert adds.splitlines()[0].startswith("| batch (ENTMTP over plain with the package on `entmtp_torch`, paired) "
                                           "| code |")
    assert adds.splitlines()[2] == "| 1 | 1.63x (1.75x) |" + "  |" * 6 + " 1.63x (1.75x) |  |"
    # issue 56's goals, said met or not from the paired ratio over plain-entmtp (the mixed stream at batch 1 here)
    assert said.splitlines()[1:] == ["- mixed at least 1.0x: 1: 1.75x [1.50-2.00] met",
                                     "- mixed at least 1.5x: 1: 1.75x [1.50-2.00] met"]
    assert said.startswith("Goals (issue 56), ENTMTP over plain with the package on `entmtp_torch`, paired")
    # "where ENTMTP stands": the prose figures, each from the rows (speculation adds 1.75x on code and the mixed
    # stream at batch 1; a user gains 3.10x over stock; plain with the package alone 1.90x)
    assert where.startswith("**Where ENTMTP stands** (every figure from this run): ")
    assert "Over stock SGLang a user gains 3.10x in float32 (paired" in where
    assert "Plain decoding with the package, no speculation, is 1.90x stock at batch 1 on the mixed stream." in where
    assert "is at most 1.75x (code at batch 1): ENTMTP wins (at least 1.10x plain) at batch 1 on code, the mixed " \
        "stream; it is nowhere below plain." in where
    assert "bfloat16" not in where.split(".")[0]   # no stock bfloat16 run: nothing said of it
    bf16 = dataclasses.replace(back[0], system="plain-stock-bf16", equal_to_plain=3, equal_to_stock=None, requests=4)
    assert "; stock SGLang in bfloat16 repeated its first run's outputs 3 of 4 (the fewest over repeats)." in \
        speed.standing(back + mixed + [bf16])
    assert "- mixed at least 1.5x: 1: 1.40x [1.20-1.60] **NOT met**" in speed.goals(
        [dataclasses.replace(r, beside={"plain-entmtp": [25.0, 20.0]}) if r.system == "entmtp" else r
         for r in back + mixed])


def test_an_older_run_without_plain_on_entmtp_torch_divides_what_speculation_adds_by_plain():
    """A run from before plain-entmtp: ENTMTP vs plain is over plain on torch_native (the ratio of medians, as the
    committed run's README table has it), ENTMTP and EAGLE compare through stock, the headline has two tables and no
    column over plain-entmtp, and the results table no such column."""
    import dataclasses

    from entmtp_sglang.bench.sglang_benchmark import speculation_baseline, to_markdown

    speed = load_script("sglang_speed")
    rows = [dataclasses.replace(r, beside={}) for r in _speculation_rows() if r.system != "plain-entmtp"]
    assert speculation_baseline(rows) == "plain" and speculation_baseline(rows[:1]) is None
    assert speed.through(rows) == "plain-stock"
    assert "plain-entmtp" not in to_markdown(rows) and "What speculation adds" not in speed.tables(rows)
    # through stock: 3.1 / 2.4 and 3.1 / 2.1
    assert "| code | 1 | 1.29x (eagle-s1-k1-n2) | 1.48x (eagle-adaptive) |" in speed.tables(rows)
    steps, systems, per_batch = speed.headline(rows + speed.mixed_rows(rows, (1,))).split("\n\n")
    assert systems.splitlines()[0] == "| system (batch 1, mixed workloads) | tok/s | vs stock SGLang (paired) |"
    assert "| plain SGLang with this package installed (its CPU linear layers and row-wise ops) | 15.0 |" in systems
    head, _, line = per_batch.splitlines()
    assert "| plain with the package (mixed) | mixed, ENTMTP vs plain with the package | mixed vs adaptive |" in head
    assert line.endswith("| 3.10x (3.10x) |  | 1.50x (1.50x) | 2.07x | 1.48x | 1.29x |  |  |"), line


def test_the_mixed_stream_sums_the_runs_of_plain_on_entmtp_torch_beside_each_task():
    """The mixed stream at batch 1 and 4 pairs with plain-entmtp the way it pairs with stock: its tokens over its
    seconds beside each repeat, task by task (200 tokens at 20 and 16 tok/s, 400 at 40 and 40)."""
    from entmtp_sglang.bench.sglang_benchmark import Row, paired_over

    speed = load_script("sglang_speed")
    rows = [Row("plain-stock", 1, 100, 10.0, repeat_tokens_per_s=[10.0, 10.0], task="code"),
            Row("plain-stock", 1, 100, 10.0, repeat_tokens_per_s=[10.0, 10.0], task="json"),
            Row("plain-entmtp", 1, 200, 10.0, repeat_tokens_per_s=[20.0, 16.0], task="code",
                plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("plain-entmtp", 1, 400, 10.0, repeat_tokens_per_s=[40.0, 40.0], task="json",
                plain_repeat_tokens_per_s=[10.0, 10.0]),
            Row("entmtp", 1, 200, 5.0, repeat_tokens_per_s=[40.0, 40.0], task="code",
                plain_repeat_tokens_per_s=[10.0, 10.0], beside={"plain-entmtp": [20.0, 16.0]}),
            Row("entmtp", 1, 400, 5.0, repeat_tokens_per_s=[80.0, 80.0], task="json",
                plain_repeat_tokens_per_s=[10.0, 10.0], beside={"plain-entmtp": [40.0, 40.0]})]
    mixed = {r.system: r for r in speed.mixed_rows(rows, (1,))}
    assert mixed["entmtp"].beside == {"plain-entmtp": [30.0, round(600 / 22.5, 2)]}
    assert mixed["plain-entmtp"].beside == {} and mixed["plain-stock"].beside == {}
    assert paired_over(list(mixed.values()), mixed["entmtp"], "plain-entmtp") == pytest.approx(
        (60 / 30 + 60 / 26.67) / 2, abs=1e-3)
    rows[-1].beside = {}   # a task without plain-entmtp's runs beside it: no sum
    assert {r.system: r for r in speed.mixed_rows(rows, (1,))}["entmtp"].beside == {}


def test_step_profile_checks_the_smallest_tree_against_plain_on_entmtp_torch_at_batch_1_and_4():
    """The step profile's plain step with the package is on entmtp_torch (overlap on): every step is over it, and
    the issue-56 goal (the smallest tree at most 1.10x it, paired, at batch 1 and 4) is said met or not."""
    prof = load_script("sglang_step_profile")
    assert prof.RUN == ("plain-stock", "plain-entmtp") and prof.PLAIN_GOAL == 1.10

    def row(tree, b, nodes, depth, ms):
        return {"tree": tree, "batch": b, "nodes": nodes, "depth": depth, "step_ms": ms, "repeats_ms": [ms, ms],
                "decode_ms": ms - 2, "decode_repeats_ms": [ms - 2, ms - 2]}

    rows = [row("plain-stock", 1, 1, 0, 40.0), row("plain-entmtp", 1, 1, 0, 32.0), row("b0n2d1", 1, 2, 1, 34.0),
            row("b0n6d1", 1, 6, 1, 40.0), row("plain-stock", 4, 1, 0, 80.0), row("plain-entmtp", 4, 1, 0, 52.0),
            row("b0n2d1", 4, 2, 1, 62.0)]
    lines = prof.table(rows, {})
    assert "| vs stock plain step (paired) | vs plain step with the package on entmtp_torch, overlap on (paired) |" \
        in lines[0]
    assert [ln.split(" | ")[1] for ln in lines[2:5]] == ["plain-stock", "plain-entmtp", "b0n2d1"]
    assert "| 1 | b0n2d1 | 2 | 1 | 34.0 | 0.85x (0.85x) | 1.06x (1.06x) | 32.0 | 0.84x (0.84x) | 1.07x (1.07x) |" \
        in lines, lines
    goal = next(ln for ln in lines if ln.startswith("Goal against the plain step with the package on entmtp_torch"))
    assert "batch 1, the smallest tree (2 nodes): b0n2d1 1.07x (1.06x): met" in goal, goal
    assert "batch 4, the smallest tree (2 nodes): b0n2d1 1.20x (1.19x): NOT met" in goal, goal
    # an older run (plain on torch_native) has no such goal line
    old = [dict(r, tree="plain") if r["tree"] == "plain-entmtp" else r for r in rows]
    assert not any(ln.startswith("Goal against") for ln in prof.table(old, {}))


def test_the_measurement_prompt_set_is_new_served_and_large_enough():
    """bench/workloads/measure.json (issue 58): at least 8 items per workload, none of them in the development set
    (the prompts the drafters, tree sets and thresholds were tuned on, and the development tool calls), every schema
    one SGLang serves, every tool call naming a tool the set defines; the benchmark reads it by default and refuses
    to measure fewer prompts than asked."""
    import json

    from entmtp_sglang.bench.workload import tool_calls
    from entmtp_sglang.tasks import TASKS, load_prompts

    speed = load_script("sglang_speed")
    spec = json.loads(speed.MEASURE.read_text())
    texts = {task: spec[task] for task in ("code", "chat", "prose")}
    texts["json"] = [it["prompt"] for it in spec["json"]]
    texts["tool-call"] = [r["user"] for r in spec["tool_calls"]["requests"]]
    assert all(len(v) >= 8 and len(set(v)) == len(v) for v in texts.values()), {k: len(v) for k, v in texts.items()}
    dev = {it["prompt"] for t in TASKS for it in load_prompts(t)}
    dev |= {r["user"] for r in json.loads(speed.TOOLS.read_text())["requests"]}
    new = [t for v in texts.values() for t in v]
    assert not [t for t in new if any(t in d or d in t for d in dev if len(d) > 20)]
    assert all(speed.sglang_serves(it["schema"]) for it in spec["json"])
    assert len(tool_calls(spec["tool_calls"])) == len(spec["tool_calls"]["requests"])
    assert speed.PROMPT_SETS[0] == "measure"
    with pytest.raises(ValueError, match="prompts must be one of"):
        speed.workloads(None, 1, 8, "other")


def test_the_measurement_set_becomes_payloads_under_the_chat_template():
    """Each workload's first `per_task` items through the chat template, greedy, `max_new_tokens`; the JSON and tool
    call prompts under their schemas; more prompts than the set has is refused."""
    import json

    speed = load_script("sglang_speed")

    class Template:   # the chat template's shape, without a tokenizer
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    w = speed.workloads(Template(), 8, 96, "measure")
    assert sorted(w) == ["chat", "code", "json", "prose", "tool-call"] and all(len(v) == 8 for v in w.values())
    spec = json.loads(speed.MEASURE.read_text())
    assert w["code"][0]["text"] == f"user:{spec['code'][0]}|assistant:"
    assert w["code"][0]["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 96}
    assert json.loads(w["json"][3]["sampling_params"]["json_schema"]) == spec["json"][3]["schema"]
    call = w["tool-call"][0]
    assert call["text"].startswith("system:You can call one tool, convert_currency")
    assert json.loads(call["sampling_params"]["json_schema"])["properties"]["name"] == {"type": "string",
                                                                                          "enum": ["convert_currency"]}
    with pytest.raises(ValueError, match="asked"):
        speed.workloads(Template(), 99, 96, "measure")


def test_the_bootstrap_interval_of_paired_ratios_is_seeded_and_within_their_range():
    from entmtp_sglang.bench.sglang_benchmark import bootstrap_interval

    ratios = [1.1, 1.3, 1.2, 0.9, 1.25]
    lo, hi = bootstrap_interval(ratios)
    assert min(ratios) <= lo <= 1.2 <= hi <= max(ratios)
    assert bootstrap_interval(ratios) == (lo, hi)            # seeded
    assert bootstrap_interval([1.5, 1.5, 1.5]) == (1.5, 1.5)
    for bad in ([], ):
        with pytest.raises(ValueError, match="no ratios"):
            bootstrap_interval(bad)
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(ratios, level=1.0)


def test_the_speculation_gap_table_pairs_each_entmtp_server_with_the_plain_run_beside_it():
    """bench/experiments/speculation_gap.py: ENTMTP (and an ablation beside it) over plain on entmtp_torch, each repeat
    over the plain run of its round; plain's own row and a task without plain are left out."""
    from entmtp_sglang.bench.sglang_benchmark import Row

    gap = load_script("speculation_gap", "bench/experiments")

    def row(system, task, tps, plain=()):
        return Row(system, 4, 100, 1.0, requests=4, task=task, repeat_tokens_per_s=list(tps),
                   plain_repeat_tokens_per_s=list(plain))

    rows = [row("plain-entmtp", "chat", [50.0, 40.0, 60.0]), row("entmtp", "chat", [45.0, 44.0, 54.0], [50, 40, 60]),
            row("entmtp-also", "chat", [55.0, 40.0, 66.0], [50, 40, 60]), row("entmtp", "prose", [10.0, 10.0, 10.0])]
    table = gap.gap_table(rows)
    assert "| chat | 4 | entmtp | 100.0 | 100.0 | **0.90x** | 0.90-1.10 |" in table, table
    assert "| chat | 4 | entmtp-also | 100.0 | 100.0 | **1.10x** | 1.00-1.10 |" in table, table
    assert "prose" not in table and "| plain-entmtp |" not in table
    with pytest.raises(SystemExit, match="ENTMTP_NAME=VALUE"):
        gap._env(["GUARD=0"])
    assert gap._env(["ENTMTP_GUARD=0"]) == (("ENTMTP_GUARD", "0"),)
