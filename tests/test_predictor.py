"""The per-node acceptance predictor (tree/acceptance.py) and the policy's choice with hand-made calibrations."""

import json
import random

import pytest

from entmtp_sglang.calibrate.records import load_records, save_records
from entmtp_sglang.policy.selector import predicted_expected, select_by_expected
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.acceptance import AcceptancePredictor, IsotonicMap, fit_predictor, isotonic
from entmtp_sglang.tree.construct import accepted_on
from entmtp_sglang.tree.records import PositionRecord
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet, TreeSetError, from_json


def _constant(q: float, depth: int = 4, rank: int = 3) -> AcceptancePredictor:
    """Every node accepted with probability q given its parent, whatever the draft says."""
    return AcceptancePredictor(tuple(IsotonicMap((0.0,), (q,)) for _ in range(depth)),
                               tuple(((q,) * rank,) for _ in range(depth)), ())


def _set(trees: list[Tree], costs: list[float]) -> TreeSet:
    return TreeSet("m", "medusa", "t", "draft_margin", (),
                   tuple(TreeEntry(t, (0.0,), {1: c}) for t, c in zip(trees, costs)))


def test_isotonic_is_monotone_and_fits_a_step():
    xs = [i / 100 for i in range(100)]
    ys = [1.0 if x > 0.5 else 0.0 for x in xs]
    kx, ky = isotonic(xs, ys)
    assert list(ky) == sorted(ky)
    m = IsotonicMap(kx, ky)
    assert m(0.1) == pytest.approx(0.0) and m(0.9) == pytest.approx(1.0)
    rng = random.Random(0)
    noisy = [rng.random() < x for x in xs]
    m = IsotonicMap(*isotonic(xs, [float(v) for v in noisy]))
    assert all(m(a) <= m(b) for a, b in zip(xs, xs[1:]))


def test_expected_accepted_is_the_sum_of_path_products():
    pred = _constant(0.5)
    chain = Tree.chain(3)
    assert pred.expected_accepted(chain, [[0.9, 0.05, 0.01]]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert pred.expected_accepted(Tree.chain(0), [[0.9]]) == 0.0
    # root -> two children (ranks 0, 1), the first with a child: 0.5 + 0.5 + 0.25
    assert pred.expected_accepted(Tree((-1, 0, 0, 1)), [[0.9, 0.05, 0.01]]) == pytest.approx(1.25)
    # beyond the predictor's ranks a node is never accepted
    assert pred.node_q(1, 5, [[0.9]]) == 0.0


def test_a_node_with_probability_zero_never_makes_a_deeper_tree_win():
    # depth 1 is accepted for sure, depth 2 never: chain:2 costs more and gains nothing over chain:1
    pred = AcceptancePredictor((IsotonicMap((0.0,), (1.0,)), IsotonicMap((0.0,), (0.0,))),
                               (((1.0,),), ((0.0,),)), ())
    ts = _set([Tree.chain(0), Tree.chain(1), Tree.chain(2)], [1.0, 1.1, 1.1000001])
    exp = predicted_expected(ts, pred, [[0.9]])
    assert exp == pytest.approx([0.0, 1.0, 1.0])
    assert ts.trees[select_by_expected(ts, [exp], 1)].tree.name == "chain:1"
    # even at equal cost the deeper tree does not beat the shallower one (ties keep the first)
    ts = _set([Tree.chain(0), Tree.chain(1), Tree.chain(2)], [1.0, 1.1, 1.1])
    assert ts.trees[select_by_expected(ts, [predicted_expected(ts, pred, [[0.9]])], 1)].tree.name == "chain:1"


def test_with_every_probability_one_the_deepest_affordable_tree_wins():
    pred = _constant(1.0)
    trees = [Tree.chain(d) for d in range(5)]
    ts = _set(trees, [1.0 + 0.1 * d for d in range(5)])
    exp = predicted_expected(ts, pred, [[1.0, 0.0, 0.0]])
    assert exp == pytest.approx([0, 1, 2, 3, 4])
    assert ts.trees[select_by_expected(ts, [exp], 1)].tree.name == "chain:4"
    # the room cap: only trees of at most 3 nodes are affordable
    assert ts.trees[select_by_expected(ts, [exp], 1, max_nodes=3)].tree.name == "chain:2"


def test_chain0_wins_when_no_tree_gains_more_than_it_costs():
    pred = _constant(0.1)
    ts = _set([Tree.chain(0), Tree.chain(1), Tree.chain(3)], [1.0, 1.2, 1.5])
    exp = predicted_expected(ts, pred, [[0.2, 0.1, 0.1]])
    assert all((e + 1) / t.cost(1) < 1.0 for e, t in zip(exp[1:], ts.trees[1:]))
    assert select_by_expected(ts, [exp], 1) == 0


def _records(n: int, seed: int = 0) -> list[PositionRecord]:
    """Synthetic calibration: the true token's rank at each depth drawn from the recorded draft
    probabilities themselves (a perfectly calibrated drafter)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        probs, ranks = [], []
        for _ in range(3):
            top = sorted((rng.random() ** 3 for _ in range(4)), reverse=True)
            s = sum(top) * (1 + rng.random())
            p = [x / s for x in top]
            u, rank, acc = rng.random(), 6, 0.0
            for k, x in enumerate(p):
                acc += x
                if u < acc:
                    rank = k
                    break
            probs.append(tuple(round(x, 3) for x in p))
            ranks.append(rank)
        out.append(PositionRecord(i // 20, i % 20, 1.0, 1.0, tuple(ranks), 0.5, tuple(probs)))
    return out


def test_fitted_predictor_is_calibrated_and_tracks_acceptance():
    recs = _records(4000)
    pred = fit_predictor(recs)
    assert pred.max_depth == 3 and pred.max_rank == 4
    for d in range(3):  # calibrated drafter: q(p) ~ p
        assert pred.by_depth[d](0.8) == pytest.approx(0.8, abs=0.12)
        assert pred.by_depth[d](0.1) == pytest.approx(0.1, abs=0.08)
    test = _records(1000, seed=1)
    tree = Tree.chain(3)
    predicted = sum(pred.expected_accepted(tree, r.draft_probs) for r in test) / len(test)
    actual = sum(accepted_on(tree, r.ranks) for r in test) / len(test)
    assert predicted == pytest.approx(actual, rel=0.1)


def test_records_keep_draft_probabilities_and_old_files_still_load(tmp_path):
    recs = _records(5)
    path = tmp_path / "r.records.jsonl"
    save_records(recs, path)
    back = load_records(path)
    assert [r.draft_probs for r in back] == [r.draft_probs for r in recs]
    old = [[0, 0, 1.0, 1.0, [0, 1], 0.5]]
    path.write_text(json.dumps(old))
    assert load_records(path)[0].draft_probs == ()
    with pytest.raises(ValueError, match="draft probabilities"):
        fit_predictor(load_records(path))


def test_tree_set_carries_a_valid_predictor_and_rejects_a_malformed_one():
    pred = fit_predictor(_records(500))
    data = _set([Tree.chain(0), Tree.chain(2)], [1.0, 1.2]).to_json()
    data["predictor"] = pred.to_json()
    ts = from_json(json.loads(json.dumps(data)))
    assert AcceptancePredictor.from_json(ts.predictor) == AcceptancePredictor.from_json(pred.to_json())
    data["predictor"] = {"by_depth": [{"x": [0.0, 0.5], "y": [0.9, 0.1]}], "deep": [[[0.5]]], "root_edges": []}
    with pytest.raises(TreeSetError, match="predictor"):
        from_json(data)
    data["predictor"] = {"deep": []}
    with pytest.raises(TreeSetError, match="predictor"):
        from_json(data)
