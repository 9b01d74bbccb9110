"""The runtime-state table (sglang/shapes.py): one state per tree shape, reused by trees of that shape, none for
chain:0; pure, no SGLang (the server side is tests/test_sglang_tree_shapes.py)."""

from __future__ import annotations

import pytest

from entmtp_sglang.sglang.shapes import Shape, ShapeStates
from entmtp_sglang.sglang.tree_plan import plan_tree
from entmtp_sglang.tree import Tree

PARENTS = {
    "chain:0": [-1],
    "w3d1": [-1, 0, 0, 0],
    "chain:2": [-1, 0, 1],
    "w2d2": [-1, 0, 0, 1, 2],
    "w2d2b": [-1, 0, 0, 1, 1],          # another tree of w2d2's shape: 2 levels, 5 tokens
    "chain:4": [-1, 0, 1, 2, 3],
    "w2d4": [-1, 0, 0, 1, 1, 3, 5],
}


def plans():
    return [plan_tree(Tree(tuple(p), name=n), 3, Tree(tuple(p)).max_depth) for n, p in PARENTS.items()]


def test_one_state_per_shape_built_once_in_order_of_size():
    built = []
    table = ShapeStates.build(plans(), lambda s: built.append(s) or f"state{s.num_steps}x{s.num_draft_tokens}")
    assert built == sorted(built) == [Shape(1, 4), Shape(2, 3), Shape(2, 5), Shape(4, 5), Shape(4, 7)]
    assert len(table) == 5
    names = list(PARENTS)
    assert table.state_of(names.index("chain:0")) is None                 # resting has no state
    assert table.state_of(names.index("w2d2")) is table.state_of(names.index("w2d2b")) == "state2x5"
    assert table.state_of(names.index("w2d4")) == "state4x7"


def test_states_that_exist_are_reused_and_unused_ones_dropped():
    start = object()
    built = []
    table = ShapeStates.build(plans(), lambda s: built.append(s) or object(),
                              built={Shape(4, 7): start, Shape(9, 9): "the start-up shape no tree has"})
    assert Shape(4, 7) not in built and table.state_of(len(PARENTS) - 1) is start
    assert Shape(9, 9) not in table.states and len(table) == 5


def test_a_tree_without_its_state_is_refused():
    with pytest.raises(ValueError, match=r"no runtime state for tree shapes \[Shape\(num_steps=2"):
        ShapeStates([Shape(1, 2), Shape(2, 3)], {Shape(1, 2): "s"})
