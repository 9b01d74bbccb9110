"""Tree sets, tree construction, the Pareto frontier, the selector and the baseline policies."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from entmtp_sglang.policy.chooser import StepRecord, StepView
from entmtp_sglang.policy.policies import AdaptiveEMAPolicy, EntMTPPolicy, StaticPolicy
from entmtp_sglang.policy.selector import select_tree
from entmtp_sglang.policy.signals import (
    draft_signal,
    entropy_nats,
    least_predictable,
    recent_target_entropies,
    signal_value,
)
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.construct import accepted_on, expected_accepted, greedy_tree, independent_tree, pareto_front
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet, TreeSetError, from_json, load_tree_set


def _set(costs=(0.01, 0.012, 0.02), acc=((0.0, 0.0), (0.9, 0.2), (2.5, 0.3))):
    """Three chains; at batch 32 the step cost grows with the number of nodes."""
    trees = (Tree.chain(0), Tree.chain(1), Tree.chain(4))
    entries = tuple(TreeEntry(t, a, {1: c, 8: c * 2, 32: 0.03 * t.num_nodes ** 1.5})
                    for t, a, c in zip(trees, acc, costs))
    return TreeSet("entmtp-tiny", "medusa", "code", "draft_entropy", (1.0,), entries)


#      0
#     / \        ranks:  node 1 = rank 0, node 2 = rank 1 (children of the root)
#    1   2               node 3 = rank 0 under node 1
#    |
#    3
def test_accepted_on_hand_tree():
    t = Tree((-1, 0, 0, 1))
    assert accepted_on(t, (0, 0, 3)) == 2  # root -> 1 -> 3
    assert accepted_on(t, (1, 0)) == 1  # root -> 2, which has no child
    assert accepted_on(t, (2, 0)) == 0
    assert accepted_on(t, (0, 1)) == 1
    assert expected_accepted(t, [(0, 0), (1, 0), (2, 0), (0, 1)]) == (2 + 1 + 0 + 1) / 4


records_st = st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=4), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(records_st, st.integers(1, 16))
def test_greedy_tree_is_valid_and_beats_chains_of_its_size(records, n):
    t = greedy_tree(records, n, max_depth=4, max_rank=4)
    assert t.num_nodes <= n and t.max_depth <= 4
    assert max(t.sibling_rank) < 4
    chain = Tree.chain(min(n - 1, 4))
    assert expected_accepted(t, records) >= expected_accepted(chain, records) - 1e-9


@settings(max_examples=80, deadline=None)
@given(records_st)
def test_greedy_tree_grows_monotonically(records):
    values = [expected_accepted(greedy_tree(records, n, 4, 4), records) for n in range(1, 12)]
    assert all(b >= a - 1e-9 for a, b in zip(values, values[1:]))


def test_independent_tree_prefers_likely_ranks():
    acc = [[0.8, 0.1], [0.6, 0.2], [0.5, 0.1]]
    t = independent_tree(acc, 4)
    assert t.parents == (-1, 0, 1, 2)  # chain: 0.8, 0.48, 0.24 beat 0.1
    t = independent_tree([[0.5, 0.45], [0.1, 0.05]], 3)
    assert t.parents == (-1, 0, 0)


points_st = st.lists(st.tuples(st.floats(0.1, 10), st.floats(0, 10)), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(points_st)
def test_pareto_members_are_not_dominated_and_others_are(points):
    front = set(pareto_front(points))
    assert front
    for i, (c, v) in enumerate(points):
        dominated = any(c2 <= c and v2 >= v and (c2 < c or v2 > v) for c2, v2 in points)
        assert (i in front) == (not dominated)


@settings(max_examples=200, deadline=None)
@given(st.floats(-1, 10), st.sampled_from([1, 2, 8, 32, 64]), st.one_of(st.none(), st.integers(0, 2)),
       st.floats(0, 0.5), st.one_of(st.none(), st.integers(1, 6)))
def test_selector_returns_a_tree_of_the_set_within_budget(entropy, batch, current, hyst, budget):
    ts = _set()
    i = select_tree(ts, entropy, batch, current, hyst, max_nodes=budget)
    assert 0 <= i < len(ts.trees)
    if budget is not None:
        assert ts.trees[i].tree.num_nodes <= max(budget, 1)


def test_selector_goes_deep_when_predictable_and_shallow_at_large_batch():
    ts = _set()
    assert ts.trees[select_tree(ts, 0.2, 1)].tree.name == "chain:4"  # low entropy: deep
    assert ts.trees[select_tree(ts, 3.0, 1)].tree.name == "chain:0"  # high entropy: no speculation
    assert ts.trees[select_tree(ts, 0.2, 32)].tree.name == "chain:0"  # batch 32: too costly
    # hysteresis keeps the current tree when the best is only slightly better
    near = _set(acc=((0.0, 0.0), (0.9, 0.2), (2.5, 0.3)), costs=(0.01, 0.012, 0.0217))
    assert select_tree(near, 0.2, 1, current=1, hysteresis=0.05) == 1
    assert select_tree(near, 0.2, 1, current=1, hysteresis=0.0) == 2


def test_tree_set_round_trip_and_validation(tmp_path):
    ts = _set()
    path = tmp_path / "set.json"
    ts.save(path)
    again = load_tree_set(path, model="entmtp-tiny", drafter="medusa", max_depth=5)
    assert [t.tree.parents for t in again.trees] == [t.tree.parents for t in ts.trees]
    data = json.loads(path.read_text())
    bad = json.loads(json.dumps(data))
    bad["trees"][2]["parents"] = [-1, 0, 3, 1]
    with pytest.raises(TreeSetError, match=r"trees\[2\]\.parents: node 2 has parent 3"):
        from_json(bad)
    bad = json.loads(json.dumps(data))
    bad["trees"][1]["expected_accepted"] = [0.5]
    with pytest.raises(TreeSetError, match=r"trees\[1\].*1 values for 2 signal bins"):
        from_json(bad)
    bad = json.loads(json.dumps(data))
    del bad["signal"]
    with pytest.raises(TreeSetError, match="missing field 'signal'"):
        from_json(bad)
    with pytest.raises(TreeSetError, match="calibrated for model 'entmtp-tiny', not 'other'"):
        load_tree_set(path, model="other")
    with pytest.raises(TreeSetError, match="depth 4, beyond the drafter's 3"):
        load_tree_set(path, max_depth=3)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TreeSetError, match="not valid JSON"):
        load_tree_set(tmp_path / "broken.json")


def _view(index=0, draft_entropy=1.0, accepted=(), entropies=()):
    hist = tuple(StepRecord("t", 2, a, [e], 0.0, 0.01) for a, e in zip(accepted, entropies))
    return StepView(index, draft_entropy, hist, 1, 10 + len(hist))


def test_signals():
    hist = _view(accepted=(0, 1, 2), entropies=(3.0, 2.0, 1.0)).history
    assert recent_target_entropies(hist, 2) == [2.0, 1.0]
    assert signal_value("target_window", 9.0, hist, window=2) == 1.5
    assert signal_value("draft_entropy", 9.0, hist) == 9.0
    assert signal_value("target_window", 9.0, (), window=2) == 9.0  # no history yet: the draft signal
    assert signal_value("draft_margin", 0.25, hist) == 0.25
    with pytest.raises(ValueError, match="unknown signal 'nope'"):
        signal_value("nope", 1.0, hist)


def test_draft_margin_signal():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [5.0, -float("inf"), -float("inf")]])
    p = torch.softmax(logits[0], -1)
    margin = draft_signal("draft_margin", logits)
    assert margin[0].item() == pytest.approx(float(p[0] - p[1]))
    assert margin[1].item() == pytest.approx(0.0)  # a tie: no margin
    assert margin[2].item() == pytest.approx(1.0)  # one allowed token
    assert torch.allclose(draft_signal("draft_entropy", logits), entropy_nats(logits))
    assert torch.allclose(draft_signal("target_window", logits), entropy_nats(logits))
    assert least_predictable("draft_margin") < 0 < least_predictable("draft_entropy")
    with pytest.raises(ValueError, match="unknown signal"):
        draft_signal("nope", logits)


def test_entmtp_policy_bins_on_the_sets_signal():
    """A draft_margin set is binned on the margin, not the entropy (high margin = predictable = deep)."""
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {1: 1.0}), TreeEntry(Tree.chain(4), (0.1, 3.5), {1: 1.5}))
    ts = TreeSet("entmtp-tiny", "hydra", "code", "draft_margin", (0.5,), entries)
    pol = EntMTPPolicy(ts)
    confident = StepView(0, 9.0, (), 1, 10, draft_margin=0.9)   # high entropy, but a clear top-1
    assert pol(confident).name == "chain:4"
    assert EntMTPPolicy(ts)(StepView(0, 0.1, (), 1, 10, draft_margin=0.05)).name == "chain:0"


def test_adaptive_ema_follows_sglang_rule():
    pol = AdaptiveEMAPolicy(max_depth=7, batch_size=1)
    assert pol(_view()).name == "chain:3"  # starts at the middle candidate of [1, 3, 5, 7]
    # all drafts accepted for a while: after warm-up (10) + interval (5) it steps up
    acc = (3,) * 15
    assert pol(_view(accepted=acc, entropies=(0.1,) * 15)).name == "chain:5"
    pol = AdaptiveEMAPolicy(max_depth=7, batch_size=1)
    assert pol(_view(accepted=(0,) * 15, entropies=(3.0,) * 15)).name == "chain:1"
    assert AdaptiveEMAPolicy(max_depth=5, batch_size=32)(_view()).name in ("chain:0", "chain:1")


def test_entmtp_policy_picks_by_entropy():
    pol = EntMTPPolicy(_set(), hysteresis=0.0)
    assert pol(_view(draft_entropy=0.1)).name == "chain:4"
    assert pol(_view(draft_entropy=5.0)).name == "chain:0"
    assert StaticPolicy(Tree.chain(2))(_view()).name == "chain:2"


def test_step_cost_fit_recovers_a_linear_cost_and_drops_negative_terms():
    from entmtp_sglang.calibrate.costs import fit_step_cost

    trees = [Tree.chain(0), Tree.chain(2), Tree.chain(4), Tree((-1, 0, 0, 0, 1, 2)), Tree((-1, 0, 0, 0, 0, 0, 0))]
    seconds = [0.010 + 0.0005 * t.num_nodes + 0.003 * t.max_depth for t in trees]
    m = fit_step_cost(trees, seconds)
    assert m.base == pytest.approx(0.010) and m.per_node == pytest.approx(0.0005)
    assert m.per_depth == pytest.approx(0.003)
    # cost falling with depth is noise: the depth term is dropped, never negative
    m = fit_step_cost(trees, [0.02 - 0.001 * t.max_depth for t in trees])
    assert m.per_depth == 0.0 and m.per_node >= 0.0 and all(m(t) > 0 for t in trees)


def test_chain0_keeps_its_measured_cost_apart_from_the_line():
    """One token per row is a matrix-vector product on a CPU, two or more a matrix product: a speculating
    step jumps above the plain one, and a line through both would price no speculation too high."""
    from entmtp_sglang.calibrate.costs import StepCostModel, cost_models_of, fit_step_cost
    from entmtp_sglang.tree.treeset import TreeEntry, TreeSet, from_json

    trees = [Tree.chain(0), Tree.chain(1), Tree.chain(2), Tree.chain(4), Tree((-1, 0, 0, 0, 1, 2))]
    seconds = [0.060] + [0.090 + 0.002 * t.num_nodes + 0.005 * t.max_depth for t in trees[1:]]
    m = fit_step_cost(trees, seconds)
    assert m(Tree.chain(0)) == pytest.approx(0.060) and m.plain == pytest.approx(0.060)
    assert m.base == pytest.approx(0.090) and m.per_node == pytest.approx(0.002)
    back = StepCostModel.from_json(m.to_json())
    assert back.to_json() == m.to_json() and back.plain == pytest.approx(0.060)
    # an older model without `plain` still reads, and prices chain:0 on the line
    old = StepCostModel.from_json({"base": 0.09, "per_node": 0.002, "per_depth": 0.005})
    assert old.plain == 0.0 and old(Tree.chain(0)) == pytest.approx(0.092)
    # a set file without chain:0 gets it at the measured plain cost
    ts = TreeSet("m", "eagle", "t", "draft_margin", (), (TreeEntry(Tree.chain(2), (1.0,), {1: 0.1}),),
                 provenance={"step_cost_model": {"1": m.to_json()}})
    loaded = from_json(ts.to_json())
    plain = next(t for t in loaded.trees if t.tree.num_nodes == 1)
    assert plain.cost(1) == pytest.approx(0.060) and cost_models_of(loaded)[1].to_json() == m.to_json()


def test_step_costs_are_measured_in_situ_for_every_tree(random_models):
    from types import SimpleNamespace

    from entmtp_sglang.calibrate.costs import measure_step_costs

    target, drafters = random_models
    bundle = SimpleNamespace(target=target, drafter_kind="hydra", drafter=drafters["hydra"])
    trees = [Tree.chain(0), Tree.chain(3), Tree((-1, 0, 0, 1, 1))]
    for batch in (1, 3):
        costs = measure_step_costs(bundle, trees, [[5, 6, 7], [8, 9]], batch, samples_per_tree=3,
                                   max_new_tokens=20)
        assert set(costs) == {t.parents for t in trees} and all(c > 0 for c in costs.values())


# --- EntMTP at batch size: one tree for the batch, plain decoding as an option, acceptance feedback -----

from types import SimpleNamespace  # noqa: E402

from entmtp_sglang.policy.selector import (  # noqa: E402
    acceptance_scale,
    batch_values,
    binned_expected,
    select_batch_tree,
    speculation_pays,
    tree_values,
)


def _compute_bound_set(acc_deep=(3.5, 0.2)):
    """chain:0, chain:1 and chain:4; at batch 32 a step costs in proportion to the tree's nodes (the
    target verifies 32 x nodes tokens), as on this CPU; at batch 1 chain:4 costs twice a plain step."""
    trees = (Tree.chain(0), Tree.chain(1), Tree.chain(4))
    acc = ((0.0, 0.0), (0.9, 0.1), acc_deep)
    entries = tuple(TreeEntry(t, a, {1: 0.010 * (1 + 0.25 * t.max_depth), 32: 0.1 * t.num_nodes})
                    for t, a in zip(trees, acc))
    return TreeSet("entmtp-tiny", "hydra", "code", "draft_entropy", (1.0,), entries)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.floats(0, 60))
def test_acceptance_scale_is_bounded_and_neutral_without_history(accepted, expected):
    s = acceptance_scale(accepted, expected)
    assert 0.25 <= s <= 2.0
    assert acceptance_scale(0, 0) == 1.0
    assert acceptance_scale(accepted + 1, expected) >= s  # more accepted never lowers it
    with pytest.raises(ValueError):
        acceptance_scale(1, 1, prior=0)


@settings(max_examples=200, deadline=None)
@given(st.floats(-1, 10), st.integers(1, 32), st.sampled_from([1, 8, 32]),
       st.one_of(st.none(), st.integers(0, 2)), st.floats(0, 0.3))
def test_batch_of_equal_requests_chooses_as_one_request(entropy, n, batch, current, hyst):
    ts = _set()
    values = sorted(tree_values(ts, ts.bin_of(entropy), batch))
    gaps = [b / a for a, b in zip(values, values[1:])] + ([values[-1] / tree_values(ts, ts.bin_of(entropy),
                                                                                   batch)[current]]
                                                            if current is not None else [])
    assume(all(abs(g - 1) > 1e-9 and abs(g - 1 - hyst) > 1e-9 for g in gaps))  # no float ties
    assert select_batch_tree(ts, [entropy] * n, batch, None, current, hyst) == \
        select_tree(ts, entropy, batch, current, hyst)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1, 10), min_size=1, max_size=32), st.one_of(st.none(), st.integers(1, 6)),
       st.lists(st.floats(0.25, 2.0), min_size=32, max_size=32))
def test_batch_selector_returns_a_tree_of_the_set_within_budget(entropies, budget, scales):
    ts = _set()
    i = select_batch_tree(ts, entropies, len(entropies), scales[: len(entropies)], max_nodes=budget)
    assert 0 <= i < len(ts.trees)
    if budget is not None:
        assert ts.trees[i].tree.num_nodes <= max(budget, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1, 10), min_size=1, max_size=32), st.floats(1.01, 3.0),
       st.lists(st.floats(0.25, 2.0), min_size=32, max_size=32))
def test_backs_off_to_plain_when_no_tree_can_pay_for_its_verification(entropies, dearer, scales):
    """If every tree costs more than (depth + 1) x a plain step, even accepting every draft cannot
    pay: the batch must decode plainly, whatever the entropies and acceptance scales."""
    plain = 0.05
    trees = (Tree.chain(0), Tree.chain(1), Tree.chain(4), Tree((-1, 0, 0, 1)))
    entries = tuple(TreeEntry(t, (min(2.0, t.max_depth), 0.0),
                              {32: plain * (dearer * (t.max_depth + 1) if t.max_depth else 1)})
                    for t in trees)
    ts = TreeSet("entmtp-tiny", "hydra", "code", "draft_entropy", (1.0,), entries)
    i = select_batch_tree(ts, entropies, 32, scales[: len(entropies)])
    assert ts.trees[i].tree.num_nodes == 1
    assert not speculation_pays(ts, 32, plain)


def test_one_predictable_request_does_not_make_the_batch_speculate():
    ts = _compute_bound_set()
    # one predictable request would choose chain:4 for itself at batch 1; in a batch of 32 the padding
    # to its tree makes all 32 pay five times a plain step
    many = [0.2] + [3.0] * 31
    assert ts.trees[select_batch_tree(ts, many, 32)].tree.name == "chain:0"
    assert ts.trees[select_batch_tree(ts, [0.2], 1)].tree.name == "chain:4"  # batch 1: deep
    values = batch_values(ts, [binned_expected(ts, h) for h in many], 32)
    assert values[0] == max(values)
    # speculation pays at batch 1, and at batch 32 only if some bin beats a plain step
    assert speculation_pays(ts, 1, 0.0105)
    assert not speculation_pays(ts, 32, 0.1)
    assert speculation_pays(ts, 32, 0.2)  # if plain decoding were that slow, chain:1 would pay


def _state(entropies_low: list[bool], vocab: int = 64):
    """Drafter logits whose entropy is ~0 (peaked) or log(vocab) (uniform) per request."""
    logits = torch.zeros(len(entropies_low), vocab)
    for i, low in enumerate(entropies_low):
        if low:
            logits[i, 3] = 50.0
    return SimpleNamespace(root_logits=logits)


def test_policy_chooses_one_tree_for_the_batch_through_the_observer():
    ts = _compute_bound_set()
    pol = EntMTPPolicy(ts, hysteresis=0.0)
    low = [True] + [False] * 31
    pol.observe(_state(low), None, None, [True] * 32)
    trees = {pol(StepView(i, 0.01 if low[i] else 4.1, (), 32, 10)).name for i in range(32)}
    assert trees == {"chain:0"}
    # all predictable: still one tree for all
    pol.observe(_state([True] * 32), None, None, [True] * 32)
    chosen = {pol(StepView(i, 0.01, (), 32, 10)).name for i in range(32)}
    assert len(chosen) == 1
    # without the observer, each request chooses for itself (batch 1 semantics)
    alone = EntMTPPolicy(ts, hysteresis=0.0)
    assert alone(StepView(0, 0.01, (), 1, 10)).name == "chain:4"


def test_acceptance_feedback_backs_off_when_drafts_fail():
    ts = _compute_bound_set()
    pol = EntMTPPolicy(ts, hysteresis=0.0)
    hist: list[StepRecord] = []
    names = []
    for _ in range(12):  # the set expects 3.5 accepted drafts at low entropy; this stream accepts none
        t = pol(StepView(0, 0.2, tuple(hist), 1, 10 + len(hist)))
        names.append(t.name)
        hist.append(StepRecord(t.name, t.num_nodes, 0, [0.2], 0.2, 0.01))
    assert names[0] == "chain:4" and names[-1] != "chain:4"
    assert pol.scale(0) < 0.5
    # without feedback it keeps believing the calibration
    blind = EntMTPPolicy(ts, hysteresis=0.0, feedback=False)
    hist = [StepRecord("chain:4", 5, 0, [0.2], 0.2, 0.01)] * 12
    assert blind(StepView(0, 0.2, tuple(hist), 1, 22)).name == "chain:4"


def test_entmtp_system_runs_without_drafter_unless_speculation_pays():
    from entmtp_sglang.bench import reference

    ts = _compute_bound_set()
    measured = {1: True, 32: True}
    spans_given = []

    def admits(d, t, b, n, make, make_spans=None):
        spans_given.append(make_spans is not None)
        return measured[b], "measured"

    def system(spans: bool = False):
        s = reference._EntMTP.__new__(reference._EntMTP)
        s.drafter, s.batch_sizes, s.with_spans = "hydra", (1, 32), spans
        s.res = SimpleNamespace(ctx=SimpleNamespace(cache={}, log=lambda msg: None), tree_set=lambda *a: ts,
                                plain_cost=lambda b: {1: 0.0105, 32: 0.1}[b], admits=admits)
        return s

    streams = SimpleNamespace(task="code")
    # predicted: no tree beats a plain step at batch 32, so no drafter (whatever a measurement says)
    assert system().make_chooser(streams, list(range(32)), 32, 16) is reference.PLAIN_ONLY
    assert isinstance(system().make_chooser(streams, [0], 1, 16), EntMTPPolicy)
    # predicted to pay, but measured slower than plain decoding: no drafter either
    measured[1] = False
    assert system().make_chooser(streams, [0], 1, 16) is reference.PLAIN_ONLY
    # a -spans system is measured with its spans
    assert spans_given == [False, False]
    measured[1] = True
    assert isinstance(system(spans=True).make_chooser(streams, [0], 1, 16), EntMTPPolicy)
    assert spans_given == [False, False, True]


def test_cost_is_that_of_every_row_the_engine_computes():
    """One request left of 32: the engine still computes 32 rows padded to its tree, so the policy must
    price the tree at batch 32, not as if the request were alone."""
    ts = _compute_bound_set()
    pol = EntMTPPolicy(ts, hysteresis=0.0)
    pol.observe(_state([True] * 32), None, None, [True] + [False] * 31)
    assert pol(StepView(0, 0.01, (), 1, 10)).name == "chain:0"
    assert EntMTPPolicy(ts, hysteresis=0.0)(StepView(0, 0.01, (), 1, 10)).name == "chain:4"  # truly alone


def test_records_keep_the_margin_and_read_older_files(tmp_path):
    from entmtp_sglang.calibrate.build import signals_of
    from entmtp_sglang.calibrate.records import load_records, save_records
    from entmtp_sglang.tree.records import PositionRecord

    recs = [PositionRecord(0, i, 1.0 + i, 2.0, (0, 1), 0.5 - 0.1 * i) for i in range(3)]
    path = tmp_path / "r.jsonl"
    save_records(recs, path)
    assert load_records(path) == recs
    assert signals_of(recs, 8)["draft_margin"] == [r.draft_margin for r in recs]
    path.write_text(json.dumps([[0, 0, 1.0, 2.0, [0, 1]], [0, 1, 1.5, 2.0, [1, 0]]]))  # before margins
    old = load_records(path)
    assert [r.ranks for r in old] == [(0, 1), (1, 0)]
    assert "draft_margin" not in signals_of(old, 8)  # no margin recorded: not a candidate signal


def test_calibration_picks_the_signal_that_predicts_acceptance():
    """Acceptance follows the margin and not the entropy: calibration bins on the margin; a forced signal
    is honoured; reused cost models are not re-measured."""
    import random

    from entmtp_sglang.calibrate.build import build_tree_set
    from entmtp_sglang.calibrate.costs import StepCostModel
    from entmtp_sglang.calibrate.records import CalibrationConfig
    from entmtp_sglang.tree.records import PositionRecord

    rng = random.Random(0)
    recs = []
    for i in range(400):
        m = rng.random()
        ranks = (0, 0, 0) if m > 0.6 else (0, 3, 3) if m > 0.3 else (3, 3, 3)
        recs.append(PositionRecord(i // 50, i % 50, rng.uniform(0, 5), rng.uniform(0, 5), ranks, m))

    class FakeBundle:  # only the names: costs are given, nothing is measured
        path = type("P", (), {"name": "entmtp-tiny"})()
        drafter_kind = "hydra"

    models = {b: StepCostModel(0.01, 0.001, 0.002) for b in (1, 8, 32)}
    cfg = CalibrationConfig("hydra", "code", max_depth=3, num_bins=3)
    ts, _ = build_tree_set(FakeBundle(), recs, [], cfg, log=lambda *a: None, models=models)
    assert ts.signal == "draft_margin"
    low, high = ts.bin_of(0.1), ts.bin_of(0.9)
    assert max(e.expected_accepted[high] for e in ts.trees) > 2.5
    assert max(e.expected_accepted[low] for e in ts.trees) < 0.5
    forced, _ = build_tree_set(FakeBundle(), recs, [], cfg, log=lambda *a: None, signal="draft_entropy",
                               models=models)
    assert forced.signal == "draft_entropy"
    with pytest.raises(ValueError, match="not in these records"):
        build_tree_set(FakeBundle(), recs, [], cfg, log=lambda *a: None, signal="bogus", models=models)


def test_every_shipped_tree_set_loads_with_its_records():
    """Shipped sets validate; each bins on a signal its calibration records carry, with the recorded
    correlations, and holds chain:0 or deeper trees within its drafter's depth."""
    from pathlib import Path

    from entmtp_sglang.calibrate.build import signals_of
    from entmtp_sglang.calibrate.records import load_records

    root = Path(__file__).resolve().parent.parent / "trees"
    paths = sorted(root.glob("entmtp-tiny-*.json"))
    assert len(paths) >= 15  # medusa and hydra: 7 tasks each; eagle: mixed
    for path in paths:
        ts = load_tree_set(path, model="entmtp-tiny")
        records = load_records(path.with_suffix(".records.jsonl"))
        assert ts.signal in signals_of(records, 8), path.name
        assert ts.signal in ts.provenance.get("signal_correlations", {ts.signal: 0}), path.name


def test_the_oracle_rests_the_drafter_exactly_where_chain0_is_best_in_hindsight():
    from entmtp_sglang.policy.policies import OraclePolicy

    entries = (TreeEntry(Tree.chain(0), (0.0,), {1: 1.0}), TreeEntry(Tree.chain(2), (1.0,), {1: 1.5}))
    ts = TreeSet("m", "eagle", "t", "draft_margin", (), entries)
    # output positions 0..5: the depth-1 draft is rank 0 (accepted) at 0 and 3 only
    ranks = [[[0, 0], [5, 5], [5, 5], [0, 5], [5, 5], [5, 5]]]
    oracle = OraclePolicy(ts, ranks, [4])
    assert not oracle.rests([0])                                   # nothing known before the first step
    assert oracle(StepView(0, 1.0, (), 1, 4)).name == "chain:2"    # root at 0: accepts 2, next root at 3
    assert not oracle.rests([0])                                   # at 3, chain:2 pays (1 accepted)
    assert oracle(StepView(0, 1.0, (), 1, 7)).name == "chain:2"    # next root at 5
    assert oracle.rests([0])                                       # at 5: chain:0, rest; next at 6
    assert oracle.rests([0])                                       # past the known continuation: plain
