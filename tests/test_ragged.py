"""Ragged node counts inside SGLang's strided verify (issue 36, item 2), without SGLang: padded trees draft their
real nodes as the trees themselves do, verify links over the real nodes are SGLang's own lists when every node is
real, the packed verify attends as the full one on every real query, and the ragged budget equals brute force."""

from __future__ import annotations

import random

import pytest
import torch

from entmtp_sglang.costs.ragged_cost import RaggedStepCost, tree_set_cost
from entmtp_sglang.policy.budget import BudgetConfig, allocate_ragged, allocate_ragged_exhaustive
from entmtp_sglang.policy.controller import RequestInput, TreeController
from entmtp_sglang.sglang.cpu import ops as cpu_ops
from entmtp_sglang.sglang.cpu.gather import attend, verify_plan
from entmtp_sglang.sglang.ragged import packed_index, pad_tree, ragged_verify_plan, scatter_rows, verify_links
from entmtp_sglang.sglang.tree_index import ShapeIndex, TreeIndex, draft_rows, draft_tree
from entmtp_sglang.sglang.tree_plan import plan_tree
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet

TOPK = 2
#  the set: chain:0 (rest), chain:2, a 3-node fan, and the two 5-node shapes
#
#   chain:2   0-1-2        fan3  0<1,2       wide5  0<1<3,4        deep5  0-1-2-3-4
#                                                  <2
TREES = [Tree.chain(0), Tree.chain(2), Tree((-1, 0, 0), name="fan3"), Tree((-1, 0, 0, 1, 1), name="wide5"),
         Tree.chain(4)]


def test_a_resting_row_pads_to_the_shape_by_hand():
    #  chain:0 in (2 levels, 4 nodes), top-2: the root takes two children, the first of them two more
    assert pad_tree(Tree.chain(0), 4, 2, 2).parents == (-1, 0, 0, 1)
    assert pad_tree(Tree.chain(2), 4, 2, 2).parents == (-1, 0, 1, 0)     # its own nodes first, padding after
    assert pad_tree(Tree.chain(3), 4, 2, 2) is None                      # deeper than the shape
    assert pad_tree(Tree.chain(0), 8, 2, 2) is None                      # 1 + 2 + 2 * 2 = 7 nodes fit at most
    links = verify_links(plan_tree(pad_tree(Tree.chain(0), 4, 2, 2), 2, 2), 1)
    assert links.real == (True, False, False, False) and links.next_token == (-1, -1, -1, -1)


def test_links_over_every_node_are_sglangs_and_padding_is_unlinked():
    for key, shape in ShapeIndex.for_trees(TREES, TOPK, ragged=True).items():
        for tree_id, plan, real_nodes in zip(shape.trees, shape.plans, shape.real_nodes):
            n, depth = plan.num_nodes, plan.num_steps
            buf = {k: torch.zeros(n, dtype=torch.long) for k in ("pos", "idx", "next", "sib")}
            cpu_ops.build_tree_kernel_efficient_cpu(
                torch.tensor(plan.parent_list).view(1, -1), torch.tensor(plan.selected).view(1, -1), torch.tensor([7]),
                torch.zeros(n * n, dtype=torch.bool), buf["pos"], buf["idx"], buf["next"], buf["sib"], TOPK, depth, n,
                cpu_ops.TREE_MASK_QLEN_ONLY)
            full = verify_links(plan, n)
            assert list(full.next_token) == buf["next"].tolist() and list(full.next_sibling) == buf["sib"].tolist()
            part = verify_links(plan, real_nodes)
            assert sum(part.real) == real_nodes == TREES[tree_id].num_nodes
            linked = {k for k in (*part.next_token, *part.next_sibling) if k >= 0}
            assert linked == {k for k in range(1, n) if part.real[k]}, (key, TREES[tree_id].name, part)


def _fake_forward(table: torch.Tensor):
    """A drafter whose next-token logits depend on the input token and the parent's hidden state only."""
    def forward_level(level, ids, hidden):
        h = torch.tanh(hidden + table[ids])
        logits = h @ table.T
        bs = ids.shape[0] // TOPK
        return logits.view(bs, TOPK, -1), h.view(bs, TOPK, -1)
    return forward_level


def test_padded_rows_draft_their_real_nodes_as_their_own_trees_do():
    torch.manual_seed(0)
    table = torch.randn(50, 16)
    shape = ShapeIndex.for_trees(TREES, TOPK, ragged=True)[(4, 5)]
    rows = [shape.position(i) for i in (0, 1, 2, 3, 4, 2)]
    root_top, root_hidden = torch.randint(0, 50, (len(rows), TOPK)), torch.randn(len(rows), 16)
    tokens = draft_rows(shape.gather(torch.tensor(rows)), root_top, root_hidden, _fake_forward(table))
    for b, k in enumerate(rows):
        tree = TREES[shape.trees[k]]
        if tree.max_depth == 0:
            continue
        own = draft_tree(TreeIndex.build(plan_tree(tree, TOPK, tree.max_depth)), root_top[b:b + 1],
                         root_hidden[b:b + 1], _fake_forward(table))
        got = tokens[b, 1:tree.num_nodes]
        assert torch.equal(got, own[0, 1:]), (tree.name, got, own)


def test_the_packed_verify_attends_as_the_full_one_on_every_real_query():
    torch.manual_seed(1)
    shape = ShapeIndex.for_trees(TREES, TOPK, ragged=True)[(4, 5)]
    rows = torch.tensor([shape.position(i) for i in (0, 3, 1, 4)])
    bs, n, heads, dim = 4, 5, 2, 8
    seq = torch.tensor([3, 7, 1, 5])
    r2t = torch.randperm(200)[:bs * 20].view(bs, 20).to(torch.int32)
    k_buf, v_buf = torch.randn(200, heads, dim), torch.randn(200, heads, dim)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b, k in enumerate(rows.tolist()):   # the tree mask SGLang builds for each row's padded tree
        plan = shape.plans[k]
        cpu_ops.build_tree_kernel_efficient_cpu(
            torch.tensor(plan.parent_list).view(1, -1), torch.tensor(plan.selected).view(1, -1), seq[b:b + 1],
            mask[b].view(-1), *(torch.zeros(n, dtype=torch.long) for _ in range(4)), TOPK, 4, n,
            cpu_ops.TREE_MASK_QLEN_ONLY)
    real = shape.links[0].index_select(0, rows)
    counts = tuple(shape.real_nodes[k] for k in rows.tolist())
    assert counts == (1, 5, 3, 5)
    q = torch.randn(bs * n, heads, dim)
    full = attend(verify_plan(r2t, torch.arange(bs), seq, n, mask.view(-1)), q, k_buf, v_buf, 0.3,
                  torch.zeros(bs * n, heads, dim))
    index = packed_index(real)
    assert index.numel() == sum(counts)
    packed = attend(ragged_verify_plan(r2t, torch.arange(bs), seq, n, mask.view(-1), real, counts), q[index], k_buf,
                    v_buf, 0.3, torch.zeros(index.numel(), heads, dim))
    torch.testing.assert_close(packed, full[index])
    back = scatter_rows(packed, index, bs * n)
    torch.testing.assert_close(back[index], full[index])
    assert not back[~real.reshape(-1)].any()



def test_a_packed_verify_of_full_rows_is_read_as_a_view_and_gives_the_indexed_result_exactly():
    """Every row as long as the longest (batch 1 always, forced spans or not): the packed queries are bs x Q in
    order, so the plan is dense (no index copies in 30 layers); the result equals the indexed path's bit for bit,
    and a plan with a short row writes back through its precomputed index exactly as the full verify attends."""
    torch.manual_seed(2)
    bs, n, heads, dim = 2, 5, 2, 8
    seq = torch.tensor([6, 9])
    r2t = torch.randperm(200)[:bs * 20].view(bs, 20).to(torch.int32)
    k_buf, v_buf = torch.randn(200, heads, dim), torch.randn(200, heads, dim)
    parents = torch.tensor([-1, 0, 1, 1, 2])
    mask = torch.stack([torch.stack([torch.tensor([_is_ancestor(parents, a, q) for a in range(n)])
                                     for q in range(n)])] * bs)
    for counts in ((4, 4), (5, 5), (2, 5)):
        real = torch.zeros(bs, n, dtype=torch.bool)
        for b, c in enumerate(counts):
            real[b, :c] = True
        index = packed_index(real)
        q = torch.randn(bs * n, heads, dim)
        plan = ragged_verify_plan(r2t, torch.arange(bs), seq, n, mask.view(-1), real, counts)
        assert plan.dense == (len(set(counts)) == 1)
        got = attend(plan, q[index], k_buf, v_buf, 0.3, torch.zeros(index.numel(), heads, dim))
        indexed = ragged_verify_plan(r2t, torch.arange(bs), seq, n, mask.view(-1), real, counts)
        indexed.dense = False
        assert torch.equal(got, attend(indexed, q[index], k_buf, v_buf, 0.3, torch.zeros(index.numel(), heads, dim)))
        full = attend(verify_plan(r2t, torch.arange(bs), seq, n, mask.view(-1)), q, k_buf, v_buf, 0.3,
                      torch.zeros(bs * n, heads, dim))
        torch.testing.assert_close(got, full[index])


def _is_ancestor(parents: torch.Tensor, a: int, q: int) -> bool:
    """Whether node a is q or an ancestor of q."""
    while q >= 0:
        if q == a:
            return True
        q = int(parents[q])
    return False


def _options(rng, ids_nodes_depths):
    from entmtp_sglang.policy.budget import RequestOptions, TreeOption
    opts = [TreeOption(0, 1, 0, 1.0)]
    for i, (nodes, depth) in ids_nodes_depths.items():
        opts.append(TreeOption(i, nodes, depth, rng.uniform(1.0, depth + 1.0)))
    return RequestOptions(tuple(opts), pin=0 if rng.random() < 0.15 else None)


def test_the_ragged_allocation_equals_brute_force():
    rng = random.Random(36)
    shapes_of = ShapeIndex.for_trees(TREES, TOPK, ragged=True)
    shapes = {key: (key[0], frozenset(s.trees)) for key, s in sorted(shapes_of.items(), key=lambda kv: kv[0][::-1])}
    trees = {i: (t.num_nodes, t.max_depth) for i, t in enumerate(TREES) if i}
    some_rest = 0
    for _ in range(200):
        batch = [_options(rng, trees) for _ in range(rng.randint(1, 4))]
        cost = RaggedStepCost(rng.uniform(0, 0.05), rng.uniform(0, 0.01), rng.uniform(0, 0.01), rng.uniform(0, 0.005),
                              rng.uniform(0.0, 0.05) if rng.random() < 0.7 else 0.0)
        cost = cost if cost.plain_base else RaggedStepCost(cost.base, cost.per_token, cost.per_level, cost.per_row)
        config = BudgetConfig(hysteresis=0.0)
        (key, got), (_, best) = allocate_ragged(batch, shapes, cost, config), allocate_ragged_exhaustive(
            batch, shapes, cost, config)
        assert got.tokens_per_second == pytest.approx(best.tokens_per_second, rel=1e-9), (batch, got, best)
        assert all(t in shapes[key][1] for t in got.trees)
        assert all(r.pin is None or t == r.pin for r, t in zip(batch, got.trees))
        some_rest += 0 < sum(got.resting) < len(batch)
    assert some_rest > 10   # resting rows inside speculating steps are chosen, not only whole-batch choices


def test_pins_of_different_shapes_keep_as_many_as_one_step_runs():
    """Requests pinning trees no one shape holds together: the step runs a shape holding the most pins, those rows
    take their pinned trees, and a row whose pin that shape lacks chooses freely among its trees."""
    from entmtp_sglang.policy.budget import RequestOptions, TreeOption
    trees = TREES + [Tree((-1, 0, 0, 1, 1, 2, 2), name="full7")]
    shapes_of = ShapeIndex.for_trees(trees, TOPK, ragged=True)
    shapes = {key: (key[0], frozenset(s.trees)) for key, s in sorted(shapes_of.items(), key=lambda kv: kv[0][::-1])}
    assert not any({4, 5} <= ids for _, ids in shapes.values())   # deep5 and full7: no shape holds both
    rng = random.Random(7)
    cost = RaggedStepCost(0.02, 0.002, 0.004, 0.001, 0.02)
    config = BudgetConfig(hysteresis=0.0)

    def request(pin):
        opts = [TreeOption(0, 1, 0, 1.0)] + [TreeOption(i, t.num_nodes, t.max_depth, 1.0 + 0.5 * t.max_depth)
                                            for i, t in enumerate(trees) if i]
        return RequestOptions(tuple(opts), pin=pin)

    key, got = allocate_ragged([request(4), request(4), request(5), request(None)], shapes, cost, config)
    assert got.trees[:2] == (4, 4) and 4 in shapes[key][1]      # two deep5 pins outvote one full7 pin
    assert got.trees[2] in shapes[key][1]
    key, got = allocate_ragged([request(4), request(5), request(5)], shapes, cost, config)
    assert got.trees[1:] == (5, 5) and got.trees[0] != 4
    for _ in range(200):   # random pins: as many honoured as the best shape holds, and brute force agrees
        batch = [request(rng.choice([None, 0, 1, 2, 3, 4, 5])) for _ in range(rng.randint(1, 5))]
        (key, got), (_, best) = allocate_ragged(batch, shapes, cost, config), allocate_ragged_exhaustive(
            batch, shapes, cost, config)
        most = max(sum(r.pin is not None and r.pin in ids for r in batch) for _, ids in shapes.values())
        assert sum(r.pin is not None and t == r.pin for r, t in zip(batch, got.trees)) == most
        assert got.tokens_per_second == pytest.approx(best.tokens_per_second, rel=1e-9)


def test_the_controller_rests_a_row_beside_a_speculating_one():
    #   a confident row (margin 0.9) expects 2.4 drafts of deep5, an uncertain one (0.1) next to nothing:
    #   the step drafts deep5 for the first and rests the second inside the same shape
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {2: 0.010}),
               TreeEntry(Tree((-1, 0, 0), name="fan3"), (0.05, 0.6), {2: 0.016}),
               TreeEntry(Tree.chain(4), (0.02, 2.4), {2: 0.020}),
               TreeEntry(Tree.chain(2), (0.03, 1.5), {2: 0.016}))
    ts = TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries)
    line, measured = tree_set_cost(ts, 2)
    assert measured == 2 and line(2, 0, 2) == pytest.approx(0.010)
    trees = [e.tree for e in entries]
    shapes = {key: (key[0], frozenset(s.trees)) for key, s in ShapeIndex.for_trees(trees, TOPK, ragged=True).items()}
    c = TreeController(ts, hysteresis=0.0)
    key, ids = c.choose_ragged([RequestInput("json", 0.9), RequestInput("chat", 0.1)], shapes)
    assert (key, ids) == ((4, 5), (2, 0))
    key, ids = c.choose_ragged([RequestInput("json", 0.9), RequestInput("chat", 0.1, pin="chain:4")], shapes)
    assert ids == (2, 2)


def test_an_online_ragged_cost_replaces_the_sets_line():
    """Once the server has fitted its own ragged step cost (`set_ragged_cost`), the controller prices ragged steps
    by it: where its verified tokens cost as much as a step, every row rests; back on the set's line, the confident
    row drafts again."""
    entries = (TreeEntry(Tree.chain(0), (0.0, 0.0), {2: 0.010}),
               TreeEntry(Tree((-1, 0, 0), name="fan3"), (0.05, 0.6), {2: 0.016}),
               TreeEntry(Tree.chain(4), (0.02, 2.4), {2: 0.020}),
               TreeEntry(Tree.chain(2), (0.03, 1.5), {2: 0.016}))
    ts = TreeSet("m", "eagle", "t", "draft_margin", (0.5,), entries)
    trees = [e.tree for e in entries]
    shapes = {key: (key[0], frozenset(s.trees)) for key, s in ShapeIndex.for_trees(trees, TOPK, ragged=True).items()}
    c = TreeController(ts, hysteresis=0.0)
    batch = [RequestInput("json", 0.9), RequestInput("chat", 0.1)]
    assert c.choose_ragged(batch, shapes)[1] == (2, 0)
    c.set_ragged_cost(RaggedStepCost(0.001, 0.010, 0.0))   # a verified token costs what a step does
    assert c.choose_ragged(batch, shapes)[1] == (0, 0)
    c.set_ragged_cost(None)
    assert c.choose_ragged(batch, shapes)[1] == (2, 0)
