"""A fixed tree's draft on device tensors (entmtp_sglang/sglang/tree_index.py) against the node-by-node draft it
replaces, on random trees and the shipped sets' trees; and with no host reads inside it (meta tensors)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from entmtp_sglang.sglang.tree_index import RowIndex, ShapeIndex, TreeIndex, draft_rows, draft_tree
from entmtp_sglang.sglang.tree_plan import plan_tree, required_topk
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import load_tree_set

TREES = Path(__file__).resolve().parents[1] / "trees"

V, H = 50, 8


def random_tree(rng: random.Random, n: int) -> Tree:
    return Tree(tuple([-1] + [rng.randrange(i) for i in range(1, n)]), name=f"random{n}")


def shipped_trees() -> list[Tree]:
    out = {}
    for path in sorted(TREES.glob("*.json")):
        for entry in load_tree_set(path).trees:
            out[entry.tree.parents] = entry.tree
    return list(out.values())


class Drafter:
    """A deterministic stand-in for a draft model's level: logits and hidden states from tokens and hidden."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(3 * V, H, generator=g)   # input ids in the target vocabulary (hot maps into it)
        self.w = torch.randn(H, V, generator=g)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, level, ids, hidden):
        out = torch.tanh(hidden + self.emb[ids] + level)
        self.calls.append((ids.clone(), hidden.clone()))
        bs_topk = ids.shape[0]
        return (out @ self.w).view(-1, self.topk, V), out.view(bs_topk // self.topk, self.topk, H)


def node_by_node(plan, root_top, root_hidden, forward_level, hot=None):
    """The draft as ENTMTP's worker wrote it before tree_index: one Python dict entry per node."""
    topk, parents = plan.topk, plan.tree.parents
    token = {i: root_top[:, plan.rank[i]] for i in range(1, plan.num_nodes) if plan.depth[i] == 1}
    hidden_out = {0: root_hidden}
    for step, col in enumerate(plan.columns):
        if not col:
            break
        rows = list(col) + [col[0]] * (topk - len(col))
        logits, hid = forward_level(step, torch.stack([token[n] for n in rows], 1).flatten(),
                                    torch.stack([hidden_out[parents[n]] for n in rows], 1).flatten(0, 1))
        top = torch.topk(logits, topk, dim=-1).indices
        if hot is not None:
            top = hot[top]
        for c, n in enumerate(col):
            hidden_out[n] = hid[:, c]
        for i in range(1, plan.num_nodes):
            if plan.depth[i] == step + 2:
                token[i] = top[:, col.index(parents[i]), plan.rank[i]]
    return token


def check(tree: Tree, bs: int, seed: int, hot: torch.Tensor | None = None) -> None:
    topk = required_topk(tree)
    plan = plan_tree(tree, topk, tree.max_depth)
    index = TreeIndex.build(plan)
    g = torch.Generator().manual_seed(seed)
    root_top = torch.randint(0, V, (bs, topk), generator=g)
    root_hidden = torch.randn(bs, H, generator=g)
    a, b = Drafter(seed), Drafter(seed)
    a.topk = b.topk = topk
    tokens = draft_tree(index, root_top, root_hidden, a, hot)
    expected = node_by_node(plan, root_top, root_hidden, b, hot)
    assert index.levels == plan.draft_steps == len(a.calls) == len(b.calls)
    for (ia, ha), (ib, hb) in zip(a.calls, b.calls):
        assert torch.equal(ia, ib) and torch.equal(ha, hb)
    for n in range(1, plan.num_nodes):
        assert torch.equal(tokens[:, n], expected[n]), (tree.name, n)
    assert index.parent_list.tolist() == [list(plan.parent_list)]
    assert index.selected.tolist() == [list(plan.selected)]
    assert tokens[:, index.selected_nodes].tolist() == [[expected[n][i].item() for n in plan.selected_nodes]
                                                         for i in range(bs)]
    for level, rows in enumerate(plan.ancestor_offsets):
        for c, r in enumerate(rows):
            assert index.row_offsets[level][c][index.row_valid[level][c]].tolist() == list(r)


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_draft_what_the_node_by_node_draft_drafts(seed):
    rng = random.Random(seed)
    check(random_tree(rng, rng.randrange(1, 24)), bs=rng.randrange(1, 5), seed=seed)


def test_the_shipped_trees_draft_what_the_node_by_node_draft_drafts():
    trees = shipped_trees()
    assert len(trees) >= 10
    hot = torch.randperm(V * 3)[:V]   # a draft vocabulary mapped into a larger target vocabulary
    for k, tree in enumerate(trees):
        check(tree, bs=3, seed=k)
        check(tree, bs=2, seed=k, hot=hot)


def test_chain_zero_and_one_level():
    check(Tree.parse("chain:0"), bs=2, seed=0)
    check(Tree.parse("chain:1"), bs=2, seed=1)
    check(Tree.parse("chain:5"), bs=2, seed=2)


class _NoHostOps(TorchDispatchMode):
    FORBIDDEN = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default,
                 torch.ops.aten.lift_fresh_copy.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"host sync inside the draft step: {func}")
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                raise AssertionError(f"{func} made a CPU tensor inside the draft step")
        return out


class _NoHostCalls(TorchFunctionMode):
    FORBIDDEN = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.tolist, torch.Tensor.item,
                 torch.Tensor.cpu, torch.Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"host data inside the draft step: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def NoHost():
    """Fails on what a CUDA graph cannot hold: a read to the host (.item(), .tolist(), int(), .cpu()), a tensor
    built from host data (torch.tensor(list)), or any op producing a CPU tensor while the step runs on meta
    tensors (a host round trip)."""
    with _NoHostCalls(), _NoHostOps():
        yield


def test_the_guard_catches_host_reads_and_host_tensors():
    x = torch.zeros(3, device="meta")
    for bad in (lambda: x.sum().item(), lambda: int(x[0]), lambda: x.tolist(), lambda: x.cpu(),
                lambda: torch.tensor([1, 2], device="meta"), lambda: x.to("cpu"), lambda: torch.ones(2)):
        with pytest.raises((AssertionError, NotImplementedError, RuntimeError)), NoHost():
            bad()
    with NoHost():
        (x + 1).topk(2)


def test_the_draft_reads_nothing_from_the_host():
    """On meta tensors under `NoHost`, a .item(), .tolist(), host tensor or host copy fails: the draft levels
    of every shipped tree shape are capturable."""
    rng = random.Random(7)
    for tree in [*shipped_trees(), random_tree(rng, 16), Tree.parse("chain:4"), Tree.parse("chain:0")]:
        topk = required_topk(tree)
        index = TreeIndex.build(plan_tree(tree, topk, tree.max_depth), device="meta")
        assert all(t.device.type == "meta" for t in (index.first, index.parent_list, *index.rows, *index.row_offsets))
        w = torch.empty(H, V, device="meta")

        def level(step, ids, hidden, topk=topk):
            out = torch.tanh(hidden)
            return (out @ w).view(-1, topk, V), out.view(-1, topk, H)

        root_top = torch.empty(3, topk, dtype=torch.long, device="meta")
        root_hidden, hot = torch.empty(3, H, device="meta"), torch.empty(V, dtype=torch.long, device="meta")
        with NoHost():
            tokens = draft_tree(index, root_top, root_hidden, level, hot)
        assert tokens.shape == (3, tree.num_nodes) and tokens.device.type == "meta"


# -- each row its own tree of one shape (issue 36, item 1) ------------------------------------------------------
def random_tree_of(rng: random.Random, n: int, max_depth: int) -> Tree:
    """A random tree of `n` nodes and depth at most `max_depth` (>= 1)."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        p = rng.choice([j for j in range(i) if depth[j] < max_depth])
        parents.append(p)
        depth.append(depth[p] + 1)
    return Tree(tuple(parents), name=f"random{n}-{rng.randrange(10**6)}")


def shape_group(rng: random.Random, n: int, max_depth: int, count: int):
    """`count` random trees of n nodes, depth <= max_depth, the deepest exactly max_depth, on one layout."""
    trees = []
    while len(trees) < count or max(t.max_depth for t in trees) != max_depth:
        t = random_tree_of(rng, n, max_depth)
        trees = (trees + [t])[-count:]
    topk = max(required_topk(t) for t in trees)
    return trees, [plan_tree(t, topk, max_depth) for t in trees]


def check_rows(shape: ShapeIndex, choice: list[int], seed: int, hot: torch.Tensor | None = None,
               rows: RowIndex | None = None) -> None:
    """Per-row drafting equals drafting each row's own tree node by node, one row at a time: the tokens, what each
    of the row's levels feeds the drafter, SGLang's candidates, and the draft slots each draft row attends to."""
    bs, topk = len(choice), shape.stack.topk
    rows = rows if rows is not None else shape.gather(torch.tensor(choice))
    g = torch.Generator().manual_seed(seed)
    root_top = torch.randint(0, V, (bs, topk), generator=g)
    root_hidden = torch.randn(bs, H, generator=g)
    a = Drafter(seed)
    a.topk = topk
    tokens = draft_rows(rows, root_top, root_hidden, a, hot)
    assert tokens.shape == (bs, shape.stack.num_nodes)
    for b, k in enumerate(choice):
        plan = shape.plans[k]
        one = Drafter(seed)
        one.topk = topk
        expected = node_by_node(plan, root_top[b:b + 1], root_hidden[b:b + 1], one, hot)
        for level, (ids, hid) in enumerate(one.calls):
            got_ids, got_hid = a.calls[level]
            assert torch.equal(got_ids.view(bs, topk)[b], ids), (plan.tree.name, b, level)
            assert torch.equal(got_hid.view(bs, topk, H)[b], hid), (plan.tree.name, b, level)
        for n in range(1, plan.num_nodes):
            assert tokens[b, n] == expected[n][0], (plan.tree.name, b, n)
        assert rows.parent_list[b].tolist() == list(plan.parent_list)
        assert rows.selected[b].tolist() == list(plan.selected)
        assert tokens[b, rows.selected_nodes[b]].tolist() == [expected[n][0].item() for n in plan.selected_nodes]
        for level, level_rows in enumerate(plan.ancestor_offsets):
            for c, r in enumerate(level_rows):
                assert rows.row_offsets[level][b, c][rows.row_valid[level][b, c]].tolist() == list(r)


@pytest.mark.parametrize("seed", range(30))
def test_each_row_drafts_its_own_tree_of_one_shape(seed):
    rng = random.Random(seed)
    n = rng.randrange(2, 14)
    depth = rng.randrange(1, n)
    trees, plans = shape_group(rng, n, depth, rng.randrange(1, 5))
    shape = ShapeIndex.build(list(range(10, 10 + len(trees))), plans)
    choice = [rng.randrange(len(trees)) for _ in range(rng.randrange(1, 7))]
    hot = torch.randperm(V * 3)[:V] if seed % 2 else None
    check_rows(shape, choice, seed, hot)
    assert shape.position(10 + choice[0]) == choice[0]


def test_the_shipped_shapes_draft_each_rows_tree():
    """The SmolLM2 set's trees of one node count, wide and deep, side by side in one batch."""
    ts = load_tree_set(TREES / "smollm2-135m-instruct-eagle-mixed-sglang.json")
    by_nodes: dict[int, list] = {}
    for i, t in enumerate(ts.trees):
        if t.tree.max_depth:
            by_nodes.setdefault(t.tree.num_nodes, []).append((i, t.tree))
    mixed = [g for g in by_nodes.values() if len({t.max_depth for _, t in g}) > 1]
    assert mixed, by_nodes
    for group in mixed:
        depth = max(t.max_depth for _, t in group)
        topk = max(required_topk(t) for _, t in group)
        shape = ShapeIndex.build([i for i, _ in group], [plan_tree(t, topk, depth) for _, t in group])
        check_rows(shape, [k % len(group) for k in range(5)], seed=len(group))


def test_mutating_one_rows_index_fails_the_check():
    """The comparison can fail: another tree's entry for one row, or one child taken from another rank."""
    trees = [Tree((-1, 0, 0, 0, 0), name="wide"), Tree((-1, 0, 1, 2, 3), name="deep"),
             Tree((-1, 0, 1, 1, 0), name="mid")]
    plans = [plan_tree(t, 4, 4) for t in trees]
    shape = ShapeIndex.build([0, 1, 2], plans)
    choice = [0, 1, 2, 1]
    check_rows(shape, choice, seed=1)
    swapped = shape.gather(torch.tensor([0, 2, 2, 1]))   # row 1 gets tree "mid"'s indices
    with pytest.raises(AssertionError):
        check_rows(shape, choice, seed=1, rows=swapped)
    good = shape.gather(torch.tensor(choice))
    src = [t.clone() for t in good.child_src]
    level = next(lv for lv in range(good.levels) if good.children[lv][1, 0] < good.num_nodes)
    src[level][1, 0] = (src[level][1, 0] + 1) % (good.topk ** 2)
    with pytest.raises(AssertionError):
        check_rows(shape, choice, seed=1, rows=dataclasses.replace(good, child_src=tuple(src)))


def test_per_row_drafting_reads_nothing_from_the_host():
    """The gather by tree id and the per-row levels on meta tensors under `NoHost`."""
    trees = [Tree((-1, 0, 0, 0, 0, 0), name="w"), Tree((-1, 0, 0, 1, 1, 0), name="d2"),
             Tree((-1, 0, 1, 2, 0, 0), name="d3")]
    plans = [plan_tree(t, 5, 3) for t in trees]
    shape = ShapeIndex.build([0, 1, 2], plans, device="meta")
    w = torch.empty(H, V, device="meta")

    def level(step, ids, hidden):
        out = torch.tanh(hidden)
        return (out @ w).view(-1, 5, V), out.view(-1, 5, H)

    choice = torch.empty(4, dtype=torch.long, device="meta")
    root_top = torch.empty(4, 5, dtype=torch.long, device="meta")
    root_hidden, hot = torch.empty(4, H, device="meta"), torch.empty(V, dtype=torch.long, device="meta")
    with NoHost():
        rows = shape.gather(choice)
        tokens = draft_rows(rows, root_top, root_hidden, level, hot)
    assert tokens.shape == (4, 6) and tokens.device.type == "meta"
    assert rows.parent_list.shape == (4, 1 + 2 * 5) and rows.row_offsets[0].shape[:2] == (4, 5)


def test_a_sets_shapes_stack_its_trees_of_one_node_count():
    """`ShapeIndex.for_trees`: one stack per speculating (depth, nodes) of the set, holding the set's trees of
    those nodes and at most that depth, laid out on that many draft steps; chain:0 has none."""
    ts = load_tree_set(TREES / "smollm2-135m-instruct-eagle-mixed-sglang.json")
    trees = [t.tree for t in ts.trees]
    shapes = ShapeIndex.for_trees(trees, 5)
    assert set(shapes) == {(t.max_depth, t.num_nodes) for t in trees if t.max_depth}
    for (depth, n), shape in shapes.items():
        assert {trees[i].name for i in shape.trees} == {t.name for t in trees
                                                         if t.num_nodes == n and 1 <= t.max_depth <= depth}
        assert all(p.num_steps == depth and p.num_nodes == n for p in shape.plans)
        assert shape.stack.levels == depth - 1 and shape.stack.parent_list.shape == (len(shape.trees),
                                                                                     1 + (depth - 1) * 5)
