"""A parent-array tree laid out on SGLang's EAGLE buffers (entmtp_sglang.sglang.tree_plan), checked by
decoding the layout with the torch version of SGLang's own tree builder (build_tree_kernel_efficient_cpu,
itself checked against SGLang's Triton kernel in test_sglang_ops.py). No SGLang needed."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entmtp_sglang.sglang.cpu.ops import TREE_MASK_QLEN_ONLY, build_tree_kernel_efficient_cpu
from entmtp_sglang.sglang.tree_plan import TreeShapeError, plan_tree, required_topk
from entmtp_sglang.tree import Tree, build_buffers


@st.composite
def trees(draw, max_nodes: int = 16):
    n = draw(st.integers(1, max_nodes))
    return Tree(tuple([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]))


def sglang_parents(plan) -> list[int]:
    """Run SGLang's tree builder on the plan's encoding; return each SGLang node's parent (SGLang order)."""
    n, topk = plan.num_nodes, plan.topk
    parent_list = torch.tensor([plan.parent_list])
    selected = torch.tensor([plan.selected], dtype=torch.long).reshape(1, n - 1)
    mask = torch.zeros(n * n, dtype=torch.bool)
    positions = torch.zeros(n, dtype=torch.long)
    r_index = torch.zeros(1, n, dtype=torch.long)
    r_next = torch.zeros(1, n, dtype=torch.long)
    r_sib = torch.zeros(1, n, dtype=torch.long)
    build_tree_kernel_efficient_cpu(parent_list, selected, torch.tensor([7]), mask, positions, r_index, r_next,
                                    r_sib, topk, max(plan.num_steps, 1), n, TREE_MASK_QLEN_ONLY)
    parents = [-1] * n
    for p in range(n):
        c = int(r_next[0, p])
        while c != -1:
            parents[c] = p
            c = int(r_sib[0, c])
    m = mask.view(n, n)
    return parents, m, positions - 7


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 2))
def test_sglang_builds_exactly_the_planned_tree(tree, extra_topk):
    topk = required_topk(tree) + extra_topk
    plan = plan_tree(tree, topk, tree.max_depth)
    got_parents, got_mask, got_pos = sglang_parents(plan)
    # SGLang's node k (k >= 1) is our node selected_nodes[k - 1]; node 0 is the root in both
    ours = [0, *plan.selected_nodes]
    back = {o: k for k, o in enumerate(ours)}
    expect = [-1] + [back[tree.parents[o]] for o in ours[1:]]
    assert got_parents == expect
    buf = build_buffers(tree)
    perm = torch.tensor(ours)
    assert torch.equal(got_mask, buf.ancestor_mask[perm][:, perm])
    assert torch.equal(got_pos, buf.positions[perm])
    # siblings keep their rank order: SGLang's k-th child of a node is the drafter's k-th token
    for p in range(tree.num_nodes):
        kids = [back[c] for c in tree.children[p]]
        assert kids == sorted(kids)


@settings(max_examples=100, deadline=None)
@given(trees())
def test_draft_rows_attend_to_exactly_their_ancestors(tree):
    plan = plan_tree(tree, required_topk(tree), tree.max_depth)
    slot_of = {}
    for step, col in enumerate(plan.columns):
        for c, node in enumerate(col):
            slot_of[node] = c * plan.num_steps + step
    for step, col in enumerate(plan.columns):
        for c, node in enumerate(col):
            chain, x = set(), node
            while x != 0:
                chain.add(slot_of[x])
                x = tree.parents[x]
            assert set(plan.ancestor_offsets[step][c]) == chain


def test_too_narrow_or_shallow_buffers_are_refused():
    tree = Tree((-1, 0, 0, 0, 1))
    assert required_topk(tree) == 3
    try:
        plan_tree(tree, 2, 2)
    except TreeShapeError as e:
        assert "topk >= 3" in str(e)
    else:
        raise AssertionError("expected TreeShapeError")
