"""A fixed tree's draft on device tensors (entmtp_sglang/sglang/tree_index.py) against the node-by-node draft it
replaces, on random trees and the shipped sets' trees; and with no host reads inside it (meta tensors)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from entmtp_sglang.sglang.tree_index import TreeIndex, draft_tree
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
