"""The one EntMTP policy object (policy/controller.py) that the reference engine and the SGLang worker both call:
pins, the room cap, acceptance feedback, hysteresis, one tree per batch, the predictor; no SGLang needed."""

import pytest

from entmtp_sglang.policy.controller import RequestInput, TreeController, UnknownTreeError
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.acceptance import AcceptancePredictor, IsotonicMap
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet


def _set(predictor: dict | None = None) -> TreeSet:
    """Two signal bins (margin < 0.5: unpredictable, >= 0.5: predictable); chain:0, chain:1, chain:4."""
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {1: 1.0, 8: 2.0}),
               TreeEntry(Tree.chain(1), (0.05, 0.9), {1: 1.1, 8: 2.6}),
               TreeEntry(Tree.chain(4), (0.3, 3.6), {1: 2.5, 8: 6.0}))
    return TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries, predictor=predictor)


def test_signal_bins_choose_deep_when_predictable_and_plain_when_not():
    c = TreeController(_set())
    assert c.choose([RequestInput("a", 0.9)]) == 2          # (3.6 + 1) / 2.5 beats (0.9 + 1) / 1.1
    c = TreeController(_set())
    assert c.choose([RequestInput("a", 0.1)]) == 0          # nothing pays for its cost


def test_one_tree_for_the_batch_at_its_cost():
    c = TreeController(_set())
    # one predictable request among eight: the batch pays chain:4's batch-8 cost for everyone
    batch = [RequestInput(i, 0.9 if i == 0 else 0.1) for i in range(8)]
    assert c.choose(batch, rows=8) == 0


def test_room_caps_the_tree_and_no_room_means_plain():
    c = TreeController(_set())
    assert c.choose([RequestInput("a", 0.9, room=3)]) == 1   # chain:4 (5 nodes) does not fit
    c = TreeController(_set(), max_nodes=2)
    assert c.choose([RequestInput("a", 0.9)]) == 1
    c = TreeController(_set())
    assert c.choose([RequestInput("a", 0.9, room=0)]) is None


def test_pins_need_agreement_and_a_known_name():
    c = TreeController(_set())
    assert c.choose([RequestInput("a", 0.1, pin="chain:4"), RequestInput("b", 0.1, pin="chain:4")]) == 2
    assert c.choose([RequestInput("a", 0.1, pin="chain:4"), RequestInput("b", 0.1)]) == 0
    assert c.choose([RequestInput("a", 0.1, pin="chain:4", room=2)]) == 0   # the pin does not fit
    with pytest.raises(UnknownTreeError, match="chain:0, chain:1, chain:4"):
        c.choose([RequestInput("a", 0.1, pin="nope")])


def test_feedback_backs_off_a_request_whose_drafts_are_rejected():
    c = TreeController(_set())
    for _ in range(10):
        idx = c.choose([RequestInput("a", 0.9)])
        c.record("a", 0)   # calibrated for 3.6, accepted nothing
    assert idx == 1 and c.scale("a") == 0.25   # the scale's floor: 0.25 * 3.6 no longer pays for chain:4
    # another request is not affected, and forgetting clears the history
    assert c.choose([RequestInput("b", 0.9)], group="b") == 2
    c.forget("a")
    assert c.scale("a") == 1.0
    # feedback off: the table alone decides
    c = TreeController(_set(), feedback=False)
    for _ in range(10):
        c.choose([RequestInput("a", 0.9)])
        c.record("a", 0)
    assert c.choose([RequestInput("a", 0.9)]) == 2


def test_hysteresis_keeps_the_current_tree_when_close():
    ts = _set()
    c = TreeController(ts, hysteresis=1.0)
    assert c.choose([RequestInput("a", 0.9)]) == 2
    # unpredictable now: chain:0 is 1.0/s vs chain:4's 0.52/s, within a factor 2: keep chain:4
    assert c.choose([RequestInput("a", 0.1)]) == 2
    c = TreeController(ts, hysteresis=0.0)
    c.choose([RequestInput("a", 0.9)])
    assert c.choose([RequestInput("a", 0.1)]) == 0


def test_predictor_replaces_the_bins_when_the_request_has_probabilities():
    sure = AcceptancePredictor(tuple(IsotonicMap((0.0, 0.5), (0.0, 1.0)) for _ in range(4)),
                               tuple(((0.0,), (1.0,)) for _ in range(4)), (0.5,))
    c = TreeController.for_tree_set(_set(sure.to_json()))
    assert c.predictor is not None
    # the bins say unpredictable; the drafter is sure of every depth: chain:4
    assert c.choose([RequestInput("a", 0.1, probs=(0.9, 0.05))]) == 2
    # unsure drafter: plain, whatever the bin
    assert c.choose([RequestInput("b", 0.9, probs=(0.3, 0.2))], group="b") == 0
    # without probabilities the bins decide
    assert c.choose([RequestInput("c", 0.9)], group="c") == 2
    assert TreeController.for_tree_set(_set(sure.to_json()), use_predictor=False).predictor is None


def test_keep_only_forgets_finished_requests():
    c = TreeController(_set())
    for key in "abc":
        c.choose([RequestInput(key, 0.9)], group=key)
        c.record(key, 4)
    c.keep_only({"b"})
    assert set(c.requests) == {"b"}
