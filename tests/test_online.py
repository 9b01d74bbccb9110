"""Calibration from verified steps (costs/online.py), the generic set (tree/generic.py), the recording trees
of `entmtp calibrate --engine sglang`, and ENTMTP's tree-set resolution without a set for the model. No SGLang."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from entmtp_sglang.calibrate.costs import cost_grid
from entmtp_sglang.calibrate.through_sglang import mixed_pins, record_tree, records_of, step_seconds
from entmtp_sglang.costs.online import OnlineCalibration, StepObservation, fit_costs, position_record
from entmtp_sglang.policy.controller import RequestInput, TreeController
from entmtp_sglang.sglang.config import EntMtpConfig
from entmtp_sglang.sglang.recording import record_row
from entmtp_sglang.sglang.tree_plan import plan_tree, required_topk
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.acceptance import AcceptancePredictor
from entmtp_sglang.tree.generic import generic_tree_set
from entmtp_sglang.tree.treeset import TreeSetError, load_tree_set, shipped_tree_set

#      0
#     / \
#    1   2        tokens: 1 -> 10, 2 -> 11, 3 -> 20, 4 -> 30
#    |
#    3
#    |
#    4
TREE = (-1, 0, 0, 1, 3)
TOKENS = (-1, 10, 11, 20, 30)


def obs(target, expanded=None):
    expanded = expanded if expanded is not None else {
        0: ([10, 11, 12], [0.6, 0.3, 0.1]), 1: ([20, 21], [0.7, 0.2]), 3: ([31, 30], [0.5, 0.4])}
    return StepObservation(TREE, TOKENS, expanded, tuple(target))


def test_position_record_follows_the_targets_path_through_the_tree():
    # the target continues 10, 20, 30: ranks 0, 0, then 30 is node 3's second candidate; node 4 is a leaf
    r = position_record(obs([10, 20, 0, 30, 99]), max_depth=5, max_rank=6)
    assert r.ranks == (0, 0, 1, -1, -1) and r.chain_accepted == 2
    assert r.draft_probs == ((0.6, 0.3, 0.1), (0.7, 0.2), (0.5, 0.4))


def test_position_record_stops_where_the_tree_cannot_tell():
    # the target's token is the drafter's third candidate, not drafted: depth 2 is unknown
    assert position_record(obs([12, 0, 0, 0, 0]), 4, 6).ranks == (2, -1, -1, -1)
    # a token outside the drafter's top candidates is a miss (max_rank)
    assert position_record(obs([77, 0, 0, 0, 0]), 4, 6).ranks == (6, -1, -1, -1)
    # the second depth-1 node is accepted but was not expanded
    assert position_record(obs([11, 0, 0, 0, 0]), 4, 6).ranks == (1, -1, -1, -1)


def test_generic_set_is_valid_and_plannable():
    for depth, topk in ((1, 1), (4, 2), (5, 4)):
        ts = generic_tree_set("my-model", depth, topk)
        assert ts.trees[0].tree.name == "chain:0" and ts.max_depth == depth
        assert ts.provenance["generic"] and ts.predictor is not None
        k = max(required_topk(t.tree) for t in ts.trees)
        assert k == min(topk, 3)
        for t in ts.trees:
            plan_tree(t.tree, k, t.tree.max_depth)
    with pytest.raises(ValueError):
        generic_tree_set("m", 0, 2)


def test_online_refit_learns_acceptance_and_costs():
    ts = generic_tree_set("my-model", 3, 1)       # chains 0..3
    cal = OnlineCalibration(ts, refit_every=10)
    chain3 = [t.tree.name for t in ts.trees].index("chain:3")
    # the drafter is badly over-confident: the target never takes its top candidates (p = 0.9, 0.05)
    bad = [position_record(StepObservation(Tree.chain(3).parents, (-1, 5, 6, 7), {0: ([5, 8], [0.9, 0.05])},
                                           (77, 0, 0, 0)), 3, 6) for _ in range(100)]
    cal.observe(bad)
    for i in range(10):
        cal.observe_time(chain3, 1, 0.2)
        cal.observe_time(0, 1, 0.05)
    assert cal.due()
    before = AcceptancePredictor.from_json(ts.predictor).expected_accepted(Tree.chain(3), [(0.9, 0.05)])
    new = cal.refit()
    after = AcceptancePredictor.from_json(new.predictor).expected_accepted(Tree.chain(3), [(0.9, 0.05)])
    assert before > 0.8 and after < 0.1
    assert new.trees[chain3].cost(1) == pytest.approx(0.2) and new.trees[0].cost(1) == pytest.approx(0.05)
    # and the policy now backs off to plain decoding
    ctl = TreeController.for_tree_set(new)
    assert ctl.choose([RequestInput("r", 0.5, (0.9, 0.05))]) == 0
    assert "100 positions" in cal.summary()


def test_fit_costs_separates_nodes_from_depth():
    trees = [Tree.chain(d) for d in range(4)] + [Tree((-1, 0, 0, 0))]
    truth = lambda t: 0.05 + 0.01 * (t.num_nodes - 1) + 0.02 * t.max_depth  # noqa: E731
    measured = {(i, 1): (truth(t), 3) for i, t in enumerate(trees) if i != 3}
    fitted = fit_costs(trees, measured, 1)
    assert fitted[3] == pytest.approx(truth(trees[3]), rel=1e-6)
    assert fit_costs(trees, measured, 8) is None


def test_speculative_steps_never_move_the_resting_cost():
    """A speculative step's fixed part is not a resting step's: timing only speculative steps at a batch size
    scales the speculative trees and leaves chain:0 at its prior until chain:0 itself is timed there."""
    trees = [Tree.chain(d) for d in range(4)] + [Tree((-1, 0, 0, 0))]
    prior = [0.10, 0.11, 0.12, 0.13, 0.12]
    one = fit_costs(trees, {(1, 4): (0.22, 5)}, 4, prior)              # chain:1 timed at twice its prior
    assert one[0] == pytest.approx(0.10) and one[1:] == pytest.approx([0.22, 0.24, 0.26, 0.24])
    truth = lambda t: 0.15 + 0.01 * (t.num_nodes - 1) + 0.02 * t.max_depth  # noqa: E731
    many = fit_costs(trees, {(i, 4): (truth(t), 5) for i, t in enumerate(trees) if i in (1, 2, 4)}, 4, prior)
    assert many[0] == pytest.approx(0.10) and many[3] == pytest.approx(truth(trees[3]), rel=1e-6)
    rested = fit_costs(trees, {(1, 4): (0.22, 5), (0, 4): (0.09, 1)}, 4, prior)
    assert rested[0] == pytest.approx(0.09)


def test_batch_4_gets_its_own_costs():
    ts = load_tree_set(shipped_tree_set("eagle", "mixed"))
    cal = OnlineCalibration(ts, refit_every=1)
    spec = next(i for i, e in enumerate(ts.trees) if e.tree.num_nodes > 1)
    for _ in range(4):
        cal.observe_time(spec, 4, 3 * ts.trees[spec].cost(4))
    new = cal.refit_costs()
    assert new.trees[spec].cost(4) == pytest.approx(3 * ts.trees[spec].cost(4))
    assert new.trees[0].cost(4) == pytest.approx(ts.trees[0].cost(4))          # chain:0 untouched
    assert new.trees[spec].cost(1) == ts.trees[spec].cost(1) and new.trees[spec].cost(8) == ts.trees[spec].cost(8)


def test_one_slow_step_does_not_price_a_shape_out():
    """A shape timed once or twice is priced by its fastest step (noise only adds time): one step that met a
    busy machine must not make every speculative tree look dear and the server rest until the shape is timed
    again, which resting never does. From `ROBUST` steps on, the median of the recent ones."""
    from entmtp_sglang.costs.online import ROBUST

    ts = load_tree_set(shipped_tree_set("eagle", "mixed"))
    cal = OnlineCalibration(ts, refit_every=1)
    spec = next(i for i, e in enumerate(ts.trees) if e.tree.num_nodes > 1)
    cost = ts.trees[spec].cost(1)
    cal.observe_time(spec, 1, 50 * cost)           # the warm-up step: dropped
    cal.observe_time(spec, 1, 10 * cost)           # a busy machine
    cal.observe_time(spec, 1, cost)
    assert cal.measured[(spec, 1)] == (pytest.approx(cost), 2)
    for _ in range(ROBUST):
        cal.observe_time(spec, 1, 3 * cost)
    assert cal.measured[(spec, 1)][0] == pytest.approx(3 * cost)   # the machine really is slower: median


def test_recording_trees_fit_sglang_buffers():
    t = record_tree(5)
    assert t.max_depth == 5 and required_topk(t) == 3
    grid = cost_grid(5)
    assert {(g.num_nodes, g.max_depth) for g in grid} >= {(1, 0), (2, 1), (16, 5)}
    assert max(required_topk(g) for g in grid) == 3


@pytest.mark.parametrize("batch", [2, 4, 16])
def test_mixed_pins_make_ragged_steps_at_varied_depths(batch):
    grid = cost_grid(3)
    by_name = {t.name: t for t in grid}
    rounds = mixed_pins(grid, batch, 6)
    assert len(rounds) == 6 and all(len(r) == batch for r in rounds)
    for pins in rounds:   # every batch mixes node counts: its rows verify different numbers of tokens
        assert len({by_name[p].num_nodes for p in pins}) > 1, pins
    deepest = {max(by_name[p].max_depth for p in pins) for pins in rounds}
    assert len(deepest) >= 2, deepest   # the batch's deepest level varies across rounds


def test_recorded_steps_round_trip():
    r = position_record(obs([10, 20, 0, 30, 99]), 5, 6, prompt=3, pos=7, draft_entropy=1.5, target_entropy=0.5,
                        draft_margin=math.nan)
    steps = [{"tree": "record", "batch": 1, "seconds": 0.1, "records": [record_row(r)]},
             {"tree": "grid:w1d1", "batch": 8, "seconds": 0.3, "records": []},
             {"tree": "grid:w1d1", "batch": 4, "seconds": 0.2, "records": []}]
    (back,) = records_of(steps)
    assert back.ranks == r.ranks and back.draft_probs == r.draft_probs and math.isnan(back.draft_margin)
    assert step_seconds(steps, "grid:w1d1", 8) == [0.3] and step_seconds(steps, "grid:w1d1", 32) == [0.3]


def test_no_set_for_the_model_starts_generic_and_a_foreign_set_needs_force():
    generic = EntMtpConfig(None, "my-model", generic_depth=3, generic_topk=2)
    ts = generic.load_tree_set()
    assert generic.uncalibrated and ts.model == "my-model" and ts.max_depth == 3
    foreign = Path(shipped_tree_set("eagle", "mixed"))   # calibrated for entmtp-tiny
    with pytest.raises(TreeSetError, match="ENTMTP_FORCE_TREE_SET=1"):
        EntMtpConfig(foreign, "my-model").load_tree_set()
    assert EntMtpConfig(foreign, "my-model", force=True).load_tree_set().model == "entmtp-tiny"


def test_online_recalibration_of_a_calibrated_set_keeps_its_trees_and_learns():
    from entmtp_sglang.tree.treeset import load_tree_set

    ts = load_tree_set(shipped_tree_set("eagle", "mixed"))       # calibrated, with a predictor
    cal = OnlineCalibration(ts, refit_every=4)
    deep = max(range(len(ts.trees)), key=lambda i: ts.trees[i].tree.max_depth)
    tree = ts.trees[deep].tree
    # the target never takes the drafter's candidates: every tree should now expect (almost) nothing
    miss = [position_record(StepObservation(Tree.chain(1).parents, (-1, 5), {0: ([5, 8], [0.8, 0.1])},
                                            (77, 0)), ts.max_depth, 6) for _ in range(200)]
    cal.observe(miss)
    for _ in range(4):
        cal.observe_time(deep, 1, ts.trees[deep].cost(1) * 2)   # and the machine is twice as slow there
    before = AcceptancePredictor.from_json(ts.predictor).expected_accepted(tree, [(0.8, 0.1)])
    new = cal.refit()
    assert [e.tree for e in new.trees] == [e.tree for e in ts.trees]
    after = AcceptancePredictor.from_json(new.predictor).expected_accepted(tree, [(0.8, 0.1)])
    assert before > 0.3 and after < 0.05
    # one shape measured: every speculative tree's cost is the set's own, scaled by what was measured; chain:0
    # (resting, another regime) keeps the set's until it is timed itself
    assert new.trees[1].cost(1) == pytest.approx(ts.trees[1].cost(1) * 2)
    assert new.trees[deep].cost(1) == pytest.approx(ts.trees[deep].cost(1) * 2)
    assert new.trees[0].cost(1) == pytest.approx(ts.trees[0].cost(1))
