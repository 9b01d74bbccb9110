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


def test_embedding_places_a_prefix_tree_inside_a_larger_one():
    from entmtp_sglang.tree.topology import embedding

    big = Tree((-1, 0, 0, 1, 2, 3))             # 0 -> 1, 2; 1 -> 3; 2 -> 4; 3 -> 5
    assert embedding(Tree.chain(0), big) == (0,)
    assert embedding(Tree.chain(3), big) == (0, 1, 3, 5)
    assert embedding(Tree((-1, 0, 0, 2)), big) == (0, 1, 2, 4)
    assert embedding(Tree.chain(4), big) is None          # too deep
    assert embedding(Tree((-1, 0, 0, 0)), big) is None    # a third root child the big tree lacks


def _staged_set() -> TreeSet:
    """chain:0..3 costing 1.0 + 0.1 per level drafted + 0.1 per node verified; the predictor maps a drafted
    probability p to q = p (0.9 per level beyond what is known)."""
    q = AcceptancePredictor(tuple(IsotonicMap((0.0, 0.5, 0.99), (0.0, 0.5, 0.99)) for _ in range(3)),
                            tuple(((0.9,),) for _ in range(3)), ())
    entries = tuple(TreeEntry(Tree.chain(d), (0.0,), {1: 1.0 + 0.2 * d, 8: 2.0 + 0.4 * d}) for d in range(4))
    prov = {"step_cost_model": {"1": {"base": 1.0, "per_node": 0.0, "per_depth": 0.1}}}
    return TreeSet("m", "eagle", "t", "draft_margin", (), entries, provenance=prov, predictor=q.to_json())


def test_restage_keeps_the_chosen_tree_while_its_drafts_stay_likely():
    from entmtp_sglang.policy.controller import StageInput

    c = TreeController.for_tree_set(_staged_set())
    idx = c.choose([RequestInput("a", 0.0, probs=(0.99,))])
    assert c.tree_set.trees[idx].tree.name == "chain:3"   # deep table: 0.9 per level beyond depth 1
    same = c.restage(idx, [StageInput("a", (0.99,), (1.0, 0.99, 0.99, None))], drafted_depth=2)
    assert same == (idx, (0, 1, 2, 3))


def test_restage_cuts_the_tree_at_a_draft_the_target_will_reject():
    from entmtp_sglang.policy.controller import StageInput

    c = TreeController.for_tree_set(_staged_set())
    idx = c.choose([RequestInput("a", 0.0, probs=(0.99,))])
    # the depth-2 draft has probability 0.01: nothing past depth 1 will be accepted; chain:1, its nodes 0, 1
    new, image = c.restage(idx, [StageInput("a", (0.99,), (1.0, 0.99, 0.01, None))], drafted_depth=2)
    assert c.tree_set.trees[new].tree.name == "chain:1" and image == (0, 1)
    # the feedback now expects what chain:1 was predicted to accept
    assert c.requests["a"].pending == pytest.approx(0.99)
    # a drafted depth-1 node at probability 0 makes every prefix but chain:0 worthless
    new, image = c.restage(idx, [StageInput("b", (0.99,), (1.0, 0.0, 0.5, None))], drafted_depth=2)
    assert c.tree_set.trees[new].tree.name == "chain:0" and image == (0,)


def test_restage_without_a_predictor_keeps_the_tree():
    c = TreeController(_set())
    from entmtp_sglang.policy.controller import StageInput

    assert c.restage(2, [StageInput("a", (0.9,), (1.0, 0.0, 0.0, 0.0, 0.0))], 2) == (2, (0, 1, 2, 3, 4))


def test_backing_off_rests_the_drafter_1_2_4_steps_until_a_tree_pays_again():
    c = TreeController(_set(), hysteresis=0.0, max_rest=4)
    assert not c.rests(["a"])                      # nothing chosen yet: draft
    pattern = []
    for _ in range(4):
        assert c.choose([RequestInput("a", 0.1)], group="a") == 0
        n = 0
        while c.rests(["a"]):
            n += 1
        pattern.append(n)
    assert pattern == [1, 2, 4, 4]
    assert c.choose([RequestInput("a", 0.9)], group="a") == 2   # predictable again: speculate, no rest
    assert not c.rests(["a"])
    assert c.choose([RequestInput("a", 0.1)], group="a") == 0   # a new run of back-offs starts at 1
    assert c.rests(["a"]) and not c.rests(["a"])
    c.choose([RequestInput("b", 0.1)], group="b")
    assert not c.rests(["a", "b"]) and c.rests(["b"])           # a step rests only if every group does
    assert not TreeController(_set(), max_rest=0).rests(["a"])
    with pytest.raises(ValueError, match="max_rest"):
        TreeController(_set(), max_rest=-1)


def test_the_controller_is_what_engines_call_a_tree_chooser():
    from entmtp_sglang.policy.chooser import TreeChooser
    from entmtp_sglang.tree.treeset import load_tree_set, shipped_tree_set

    assert isinstance(TreeController(load_tree_set(shipped_tree_set("hydra", "code"))), TreeChooser)


def test_one_policy_registry_feeds_the_cli_the_server_and_entmtp_policy():
    from entmtp_sglang import cli
    from entmtp_sglang.policy.registry import CLI_POLICIES, ENTMTP_POLICIES, POLICIES, SERVER_POLICIES
    from entmtp_sglang.sglang.config import SERVER_POLICIES as server

    assert server is SERVER_POLICIES and set(SERVER_POLICIES) <= set(ENTMTP_POLICIES) <= set(CLI_POLICIES)
    assert all(f"  {name:<16} " in cli.GENERATE_EPILOG for name in CLI_POLICIES) and "oracle" not in CLI_POLICIES
    assert set(POLICIES) == set(CLI_POLICIES) | {"oracle"}
