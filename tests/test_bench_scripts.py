"""The bench scripts' own logic: bench/policies.py's table and goal count on rows written by hand, and
bench/signals.py's cross-validated replay on synthetic records (the runs themselves are benchmarks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def policies_bench():
    return load_script("policies")


def rows(task, **tps):
    return [{"drafter": "hydra", "task": task, "policy": p, "tokens_per_s": v, "mean_accepted": 1.0,
             "repeats": [v, v * 1.1], "signal": "draft_margin"} for p, v in tps.items()]


def test_table_ratios_goals_and_ablation(policies_bench):
    data = (rows("code", **{"default-static": 80.0, "static-best": 90.0, "adaptive-ema": 85.0, "eagle2": 70.0,
                            "entmtp": 99.0, "oracle": 108.0, "entmtp-entropy": 90.0})
            + rows("mixed", **{"default-static": 80.0, "static-best": 100.0, "adaptive-ema": 100.0,
                               "eagle2": 100.0, "entmtp": 100.0, "oracle": 100.0}))
    md = policies_bench.markdown(data)
    code = next(line for line in md.splitlines() if line.startswith("| hydra | code"))
    # EntMTP / default, / static-best, / adaptive, / EAGLE-2, headroom captured (9 of 18 tok/s)
    assert "| 1.24x | 1.10x | 1.16x | 1.41x | 50% |" in code
    assert "99.0 (1.00)" in code and "70.0 (1.00)" in code
    goals = policies_bench.goals_line(data)
    assert "of 2 cells: EntMTP >= 1.15x default static in 2; >= 1.05x static-best in 1; " in goals
    assert ">= 1.05x adaptive-EMA in 1; >= half the oracle's headroom over static-best in 1." in goals
    assert "Mixed stream vs static-best (goal 1.15x): hydra 1.00x." in goals
    assert "hydra code 1.10x" in md  # the signal ablation line
    assert "EntMTP's signal per cell: hydra code draft_margin, hydra mixed draft_margin." in md


def test_signal_study_finds_the_informative_signal():
    """Acceptance follows the margin exactly and the entropy not at all: binning on the margin recovers
    nearly all of the oracle's edge in replay, binning on the entropy none of it."""
    import random

    from entmtp_sglang.calibrate import PositionRecord, StepCostModel

    signals = load_script("signals")
    rng = random.Random(0)
    recs = []
    for prompt in range(8):
        for pos in range(60):
            m = rng.random()
            ranks = (0, 0, 0) if m > 0.5 else (3, 3, 3)
            recs.append(PositionRecord(prompt, pos, rng.uniform(0, 5), rng.uniform(0, 5), ranks, m))
    out = signals.study(recs, StepCostModel(0.01, 0.001, 0.004))
    v = out["vs_static_best"]
    assert out["correlation"]["draft_margin"] > 0.8 and abs(out["correlation"]["draft_entropy"]) < 0.2
    assert v["oracle"] > 1.2
    assert v["draft_margin/2"] > 0.97 * v["oracle"]
    assert v["draft_entropy/4"] < 1.02 and v["one bin"] < 1.02
    md = signals.markdown({"hydra/code": out})
    row = next(line for line in md.splitlines() if line.startswith("| hydra | code | 480 |"))
    assert row.split("|")[-2].strip().startswith("draft_margin/")  # the best signal
