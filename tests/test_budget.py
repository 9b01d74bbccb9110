"""A batch's budget across its requests (policy/budget.py) and the ragged step-cost model it divides by
(costs/ragged_cost.py): the greedy over per-request hulls against enumerating every assignment, pins, room,
hysteresis, the all-resting batch, clear errors; the cost fit and its online refit. No SGLang.

What the brute-force comparisons hold the greedy to (budget.py's contract):
* with a cost affine in the tokens verified at each (depth, batch size) and nondecreasing in depth from depth 1
  (`RaggedStepCost`, or any such table), `allocate` finds the best value over *every* assignment, whether the
  options' (nodes, expected tokens) curves are concave or not (options under a request's hull are never needed);
* with any other nondecreasing cost (a jump, a square root), each state the greedy passes through (`frontier`)
  expects the most tokens within its token count and depth cap, and `allocate` is the best of those states; it
  may then lose to brute force (`test_a_cost_with_a_jump_can_beat_the_greedy` shows where).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from entmtp_sglang.costs.ragged_cost import (
    MIN_POINTS,
    OnlineRaggedCost,
    RaggedStep,
    RaggedStepCost,
    fit_ragged_cost,
    nonnegative_lstsq,
    resting_seconds,
    set_ragged_prior,
)
from entmtp_sglang.policy.budget import (
    BudgetConfig,
    RequestOptions,
    TreeOption,
    allocate,
    allocate_exhaustive,
    allocate_shared,
    budget_config,
    evaluate,
    frontier,
    options_of,
    request_options,
    rest_option,
    shared_shape_cost,
    upper_hull,
)
from entmtp_sglang.policy.controller import RequestInput, TreeController, UnknownTreeError
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet

REL = 1e-9

# -- a batch by hand ------------------------------------------------------------------------------------------
#   seconds = 10 ms + 1 ms per verified token + 2 ms per drafted level
#
#   option        nodes depth   E[tokens]: json  chat
#   chain:0 (rest)  1     0                1.0   1.0
#   chain:1         2     1                1.9   1.2
#   chain:4         5     4                4.6   1.5
#
#   json    chat      tokens  depth  E     seconds  tokens/s
#   rest    rest        2      0     2.0   0.012    166.7
#   chain:1 chain:1     4      1     3.1   0.016    193.8
#   chain:4 chain:4    10      4     6.1   0.028    217.9   <- the best one tree for the whole batch
#   chain:4 chain:1     7      4     5.8   0.025    232.0
#   chain:4 rest        6      4     5.6   0.024    233.3   <- the best per request
COST = RaggedStepCost(base=0.010, per_token=0.001, per_level=0.002)


def _chains(e1: float, e4: float, **kw) -> RequestOptions:
    return RequestOptions((rest_option(), TreeOption("chain:1", 2, 1, e1), TreeOption("chain:4", 5, 4, e4)), **kw)


def test_each_request_its_own_tree_by_hand():
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5)]
    a = allocate(batch, COST)
    assert a.trees == ("chain:4", "chain:0") and a.resting == (False, True)
    assert (a.total_tokens, a.max_depth, a.num_nodes) == (6, 4, (5, 1))
    assert a.expected_tokens == pytest.approx(5.6) and a.seconds == pytest.approx(0.024)
    assert a.tokens_per_second == pytest.approx(5.6 / 0.024)
    same_tree = max(evaluate(batch, (k, k), COST).tokens_per_second for k in range(3))
    assert same_tree == pytest.approx(6.1 / 0.028) and same_tree < a.tokens_per_second


def test_every_request_rests_when_drafting_costs_too_much():
    dear = RaggedStepCost(base=0.010, per_token=0.001, per_level=0.050)
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5), _chains(1.1, 1.1)]
    a = allocate(batch, dear)
    assert a.all_rest and a.trees == ("chain:0",) * 3 and a.total_tokens == 3 and a.expected_tokens == 3.0
    assert a == allocate_exhaustive(batch, dear)


def test_one_request_rests_only_after_its_drafts_stop_paying():
    # a resting row inside a speculating batch: the chat request's chain:1 adds 0.2 tokens for 1 ms
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5)]
    assert allocate(batch, COST).trees[1] == "chain:0"
    assert allocate([_chains(1.9, 4.6), _chains(1.5, 1.6)], COST).trees == ("chain:4", "chain:1")


def test_a_tie_goes_to_the_fewer_tokens():
    # seconds = 0.25 + 0.25 per token: resting 1 / 0.5 and chain:1 1.5 / 0.75 are both 2 tokens/s
    tie = RaggedStepCost(0.25, 0.25, 0.0)
    batch = [RequestOptions((rest_option(), TreeOption("chain:1", 2, 1, 1.5)))]
    assert allocate(batch, tie).trees == ("chain:0",) and allocate(batch, tie).tokens_per_second == 2.0


# -- the hull ---------------------------------------------------------------------------------------------------
def test_upper_hull_keeps_the_rising_concave_vertices():
    #  E
    #  4 |              x (8, 3.8)   . (10, 3.7) falls: left out
    #  3 |        x (5, 3.0)
    #  2 |  x (2, 2.0)    (3, 1.8) and (4, 2.5) under the chord from (2, 2) to (5, 3); (2, 1.5) under (2, 2): left out
    #  1 x (1, 1.0)
    pts = [(1, 1.0), (2, 2.0), (3, 1.8), (5, 3.0), (8, 3.8), (10, 3.7), (4, 2.5), (2, 1.5)]
    assert upper_hull(pts) == [0, 1, 3, 4]
    assert upper_hull([(1, 1.0), (2, 2.0), (3, 3.0)]) == [0, 2]      # collinear: the middle point is not a vertex
    assert upper_hull([(3, 2.0)]) == [0]
    assert upper_hull([(2, 2.0), (2, 2.5), (1, 1.0)]) == [2, 1]       # same nodes: the most expected


# -- brute force on random batches -----------------------------------------------------------------------------
def _request(rng: random.Random, concave: bool, room: bool = False, pin: bool = False) -> RequestOptions:
    n = rng.randint(2, 5)
    nodes = sorted(rng.sample(range(2, 14), n - 1))
    scale, width = rng.uniform(0.3, 5.0), rng.uniform(1.0, 6.0)
    opts = [rest_option(0)]
    for k, m in enumerate(nodes, start=1):
        depth = rng.randint(1, min(m - 1, 5)) if not concave else min(m - 1, 1 + (m - 2) // 2)
        e = 1 + scale * (1 - math.exp(-(m - 1) / width)) if concave else rng.uniform(1.0, depth + 1.0)
        opts.append(TreeOption(k, m, depth, min(e, depth + 1.0)))
    rng.shuffle(opts)
    return RequestOptions(tuple(opts), room=rng.randint(1, 14) if room else None,
                          pin=rng.choice(opts).tree if pin else None)


def _affine_cost(rng: random.Random):
    """Random costs affine in tokens at each depth and nondecreasing in depth from depth 1; the all-resting
    step's price anywhere (below or above what a speculating step with as many tokens would cost)."""
    if rng.random() < 0.5:
        plain = rng.uniform(0.0, 0.05) if rng.random() < 0.7 else 0.0
        return RaggedStepCost(rng.uniform(0, 0.05), rng.uniform(0, 0.01), rng.uniform(0, 0.01), rng.uniform(0, 0.005),
                              plain, rng.uniform(0, 0.01) if plain else 0.0)
    bases = list(itertools.accumulate(rng.uniform(0, 0.01) for _ in range(7)))
    slopes = list(itertools.accumulate(rng.uniform(0, 0.004) for _ in range(7)))
    plain = rng.uniform(0.005, 0.06)
    return lambda tokens, depth, batch: (plain * batch if depth == 0
                                         else 0.001 + bases[depth] + slopes[depth] * tokens + 0.001 * batch)


@pytest.mark.parametrize("concave", [True, False])
def test_allocation_equals_brute_force_with_affine_costs(concave):
    rng = random.Random(36 + concave)
    for _ in range(150):
        batch = [_request(rng, concave, room=rng.random() < 0.3, pin=rng.random() < 0.15)
                 for _ in range(rng.randint(2, 4))]
        cost = _affine_cost(rng)
        config = BudgetConfig(hysteresis=0.0, max_depth=rng.choice([None, None, 2, 3]))
        got, best = allocate(batch, cost, config), allocate_exhaustive(batch, cost, config)
        assert got.tokens_per_second == pytest.approx(best.tokens_per_second, rel=REL), (batch, got, best)
        assert got == evaluate(batch, got.choices, cost)


def _brute(batch, config):
    """Every allowed assignment as arrays: total tokens, expected tokens, deepest depth."""
    from entmtp_sglang.policy.budget import _allowed

    rows = [(sum(r.options[k].num_nodes for r, k in zip(batch, c)),
             math.fsum(r.options[k].expected_tokens for r, k in zip(batch, c)),
             max(r.options[k].max_depth for r, k in zip(batch, c)))
            for c in itertools.product(*[_allowed(r, config) for r in batch])]
    return tuple(np.array(col) for col in zip(*rows))


@pytest.mark.parametrize("concave", [True, False])
def test_every_state_of_the_greedy_expects_the_most_within_its_tokens(concave):
    rng = random.Random(360 + concave)
    for _ in range(60):
        batch = [_request(rng, concave, room=rng.random() < 0.3) for _ in range(rng.randint(2, 4))]
        config = BudgetConfig()
        totals, expected, depths = _brute(batch, config)
        for cap in sorted(set(depths.tolist())):
            states = frontier(batch, cap, config)
            assert [t for t, _, _ in states] == sorted(t for t, _, _ in states)
            for total, e, choices in states:
                within = (totals <= total) & (depths <= cap)
                assert e == pytest.approx(expected[within].max(), rel=REL)
                check = evaluate(batch, choices, COST)
                assert (check.total_tokens, check.expected_tokens) == (total, pytest.approx(e, rel=REL))
                assert check.max_depth <= cap


def test_with_other_costs_the_allocation_is_the_best_state_of_the_greedy():
    rng = random.Random(3636)
    costs = [lambda t, d, b: 0.01 + 0.004 * math.sqrt(t) + 0.002 * d,        # concave in tokens
             lambda t, d, b: 0.01 + 0.0005 * t + 0.002 * d + 0.02 * (t > 2 * b + 2)]   # a jump
    for _ in range(80):
        batch = [_request(rng, rng.random() < 0.5) for _ in range(rng.randint(2, 4))]
        cost = rng.choice(costs)
        got = allocate(batch, cost, BudgetConfig(hysteresis=0.0))
        caps = {o.max_depth for r in batch for o in r.options}
        states = max(evaluate(batch, c, cost).tokens_per_second for cap in caps for _, _, c in frontier(batch, cap))
        rest = tuple(next(k for k, o in enumerate(r.options) if o.resting) for r in batch)
        moves = max(evaluate(batch, rest[:i] + (k,) + rest[i + 1:], cost).tokens_per_second
                    for i, r in enumerate(batch) for k in range(len(r.options)))
        assert got.tokens_per_second == pytest.approx(max(states, moves), rel=REL)
        assert got.tokens_per_second <= allocate_exhaustive(batch, cost).tokens_per_second * (1 + REL)


def test_a_cost_with_a_jump_can_beat_the_greedy():
    #   option   nodes depth E     slope                     step         tokens  E    seconds
    #   a deep    13    5    6.0   5.0 / 12 = 0.42           rest          3     3.0  0.010
    #   b short    6    5    2.8   1.8 / 5  = 0.36           b (a move)    8     4.8  0.010   <- allocate
    #                                                        b, c         13     6.6  0.010   <- brute force
    # The greedy takes a first (15 tokens, past the jump), so b and c without a is neither a state nor a move.
    a = RequestOptions((rest_option(), TreeOption("deep", 13, 5, 6.0)))
    b = RequestOptions((rest_option(), TreeOption("short", 6, 5, 2.8)))
    jump = lambda tokens, depth, batch: 0.010 + (0.050 if tokens > 13 else 0.0)
    assert allocate([a, b, b], jump).trees == ("chain:0", "short", "chain:0")
    assert allocate_exhaustive([a, b, b], jump).trees == ("chain:0", "short", "short")
    affine = RaggedStepCost(0.010, 0.001, 0.0)
    assert allocate([a, b, b], affine) == allocate_exhaustive([a, b, b], affine)


def test_a_dear_plain_step_makes_a_lone_small_upgrade_best():
    # plain decoding (every row resting) priced above a speculating step of one more token: the best step moves
    # one request to a tree under its hull (2 nodes, 1.01 tokens), which no greedy state holds (a single move)
    cost = RaggedStepCost(0.010, 0.001, 0.0, plain_base=0.050)
    #   tiny alone: 2.01 tokens / 13 ms = 154.6 tokens/s; both tiny 144.3; one deep 125.0; all rest 40.0
    a = RequestOptions((rest_option(), TreeOption("tiny", 2, 1, 1.01), TreeOption("deep", 9, 3, 1.5)))
    got = allocate([a, a], cost)
    assert got.trees == ("tiny", "chain:0") and got.tokens_per_second == pytest.approx(2.01 / 0.013)
    assert allocate_exhaustive([a, a], cost).tokens_per_second == got.tokens_per_second


# -- pins, room, hysteresis ----------------------------------------------------------------------------------------
def test_pins_fix_a_request_even_when_it_costs_the_batch():
    batch = [_chains(1.9, 4.6, pin="chain:0"), _chains(1.2, 1.5, pin="chain:4")]
    a = allocate(batch, COST)
    assert a.trees == ("chain:0", "chain:4") and a.max_depth == 4
    # a deep pin sets the batch's depth; the others then take what pays at that depth
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5, pin="chain:4")]
    a = allocate(batch, COST)
    assert a.trees == ("chain:4", "chain:4") and a == allocate_exhaustive(batch, COST)


def test_room_caps_each_request_and_a_pin_that_does_not_fit_is_dropped():
    a = allocate([_chains(1.9, 4.6, room=3), _chains(1.2, 1.5)], COST)
    assert a.trees[0] == "chain:1"
    a = allocate([_chains(1.9, 4.6, room=1), _chains(1.9, 4.6)], COST)
    assert a.trees == ("chain:0", "chain:4")
    a = allocate([_chains(1.9, 1.95, pin="chain:4", room=2), _chains(1.2, 1.5)], COST)
    assert a.trees[0] == "chain:1"       # chain:4 (5 nodes) is over its room: chosen freely within it
    a = allocate([_chains(1.9, 4.6), _chains(1.9, 4.6)], COST, BudgetConfig(max_nodes=2))
    assert a.trees == ("chain:1", "chain:1")
    a = allocate([_chains(1.9, 4.6), _chains(1.9, 4.6)], COST, BudgetConfig(max_depth=0))
    assert a.all_rest


def test_room_and_pins_hold_on_random_batches():
    rng = random.Random(7)
    for _ in range(100):
        batch = [_request(rng, rng.random() < 0.5, room=True, pin=rng.random() < 0.3) for _ in range(3)]
        a = allocate(batch, _affine_cost(rng))
        for r, k in zip(batch, a.choices):
            assert r.options[k].num_nodes <= r.room
            pinned = r.options[r.index_of(r.pin)] if r.pin is not None else None
            if pinned is not None and pinned.num_nodes <= r.room:
                assert r.options[k].tree == r.pin


def test_hysteresis_keeps_a_previous_tree_that_is_nearly_as_good():
    # 233.3 tokens/s with chat resting; chat's previous chain:1 gives 232.0 (0.6% less)
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5, previous="chain:1")]
    assert allocate(batch, COST, BudgetConfig(hysteresis=0.02)).trees == ("chain:4", "chain:1")
    assert allocate(batch, COST, BudgetConfig(hysteresis=0.001)).trees == ("chain:4", "chain:0")
    # json's previous chain:1 is far worse (193.8): it switches
    batch = [_chains(1.9, 4.6, previous="chain:1"), _chains(1.2, 1.5, previous="chain:0")]
    assert allocate(batch, COST, BudgetConfig(hysteresis=0.02)).trees == ("chain:4", "chain:0")
    # a previous tree that no longer fits is not kept
    batch = [_chains(1.9, 4.6), _chains(1.2, 1.5, previous="chain:1", room=1)]
    assert allocate(batch, COST, BudgetConfig(hysteresis=0.5)).trees == ("chain:4", "chain:0")


def test_hysteresis_stays_within_its_margin_on_random_batches():
    rng = random.Random(11)
    for _ in range(100):
        batch = [_request(rng, rng.random() < 0.5) for _ in range(rng.randint(2, 4))]
        batch = [RequestOptions(r.options, previous=rng.choice(r.options).tree) for r in batch]
        cost, h = _affine_cost(rng), rng.choice([0.0, 0.01, 0.05, 0.2])
        best = allocate_exhaustive(batch, cost).tokens_per_second
        got = allocate(batch, cost, BudgetConfig(hysteresis=h))
        assert got.tokens_per_second * (1 + h) >= best * (1 - REL)
        if h == 0.0:
            assert got.tokens_per_second == pytest.approx(best, rel=REL)
        everyone_keeps = allocate(batch, cost, BudgetConfig(hysteresis=1e9))
        assert everyone_keeps.trees == tuple(r.previous for r in batch)


def test_the_same_inputs_give_the_same_choice():
    # what lets every tensor-parallel rank compute its rows' trees itself
    rng = random.Random(5)
    batch = [_request(rng, False) for _ in range(4)]
    cost = _affine_cost(rng)
    assert allocate(batch, cost) == allocate(list(batch), cost)


# -- errors -----------------------------------------------------------------------------------------------------
def test_degenerate_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="at least one request"):
        allocate([], COST)
    with pytest.raises(ValueError, match="at least one request"):
        allocate_exhaustive([], COST)
    with pytest.raises(ValueError, match="exactly one resting option"):
        RequestOptions((TreeOption("chain:1", 2, 1, 1.5),))
    with pytest.raises(ValueError, match="exactly one resting option"):
        RequestOptions((rest_option("a"), rest_option("b")))
    with pytest.raises(ValueError, match="at least its resting option"):
        RequestOptions(())
    with pytest.raises(ValueError, match="repeat"):
        RequestOptions((rest_option(), TreeOption("x", 2, 1, 1.5), TreeOption("x", 3, 1, 1.5)))
    with pytest.raises(ValueError, match="pinned tree 'nope'"):
        _chains(1.9, 4.6, pin="nope")
    with pytest.raises(ValueError, match="room must be"):
        _chains(1.9, 4.6, room=0)
    with pytest.raises(ValueError, match=r"expected_tokens must lie in \[1, max_depth \+ 1\] = \[1, 2\]"):
        TreeOption("chain:1", 2, 1, 2.5)
    with pytest.raises(ValueError, match="max_depth must be"):
        TreeOption("t", 3, 3, 1.5)
    with pytest.raises(ValueError, match="num_nodes must be"):
        TreeOption("t", 0, 0, 1.0)
    with pytest.raises(ValueError, match="hysteresis"):
        BudgetConfig(hysteresis=-0.1)
    with pytest.raises(ValueError, match=r"step cost must be a positive number of seconds, got -1.0 for \d+ tokens, "
                                         r"max depth [14], batch size 2"):
        allocate([_chains(1.9, 4.6), _chains(1.2, 1.5)], lambda t, d, b: 0.03 if d == 0 else -1.0)
    with pytest.raises(ValueError, match="positive number of seconds, got nan"):
        allocate([_chains(1.9, 4.6)], lambda t, d, b: math.nan)
    with pytest.raises(ValueError, match="per_token must be a finite number >= 0"):
        RaggedStepCost(0.01, -0.001, 0.0)
    with pytest.raises(ValueError, match="must cost something"):
        RaggedStepCost(0.0, 0.0, 0.0)


# -- from the controller ----------------------------------------------------------------------------------------
def _set() -> TreeSet:
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {1: 1.0}), TreeEntry(Tree.chain(1), (0.05, 0.9), {1: 1.1}),
               TreeEntry(Tree.chain(4), (0.3, 3.6), {1: 2.5}))
    return TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries)


def test_request_options_come_from_the_controller():
    c = TreeController(_set(), hysteresis=0.03, max_nodes=4)
    reqs = request_options(c, [RequestInput("json", 0.9, room=7), RequestInput("chat", 0.1, pin="chain:1")],
                           previous={"json": 2})
    assert [o.expected_tokens for o in reqs[0].options] == pytest.approx([1.0, 1.9, 4.6])
    assert [(o.tree, o.num_nodes, o.max_depth) for o in reqs[0].options] == [(0, 1, 0), (1, 2, 1), (2, 5, 4)]
    assert (reqs[0].room, reqs[0].previous, reqs[0].pin) == (7, 2, None)
    assert (reqs[1].pin, reqs[1].previous) == (1, None)
    assert budget_config(c) == BudgetConfig(0.03, 4, None)
    assert allocate(reqs, COST, budget_config(c)).trees == (1, 1)     # max_nodes 4 leaves json chain:1
    assert allocate(reqs, COST).trees == (2, 1)
    with pytest.raises(UnknownTreeError, match="chain:0, chain:1, chain:4"):
        request_options(c, [RequestInput("a", 0.1, pin="nope")])
    # feedback: a request whose drafts were rejected gets its expectations scaled down
    c.choose([RequestInput("bad", 0.9)])
    c.record("bad", 0)
    bad = request_options(c, [RequestInput("bad", 0.9)])[0]
    assert bad.options[2].expected_tokens == pytest.approx(min(c.scale("bad") * 3.6, 4) + 1)
    assert options_of([Tree.chain(2)], [5.0])[0].expected_tokens == 3.0   # clipped to the depth


# -- one node count shared by every row (SGLang's strided verify) ------------------------------------------------
#   seconds = 10 ms + 1 ms per verified token + 2 ms per drafted level (COST)
#
#   option   nodes depth  E[tokens]: json  chat
#   rest       1    0               1.0   1.0
#   wide4      4    1               1.6   1.5     (three siblings under the root)
#   deep4      4    3               3.4   1.2     (a chain of three)
#
#   json   chat    tokens depth  E    seconds  tokens/s
#   rest   rest      2     0    2.0   0.012   166.7
#   wide4  wide4     8     1    3.1   0.020   155.0
#   deep4  deep4     8     3    4.6   0.024   191.7   <- one tree for the batch
#   deep4  wide4     8     3    4.9   0.024   204.2   <- each its own tree at the shared shape
def _shared(json_e: tuple[float, float], chat_e: tuple[float, float]) -> list[RequestOptions]:
    return [RequestOptions((rest_option(), TreeOption("wide4", 4, 1, w), TreeOption("deep4", 4, 3, d)))
            for w, d in (json_e, chat_e)]


def test_each_request_its_own_tree_at_a_shared_shape_by_hand():
    batch = _shared((1.6, 3.4), (1.5, 1.2))
    a = allocate_shared(batch, COST)
    assert a.trees == ("deep4", "wide4") and a.num_nodes == (4, 4) and a.max_depth == 3
    assert a.tokens_per_second == pytest.approx(4.9 / 0.024)
    one_tree = max(evaluate(batch, (k, k), COST).tokens_per_second for k in range(3))
    assert one_tree == pytest.approx(4.6 / 0.024) and one_tree < a.tokens_per_second
    assert allocate_shared(_shared((1.05, 1.1), (1.02, 1.01)), COST).all_rest   # drafts that do not pay


def _shared_request(rng: random.Random, room: bool = False, pin: bool = False) -> RequestOptions:
    """Options of a few node counts, several trees (depths) per count, random expectations."""
    opts, k = [rest_option(0)], 1
    for n in rng.sample([2, 3, 4, 6], rng.randint(1, 3)):
        for depth in rng.sample(range(1, n), rng.randint(1, min(3, n - 1))):
            opts.append(TreeOption(k, n, depth, rng.uniform(1.0, depth + 1.0)))
            k += 1
    rng.shuffle(opts)
    return RequestOptions(tuple(opts), room=rng.randint(1, 6) if room else None,
                          pin=rng.choice(opts).tree if pin else None)


def test_shared_allocation_equals_brute_force_over_shared_assignments():
    rng = random.Random(3636)
    differ = 0
    for _ in range(200):
        batch = [_shared_request(rng, room=rng.random() < 0.3, pin=rng.random() < 0.2)
                 for _ in range(rng.randint(1, 4))]
        cost = _affine_cost(rng)
        config = BudgetConfig(hysteresis=0.0, max_depth=rng.choice([None, None, 2]))
        got, best = allocate_shared(batch, cost, config), allocate_exhaustive(batch, cost, config, shared=True)
        assert got.tokens_per_second == pytest.approx(best.tokens_per_second, rel=REL), (batch, got, best)
        assert len(set(got.num_nodes)) == 1 and got == evaluate(batch, got.choices, cost)
        differ += len(set(got.trees)) > 1
    assert differ > 10   # rows of one step took different trees


def test_shared_pins_room_and_hysteresis():
    batch = _shared((1.6, 3.4), (1.5, 1.2))
    pinned = [batch[0], dataclasses.replace(batch[1], pin="deep4")]
    assert allocate_shared(pinned, COST).trees == ("deep4", "deep4")
    clash = [dataclasses.replace(batch[0], pin="chain:0"), dataclasses.replace(batch[1], pin="wide4")]
    assert allocate_shared(clash, COST).trees == ("deep4", "wide4")    # no size both pins fit: pins dropped
    third = dataclasses.replace(batch[1], pin="wide4")
    # two pins of 4 nodes outvote one of 1: those kept, the chain:0 row drafts at their size
    assert allocate_shared(clash + [third], COST).trees == ("deep4", "wide4", "wide4")
    assert allocate_shared([batch[0], dataclasses.replace(batch[1], room=3)], COST).all_rest
    # chat ran deep4 last step: keeping it costs 4.6 / 0.024 against 4.9 / 0.024, within 10 % but not 2 %
    prev = [batch[0], dataclasses.replace(batch[1], previous="deep4")]
    assert allocate_shared(prev, COST, BudgetConfig(hysteresis=0.1)).trees == ("deep4", "deep4")
    assert allocate_shared(prev, COST, BudgetConfig(hysteresis=0.02)).trees == ("deep4", "wide4")


def _shape_set() -> TreeSet:
    wide, deep = Tree((-1, 0, 0, 0), name="wide4"), Tree((-1, 0, 1, 2), name="deep4")
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {1: 0.012, 2: 0.012}),
               TreeEntry(wide, (0.5, 0.6), {1: 0.020, 2: 0.020}),
               TreeEntry(deep, (0.2, 2.4), {1: 0.024, 2: 0.024}))
    return TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries)


def test_the_controller_gives_each_row_its_tree():
    """`TreeController.choose_rows`: a confident row (margin 0.9) deep, an uncertain one (0.1) wide, at one
    shape; the acceptance feedback and the all-rest back-off per row, as `choose` keeps them for the batch."""
    c = TreeController(_shape_set(), hysteresis=0.0)
    reqs = [RequestInput("json", 0.9), RequestInput("chat", 0.1)]
    assert c.choose_rows(reqs) == (2, 1)
    assert c.current["json"] == 2 and c.current["chat"] == 1
    assert c.requests["json"].pending == pytest.approx(2.4) and c.requests["chat"].pending == pytest.approx(0.5)
    c.record("json", 3)
    c.record("chat", 0)
    assert c.scale("json") > 1 > c.scale("chat")
    cap = TreeController(_shape_set(), hysteresis=0.0)
    assert cap.choose_rows([RequestInput("a", 0.9, room=1)]) == (0,)   # only the root fits
    assert cap.rests(["batch"])   # an all-rest step backs off
    one = TreeController(_shape_set(), hysteresis=0.0).choose([RequestInput("json", 0.9), RequestInput("chat", 0.1)])
    assert one == 2   # one tree for the batch: the deep one for both


def test_shared_shape_cost_reads_the_sets_tree_of_that_shape():
    ts = _shape_set()
    cost = shared_shape_cost([t.tree for t in ts.trees], lambda i, b: ts.trees[i].cost(b))
    assert cost(8, 3, 2) == pytest.approx(0.024) and cost(8, 1, 2) == pytest.approx(0.020)
    assert cost(2, 0, 2) == pytest.approx(0.012)
    with pytest.raises(ValueError, match="no tree of the set has 4 nodes and depth 2"):
        cost(8, 2, 2)


# -- the ragged step-cost model ---------------------------------------------------------------------------------
TRUE = RaggedStepCost(base=0.020, per_token=0.0015, per_level=0.003, per_row=0.0005, plain_base=0.015,
                      plain_per_row=0.0004)


def _steps(model, batches=(1, 2, 4, 8), repeats=1):
    out = []
    for b in batches:
        for d in range(0, 5):
            for extra in ((0,) if d == 0 else (d, d + 2, 3 * d)):
                out += [RaggedStep(b + extra, d, b, model(b + extra, d, b))] * repeats
    return out


def test_the_fit_recovers_a_noiseless_model():
    got = fit_ragged_cost(_steps(TRUE))
    for k, v in TRUE.to_json().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-6, abs=1e-12), k
    assert RaggedStepCost.from_json(TRUE.to_json()) == TRUE


def test_the_fit_takes_medians_and_keeps_costs_nonnegative():
    rng = random.Random(1)
    steps = []
    for s in _steps(TRUE, repeats=5):
        steps.append(RaggedStep(s.total_tokens, s.max_depth, s.batch_size, s.seconds * rng.uniform(0.99, 1.01)))
    steps += [RaggedStep(s.total_tokens, s.max_depth, s.batch_size, 10.0) for s in _steps(TRUE)]  # one stall each
    got = fit_ragged_cost(steps)
    assert got.per_token == pytest.approx(TRUE.per_token, rel=0.05)
    assert got(12, 3, 4) == pytest.approx(TRUE(12, 3, 4), rel=0.02)
    # deeper steps that measured cheaper (noise): the level term is dropped, not made negative
    falling = [RaggedStep(b + 2 * d, d, b, 0.02 + 0.001 * b - 0.0005 * d) for b in (1, 2, 4) for d in (1, 2, 3)]
    got = fit_ragged_cost(falling)
    assert got.per_level == 0.0 and min(got.to_json().values()) >= 0.0


def test_nonnegative_lstsq_beats_every_other_nonnegative_point():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(12), rng.uniform(1, 10, 12), rng.uniform(0, 4, 12)])
    y = x @ np.array([0.5, 0.2, -0.3]) + rng.normal(0, 0.01, 12)
    w = np.ones(12)
    c = nonnegative_lstsq(x, y, w)
    assert (c >= 0).all() and c[2] == 0.0
    best = float(np.sum((x @ c - y) ** 2))
    for trial in rng.uniform(0, 1, (2000, 3)):
        assert float(np.sum((x @ trial - y) ** 2)) >= best - 1e-12


def test_few_points_scale_the_prior():
    prior = RaggedStepCost(0.010, 0.001, 0.002, 0.0, plain_base=0.008, plain_per_row=0.001)
    two = [RaggedStep(3, 1, 2, 2 * prior(3, 1, 2)), RaggedStep(6, 2, 2, 2 * prior(6, 2, 2))]
    got = fit_ragged_cost(two, prior)
    assert got.line(9, 3, 4) == pytest.approx(2 * prior.line(9, 3, 4))
    assert (got.plain_base, got.plain_per_row) == (prior.plain_base, prior.plain_per_row)
    assert fit_ragged_cost([], prior) == prior
    with pytest.raises(ValueError, match=f"a fit needs {MIN_POINTS}"):
        fit_ragged_cost(two)
    # the all-resting step measured at one batch size: through the prior's per-row slope
    got = fit_ragged_cost(two + [RaggedStep(4, 0, 4, 0.020)], prior)
    assert got(4, 0, 4) == pytest.approx(0.020) and got.plain_per_row == prior.plain_per_row
    # ... never a negative intercept: a plain step cheaper than that slope times its rows is all per row
    got = fit_ragged_cost(two + [RaggedStep(4, 0, 4, 0.002)], prior)
    assert (got.plain_base, got.plain_per_row) == (0.0, pytest.approx(0.0005)) and got(8, 0, 8) == pytest.approx(0.004)


def test_ragged_steps_are_validated():
    with pytest.raises(ValueError, match="cannot be verified by 4 rows at max depth 2"):
        RaggedStep(5, 2, 4, 0.01)
    with pytest.raises(ValueError, match="exactly 4 when every row rests"):
        RaggedStep(6, 0, 4, 0.01)
    with pytest.raises(ValueError, match="seconds must be positive"):
        RaggedStep(6, 1, 4, -0.01)


def test_online_refit_drops_warmups_and_refits_when_due():
    assert OnlineRaggedCost().refit() is None              # nothing measured, no prior: no model yet
    steps = _steps(TRUE, batches=(1, 2, 4)) * 2
    online = OnlineRaggedCost(refit_every=len(steps) + 1)
    for s in steps:
        online.observe(s.total_tokens, s.max_depth, s.batch_size, s.seconds)
    assert online.cost is None and not online.due()
    online.observe(5, 1, 1, None)   # counted, not timed
    kept = {p: len(t) for p, t in online.times.items()}
    assert sum(kept.values()) == len(steps) - len({(s.max_depth, s.batch_size) for s in steps})   # warm-ups dropped
    # a point timed fewer than 3 times gives its fastest step only (online.ROBUST), the rest every kept step
    assert len(online.observed()) == sum(n if n >= 3 else 1 for n in kept.values())
    assert online.steps == len(steps) + 1 and online.due()
    got = online.refit()
    assert online.cost is got and not online.due()
    for k, v in TRUE.to_json().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-6, abs=1e-12), k
    # with a prior, it is the cost until the first refit, and a refit on few points scales it
    prior = TRUE.scaled(0.5)
    online = OnlineRaggedCost(prior=prior)
    assert online.cost is prior
    for _ in range(3):
        online.observe(4, 1, 2, TRUE(4, 1, 2))
    assert online.refit().line(10, 2, 4) == pytest.approx(TRUE.line(10, 2, 4))


def test_one_slow_ragged_step_does_not_price_its_point_out():
    """A point timed once or twice is priced by its fastest step: one step that met a busy machine (10x) must not
    make every step of its shape look dear (the failure online.py's ROBUST fixed for per-tree costs)."""
    online = OnlineRaggedCost()
    points = [(4, 1, 2), (6, 2, 2), (9, 2, 4), (12, 3, 4)]
    for p in points:
        online.observe(*p, TRUE(*p))   # the warm-up of each (depth, batch), dropped
        online.observe(*p, TRUE(*p))
    online.observe(9, 2, 4, 10 * TRUE(9, 2, 4))   # the point's second time: a busy machine
    got = online.refit()
    assert got(9, 2, 4) == pytest.approx(TRUE(9, 2, 4), rel=1e-6)
    for _ in range(3):   # from three times on, the median prices it
        online.observe(9, 2, 4, 2 * TRUE(9, 2, 4))
    assert online.refit()(9, 2, 4) > 1.5 * TRUE(9, 2, 4)


def test_a_fit_from_a_slow_stretch_is_forgotten_once_no_speculating_step_is_timed_again():
    """Speculating steps timed while the machine was busy (3x) price speculation out, so the policy rests every
    step and no speculating step is timed again: after `stale_refits` refit periods of resting steps alone their
    points are forgotten and the fit is the prior's line again (the policy speculates, fresh times price it)."""
    prior = TRUE.scaled(1.1)
    online = OnlineRaggedCost(prior=prior, refit_every=16, stale_refits=2)
    points = [(4, 1, 1), (6, 2, 1), (9, 2, 1), (12, 3, 1)]
    for p in points:
        for _ in range(4):
            online.observe(*p, 3 * TRUE(*p))
    assert online.refit()(9, 2, 1) == pytest.approx(3 * TRUE(9, 2, 1), rel=1e-6)   # the slow stretch's fit
    rests = 0
    while online.refit()(9, 2, 1) > 2 * TRUE(9, 2, 1):   # resting steps alone from now on
        for _ in range(online.refit_every):
            online.observe(1, 0, 1, TRUE(1, 0, 1))
        rests += online.refit_every
        assert rests <= 3 * online.refit_every, "the slow fit was never forgotten"
    assert rests > online.refit_every   # not at the first refit: a point is kept for stale_refits periods
    assert online.cost(9, 2, 1) == pytest.approx(prior(9, 2, 1), rel=1e-6)
    assert online.cost(1, 0, 1) == pytest.approx(TRUE(1, 0, 1), rel=1e-6)   # the resting steps' own times stay
    with pytest.raises(ValueError, match="stale_refits"):
        OnlineRaggedCost(stale_refits=0)


def test_without_a_prior_a_forgotten_fit_is_dropped_and_uncounted_steps_keep_the_clock():
    """A server whose set has no ragged fit of its own: once the slow stretch's points are forgotten the fit is
    dropped (None: the worker prices by the set's line again), not kept for the server's life; steps it cannot time
    (a resting step whose rows took spans, observed as None) still count towards forgetting."""
    online = OnlineRaggedCost(refit_every=16, stale_refits=2)
    for p in [(12, 1, 8), (16, 2, 8), (20, 2, 8)]:
        for _ in range(4):
            online.observe(*p, 3 * TRUE(*p))
    assert online.refit() is not None
    refits = 0
    while online.cost is not None:
        for _ in range(online.refit_every):
            online.observe(8, 0, 8, None)      # counted, not timed
        online.refit()
        refits += 1
        assert refits <= 3, "the slow fit was never forgotten"
    assert refits >= 2 and not online.times
    # the prior of a server's own fit: the set's fit through SGLang where it has one
    from types import SimpleNamespace
    assert set_ragged_prior(SimpleNamespace(provenance={"ragged_step_cost": TRUE.to_json()})) == TRUE
    assert set_ragged_prior(SimpleNamespace(provenance={})) is None


def test_with_a_prior_a_few_points_scale_it_until_enough_are_measured():
    """A serving worker's prior is the set's own fit: its first few points (timed while the machine is busy) scale
    that line rather than fit four coefficients through three points; from `min_points` points on, the fit is
    their own least-squares line."""
    prior = TRUE.scaled(1.3)
    online = OnlineRaggedCost(prior=prior, refit_every=8, min_points=8)
    points = [(p, d, b) for b in (1, 4) for p, d in ((b + 1, 1), (b + 3, 2), (b + 5, 2), (b + 7, 3))]
    for p in points[:3]:
        for _ in range(2):
            online.observe(*p, 2 * TRUE(*p))                   # busy: twice the true time
    few = online.refit()
    assert few(9, 2, 4) / prior(9, 2, 4) == pytest.approx(2 / 1.3, rel=1e-6)   # the prior's shape, scaled
    assert few.per_token > 0 and few.per_level > 0
    for p in points[3:]:
        for _ in range(2):
            online.observe(*p, TRUE(*p))
    fitted = online.refit()
    assert len({q for q in online.times if q[1] > 0}) == 8
    assert fitted(9, 2, 4) != pytest.approx(few(9, 2, 4), rel=1e-3)     # their own line now


def test_a_resting_step_with_spans_times_the_plain_step_it_would_have_been():
    """Its span tokens come off at the line's per-token price; no price, or nothing left: not timed (None)."""
    assert resting_seconds(0.060, 5, TRUE) == pytest.approx(0.060 - 5 * TRUE.per_token)
    assert resting_seconds(0.060, 0, TRUE) == pytest.approx(0.060)
    assert resting_seconds(0.060, 5, None) is None
    assert resting_seconds(0.001, 5, TRUE) is None
    online = OnlineRaggedCost(prior=TRUE, refit_every=4)
    for _ in range(8):   # a mixed batch resting every step, each with spans: the plain regime is measured
        online.observe(16, 0, 16, resting_seconds(0.050 + 4 * TRUE.per_token, 4, online.cost))
    assert online.refit()(16, 0, 16) == pytest.approx(0.050)


def test_allocating_with_a_fitted_cost_equals_brute_force():
    cost = fit_ragged_cost(_steps(TRUE))
    rng = random.Random(99)
    for _ in range(40):
        batch = [_request(rng, rng.random() < 0.5) for _ in range(4)]
        got, best = allocate(batch, cost, BudgetConfig(hysteresis=0.0)), allocate_exhaustive(batch, cost)
        assert got.tokens_per_second == pytest.approx(best.tokens_per_second, rel=REL)
