"""A decode step's decision without a server (sglang/step.py): the policy's choice in each mode, laid out on the
server's tree indices as one frozen record; what the worker, the drafter and verification then read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from entmtp_sglang.policy.controller import RequestInput, TreeController
from entmtp_sglang.sglang.step import (
    REST,
    Choice,
    Mode,
    Rule,
    StepDecision,
    choose_trees,
    lay_out,
    ragged_shapes,
    rest_rule,
    shape_trees,
    step_mode,
)
from entmtp_sglang.sglang.tree_index import ShapeIndex, TreeIndex
from entmtp_sglang.sglang.tree_plan import plan_tree, required_topk
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet


def _set() -> TreeSet:
    wide, deep = Tree((-1, 0, 0, 0), name="wide4"), Tree((-1, 0, 1, 2), name="deep4")
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {1: 0.012, 4: 0.012}),
               TreeEntry(Tree.chain(1), (0.4, 0.8), {1: 0.016, 4: 0.016}),
               TreeEntry(wide, (0.5, 0.6), {1: 0.020, 4: 0.020}),
               TreeEntry(deep, (0.2, 2.4), {1: 0.024, 4: 0.024}))
    return TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries)


class Server:
    """What the worker builds at start-up from its tree set (worker.py `__init__`), on CPU."""

    def __init__(self, ragged: bool):
        self.ts = _set()
        trees = [e.tree for e in self.ts.trees]
        topk = max(required_topk(t) for t in trees)
        self.plans = [plan_tree(t, topk, t.max_depth) for t in trees]
        self.indices = [TreeIndex.build(p, "cpu") for p in self.plans]
        self.shape_index = ShapeIndex.for_trees(trees, topk, "cpu", ragged=ragged)
        self.shapes = ragged_shapes(self.shape_index) if ragged else {}
        self.shape_tree = shape_trees(trees)
        self.rest = 0
        self.by_name = {t.name: i for i, t in enumerate(trees)}
        self.controller = TreeController(self.ts, hysteresis=0.0)

    def step(self, inputs, mode: Mode) -> StepDecision:
        choice = choose_trees(self.controller, inputs, mode, self.shapes, self.shape_tree, self.rest, self.plans)
        return lay_out(choice, len(inputs), self.plans, self.indices, self.shape_index, self.by_name)


def pins(*names) -> list[RequestInput]:
    return [RequestInput(f"r{i}", 0.5, pin=n) for i, n in enumerate(names)]


def test_one_tree_for_the_batch():
    srv = Server(ragged=False)
    step = srv.step(pins("deep4", "deep4"), Mode.ONE_TREE)
    assert step.name == "deep4" and step.names == ("deep4", "deep4") and step.chosen == 3
    assert step.plan is srv.plans[3] and step.index is srv.indices[3]
    assert step.rows is None and step.ragged is None and step.drafts and (step.num_nodes, step.num_steps) == (4, 3)


def test_a_tree_per_row_at_a_shared_shape():
    """Rows draft their own trees of the step's node count; the deepest sets the levels; the gathered indices are
    the rows' own trees' in the shape's stack."""
    srv = Server(ragged=False)
    step = srv.step([RequestInput("json", 0.9), RequestInput("chat", 0.1)], Mode.PER_ROW)
    assert step.names == ("deep4", "wide4") and step.name == "deep4" and step.num_steps == 3
    shape = srv.shape_index[(3, 4)]
    want = shape.gather(torch.tensor([shape.position(3), shape.position(2)]))
    assert torch.equal(step.rows.parent_list, want.parent_list) and torch.equal(step.rows.selected, want.selected)
    assert [p.tree.name for p in step.row_plans] == ["deep4", "wide4"]
    assert all(p.num_steps == 3 for p in step.row_plans)   # each laid out on the step's levels
    assert step.ragged is None and step.row_real == ()


def test_ragged_rows_rest_inside_a_speculating_step():
    """A resting row (chain:0) and a 2-node row beside a 4-node one: the step runs in the 4-node shape, each row
    verifies its own real tokens, and the packed layout covers exactly them."""
    srv = Server(ragged=True)
    step = srv.step(pins("deep4", "chain:0", "chain:1"), Mode.RAGGED)
    assert step.names == ("deep4", "chain:0", "chain:1") and step.name == "deep4"
    assert step.row_real == (4, 1, 2) and not step.resting and step.drafts
    assert step.ragged is not None and step.ragged.counts == (4, 1, 2) and step.ragged.total_tokens == 7
    assert int(step.ragged.real.sum()) == 7 and step.ragged.index.numel() == 7
    # every row at its full node count: no ragged layout, every row verifies N
    full = srv.step(pins("deep4", "deep4"), Mode.RAGGED)
    assert full.row_real == (4, 4) and full.ragged is None


def test_every_row_resting_is_chain0s_step():
    srv = Server(ragged=True)
    step = srv.step(pins("chain:0", "chain:0"), Mode.RAGGED)
    assert step.name == "chain:0" and step.resting and not step.drafts and step.chosen == 0
    assert step.rows is None and step.ragged is None and (step.num_nodes, step.num_steps) == (1, 0)


def test_a_rule_rests_and_a_failed_choice_decodes_plainly():
    srv = Server(ragged=True)
    rest = lay_out(None, 3, srv.plans, srv.indices, srv.shape_index, srv.by_name, resting=True)
    assert rest.name == REST and rest.resting and rest.plan is None and rest.chosen == 0
    plain = lay_out(None, 2, srv.plans, srv.indices, srv.shape_index, srv.by_name)
    assert plain.name == "plain" and not plain.resting and plain.names == ("plain", "plain")
    none = lay_out(Choice(None), 1, srv.plans, srv.indices, srv.shape_index, srv.by_name)   # nothing fits: rest
    assert none.resting and none.name == REST


def test_the_decision_is_frozen_and_forced_spans_replace_it():
    srv = Server(ragged=True)
    step = srv.step(pins("deep4", "chain:0"), Mode.RAGGED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.resting = True
    wider = step.with_ragged(None)
    assert wider.ragged is None and step.ragged is not None and wider.names == step.names


@pytest.mark.parametrize("mode", [Mode.RAGGED, Mode.PER_ROW])
def test_rules_before_the_policy(mode):
    """Penalised rows: with ragged verify only an all-penalised batch rests (the others' rows speculate beside
    them); without, one rests the batch. Owed positions: rest on without a catch-up while the policy backs off and
    fewer than the cap are owed; else catch up first."""
    asked = []

    def backs_off(answer):
        return lambda: asked.append(answer) or answer

    one_of_two = rest_rule([True, False], 0, mode, 16, backs_off(False))
    assert one_of_two == Rule(catch_up=False, rest=mode is Mode.PER_ROW)
    assert rest_rule([True, True], 0, mode, 16, backs_off(False)) == Rule(False, True)
    assert rest_rule([False], 3, mode, 16, backs_off(True)) == Rule(catch_up=False, rest=True)
    assert rest_rule([False], 3, mode, 16, backs_off(False)) == Rule(catch_up=True, rest=False)
    assert rest_rule([False], 16, mode, 16, backs_off(True)) == Rule(catch_up=True, rest=False)   # the cap
    assert rest_rule([True, True], 3, mode, 16, backs_off(False)) == Rule(False, True)   # no need to ask
    assert asked == [True, False]   # asked only with owed positions below the cap and no need to rest anyway
    assert rest_rule([False], 0, mode, 16, backs_off(True)) == Rule(False, False)   # nothing owed: not asked


def test_the_step_mode_serves_per_request_and_records_one_tree_unless_pins_differ():
    assert step_mode(True, True) is Mode.RAGGED
    assert step_mode(False, True) is Mode.PER_ROW
    assert step_mode(False, False) is Mode.ONE_TREE
    # recording (calibration through SGLang): one tree per step, whether pinned alike or not pinned at all ...
    assert step_mode(True, True, recording=True, pins=["record", "record"]) is Mode.ONE_TREE
    assert step_mode(True, True, recording=True, pins=[None, None, None]) is Mode.ONE_TREE
    assert step_mode(True, True, recording=True, pins=["grid:w1d1"]) is Mode.ONE_TREE
    # ... but a batch whose requests pin different trees is laid out per request: the ragged steps it times
    assert step_mode(True, True, recording=True, pins=["chain:0", "grid:w3d1"]) is Mode.RAGGED
    assert step_mode(False, True, recording=True, pins=["grid:w1d1", "grid:w2d1"]) is Mode.PER_ROW
    assert step_mode(False, False, recording=True, pins=["grid:w1d1", "grid:w2d1"]) is Mode.ONE_TREE
