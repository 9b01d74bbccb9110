"""The canonical draft-tree form (`entmtp_sglang.tree.topology`): hand-checked buffers, properties, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entmtp_sglang.tree import Tree, TreeBuffers, TreeError, build_buffers, from_medusa_choices, from_sglang

PROPS = settings(max_examples=200, deadline=None)


def _bool_mask(rows: list[set[int]]) -> torch.Tensor:
    n = len(rows)
    return torch.tensor([[j in rows[i] for j in range(n)] for i in range(n)], dtype=torch.bool)


def _assert_buffers(buf: TreeBuffers, *, parents, positions, sibling_rank, mask_rows, paths, next_token,
                    next_sibling):
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    assert buf.parents.dtype == torch.int64 and torch.equal(buf.parents, i64(parents))
    assert torch.equal(buf.positions, i64(positions))
    assert torch.equal(buf.sibling_rank, i64(sibling_rank))
    assert buf.ancestor_mask.dtype == torch.bool and torch.equal(buf.ancestor_mask, _bool_mask(mask_rows))
    assert torch.equal(buf.retrieve_paths, i64(paths))
    assert torch.equal(buf.retrieve_next_token, i64(next_token))
    assert torch.equal(buf.retrieve_next_sibling, i64(next_sibling))


# --- 1. hand-written trees -------------------------------------------------------------------------


def test_single_root():
    #   0
    t = Tree.parse("chain:0")
    assert t.parents == (-1,) and t.name == "chain:0"
    assert t.depths == (0,) and t.leaves == (0,) and t.children == ((),) and t.max_depth == 0
    assert t.to_medusa_choices() == []
    _assert_buffers(build_buffers(t), parents=[-1], positions=[0], sibling_rank=[0], mask_rows=[{0}],
                    paths=[[0]], next_token=[-1], next_sibling=[-1])


def test_chain3():
    #   0 ─ 1 ─ 2 ─ 3
    t = Tree.parse("chain:3")
    assert t == Tree.chain(3) == Tree.parse("-1,0,1,2") == Tree((-1, 0, 1, 2))
    assert t.name == "chain:3" and Tree((-1, 0, 1, 2)).name == "chain:3"
    assert t.parents == (-1, 0, 1, 2)
    assert t.depths == (0, 1, 2, 3) and t.max_depth == 3
    assert t.children == ((1,), (2,), (3,), ())
    assert t.sibling_rank == (0, 0, 0, 0)
    assert t.leaves == (3,)
    assert t.path_to(3) == (0, 1, 2, 3) and t.path_to(0) == (0,)
    assert t.to_medusa_choices() == [(0,), (0, 0), (0, 0, 0)]
    _assert_buffers(
        build_buffers(t),
        parents=[-1, 0, 1, 2],
        positions=[0, 1, 2, 3],
        sibling_rank=[0, 0, 0, 0],
        mask_rows=[{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}],
        paths=[[0, 1, 2, 3]],
        next_token=[1, 2, 3, -1],
        next_sibling=[-1, -1, -1, -1],
    )


def test_docstring_five_node_tree():
    #   0 ─ 1 ─ 3        node 1 is 0's rank-0 child, node 2 its rank-1 child;
    #   │   └── 4        node 3 is 1's rank-0 child, node 4 its rank-1 child.
    #   └── 2
    t = Tree.parse("-1,0,0,1,1")
    assert t.parents == (-1, 0, 0, 1, 1)
    assert t.name == "tree:n5d2"
    assert t.depths == (0, 1, 1, 2, 2) and t.max_depth == 2
    assert t.children == ((1, 2), (3, 4), (), (), ())
    assert t.sibling_rank == (0, 0, 1, 0, 1)
    assert t.leaves == (2, 3, 4)
    assert t.path_to(4) == (0, 1, 4)
    assert t.to_medusa_choices() == [(0,), (1,), (0, 0), (0, 1)]
    _assert_buffers(
        build_buffers(t),
        parents=[-1, 0, 0, 1, 1],
        positions=[0, 1, 1, 2, 2],
        sibling_rank=[0, 0, 1, 0, 1],
        mask_rows=[{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}],
        paths=[[0, 2, -1],  # leaf 2
               [0, 1, 3],   # leaf 3
               [0, 1, 4]],  # leaf 4
        next_token=[1, 3, -1, -1, -1],
        next_sibling=[-1, 2, -1, 4, -1],
    )


def test_seven_node_tree_depth_first_order():
    # Numbered depth first (still topological), so index order != level order:
    #   0 ─ 1 ─ 2 ─ 6
    #   │   └── 3
    #   └── 4 ─ 5
    t = Tree((-1, 0, 1, 1, 0, 4, 2))
    assert t.depths == (0, 1, 2, 2, 1, 2, 3) and t.max_depth == 3
    assert t.children == ((1, 4), (2, 3), (6,), (), (5,), (), ())
    assert t.sibling_rank == (0, 0, 0, 1, 1, 0, 0)
    assert t.leaves == (3, 5, 6)
    assert t.path_to(6) == (0, 1, 2, 6) and t.path_to(5) == (0, 4, 5)
    assert t.to_medusa_choices() == [(0,), (0, 0), (0, 1), (1,), (1, 0), (0, 0, 0)]
    _assert_buffers(
        build_buffers(t),
        parents=[-1, 0, 1, 1, 0, 4, 2],
        positions=[0, 1, 2, 2, 1, 2, 3],
        sibling_rank=[0, 0, 0, 1, 1, 0, 0],
        mask_rows=[{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 4}, {0, 4, 5}, {0, 1, 2, 6}],
        paths=[[0, 1, 3, -1],  # leaf 3
               [0, 4, 5, -1],  # leaf 5
               [0, 1, 2, 6]],  # leaf 6
        next_token=[1, 2, 6, -1, 5, -1, -1],
        next_sibling=[-1, 4, 3, -1, -1, -1, -1],
    )
    # the round trip through Medusa choices keeps this (non level-order) numbering
    assert from_medusa_choices(t.to_medusa_choices()).parents == t.parents


def test_medusa_choices_hand_written():
    # Medusa lists are usually sorted by (length, choice):
    #   0 ─ 1 ─ 4
    #   ├── 2
    #   └── 3
    t = from_medusa_choices([[0], [1], [2], [0, 0]], name="m")
    assert t.parents == (-1, 0, 0, 0, 1) and t.name == "m"
    # duplicates and the empty (root) choice are ignored; a child listed before its parent follows it
    assert from_medusa_choices([(0, 0), (), (0,), (1,), (0,), (2,)]).parents == (-1, 0, 1, 0, 0)
    assert from_medusa_choices([]).parents == (-1,)


# --- 2. properties on random parent arrays ------------------------------------------------------------


@st.composite
def parent_arrays(draw, max_nodes: int = 40):
    n = draw(st.integers(1, max_nodes))
    return tuple([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])


def _ancestors_or_self(parents, i) -> set[int]:
    out = set()
    while i != -1:
        out.add(i)
        i = parents[i]
    return out


def _check_ancestor_mask(t: Tree, m: torch.Tensor):
    n = t.num_nodes
    assert m.shape == (n, n) and m.dtype == torch.bool
    # exactly ancestor-or-self, computed independently
    assert torch.equal(m, _bool_mask([_ancestors_or_self(t.parents, i) for i in range(n)]))
    assert bool(m.diagonal().all())  # reflexive
    closure = (m.int() @ m.int()) > 0  # i ->* j ->* k
    assert torch.equal(closure | m, m)  # ancestor-closed (transitive)
    d = torch.tensor(t.depths)
    idx = torch.arange(n)
    ii, jj = m.nonzero(as_tuple=True)
    assert bool((d[jj] <= d[ii]).all()) and bool((idx[jj] <= idx[ii]).all())
    assert torch.equal(m.sum(1), d + 1)  # each row sees itself and its depth-many ancestors


def _check_positions_and_ranks(t: Tree, buf: TreeBuffers, prefix_len: int):
    parents = t.parents
    assert buf.positions.tolist() == list(t.depths)
    for i in range(1, t.num_nodes):
        assert t.depths[i] == t.depths[parents[i]] + 1
    assert (buf.positions + prefix_len).tolist() == [prefix_len + d for d in t.depths]
    assert buf.parents.tolist() == list(parents)
    assert buf.sibling_rank.tolist() == list(t.sibling_rank)
    for kids in t.children:
        assert [t.sibling_rank[c] for c in kids] == list(range(len(kids)))
        assert list(kids) == sorted(kids)
    for name in ("parents", "positions", "sibling_rank", "retrieve_next_token", "retrieve_next_sibling"):
        x = getattr(buf, name)
        assert x.shape == (t.num_nodes,) and x.dtype == torch.int64 and x.device.type == "cpu", name


def _check_retrieve_paths(t: Tree, paths: torch.Tensor):
    assert paths.shape == (len(t.leaves), t.max_depth + 1) and paths.dtype == torch.int64
    ends = []
    for row in paths.tolist():
        k = row.index(-1) if -1 in row else len(row)
        path, pad = row[:k], row[k:]
        assert all(x == -1 for x in pad)  # padding only at the tail
        assert path[0] == 0
        for a, b in zip(path, path[1:]):
            assert t.parents[b] == a
        assert not t.children[path[-1]]  # ends at a leaf
        assert tuple(path) == t.path_to(path[-1])
        ends.append(path[-1])
    assert sorted(ends) == sorted(t.leaves) and len(set(ends)) == len(ends)  # one path per leaf
    assert set(t.leaves) == set(range(t.num_nodes)) - set(t.parents[1:])


def _check_next_token_sibling(t: Tree, buf: TreeBuffers):
    nt, ns = buf.retrieve_next_token.tolist(), buf.retrieve_next_sibling.tolist()
    seen = []
    for node in range(t.num_nodes):
        kids = []
        c = nt[node]
        while c != -1:
            assert len(kids) < t.num_nodes, "next_sibling loops"
            kids.append(c)
            c = ns[c]
        assert tuple(kids) == t.children[node]  # exactly the children, in index order
        seen += kids
    assert sorted(seen) == list(range(1, t.num_nodes))  # every non-root node reached exactly once
    assert ns[0] == -1


@PROPS
@given(parent_arrays(), st.integers(0, 5000))
def test_buffer_properties(parents, prefix_len):
    t = Tree(parents)
    buf = build_buffers(t)
    _check_ancestor_mask(t, buf.ancestor_mask)
    _check_positions_and_ranks(t, buf, prefix_len)
    _check_retrieve_paths(t, buf.retrieve_paths)
    _check_next_token_sibling(t, buf)


@PROPS
@given(parent_arrays(), st.randoms(use_true_random=False))
def test_round_trips(parents, rnd):
    t = Tree(parents)
    assert from_medusa_choices(t.to_medusa_choices()).parents == parents
    assert Tree.parse(",".join(map(str, parents))) == t
    assert Tree.parse(", ".join(map(str, parents))).parents == parents
    # any order of the same choices builds the same tree up to numbering
    choices = t.to_medusa_choices()
    rnd.shuffle(choices)
    u = from_medusa_choices(choices)
    assert u.num_nodes == t.num_nodes
    assert sorted(u.to_medusa_choices()) == sorted(t.to_medusa_choices())


# --- 3. errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parents, match",
    [
        ((-1, 0, 2), r"node 2 is its own parent"),         # self-parent: the only cycle a parent array allows ...
        ((-1, 2, 1), r"node 1 has parent 2, which comes after it"),  # ... besides one through a later node
        ((-1, 0, 3, 1), r"node 2 has parent 3, which comes after it"),
        ((-1, 0, -1), r"node 2 has parent -1, but only node 0"),   # a second root
        ((0, -1), r"node 0 is the root"),
        ((-1, 0, -5), r"node 2 has invalid parent -5"),
        ((-1, "x"), r"node 1 has non-integer parent 'x'"),
        ((-1, 0, 0.5), r"node 2 has non-integer parent 0.5"),
        ((-1, None), r"node 1 has non-integer parent None"),
    ],
)
def test_invalid_parent_arrays(parents, match):
    with pytest.raises(TreeError, match=match):
        Tree(parents)


def test_empty_tree():
    with pytest.raises(TreeError, match="at least the root"):
        Tree(())


@pytest.mark.parametrize(
    "spec, match",
    [
        ("-1,0,x", r"node 2: cannot read 'x'"),
        ("-1,,0", r"node 1: cannot read ''"),
        ("-1,0.5", r"node 1: cannot read '0.5'"),
        ("", r"node 0: cannot read ''"),
        ("-1,1", r"node 1 is its own parent"),
        ("-1,0,-1", r"node 2 has parent -1"),
        ("chain:x", r"bad chain spec 'chain:x'"),
        ("chain:-1", r"chain depth must be >= 0, got -1"),
    ],
)
def test_invalid_specs(spec, match):
    with pytest.raises(TreeError, match=match):
        Tree.parse(spec)


def test_negative_chain_depth():
    with pytest.raises(TreeError, match=r"chain depth must be >= 0, got -2"):
        Tree.chain(-2)


def test_check_depth():
    #   0 ─ 1 ─ 2 ─ 3
    #   └── 4
    t = Tree.parse("-1,0,1,2,0")
    t.check_depth(3, "the medusa drafter")  # exactly enough heads: fine
    with pytest.raises(TreeError, match=r"node 3 is at depth 3, beyond the 2 draft positions the medusa drafter"):
        t.check_depth(2, "the medusa drafter")
    Tree.chain(0).check_depth(0, "no drafter")


@pytest.mark.parametrize(
    "choices, match",
    [
        ([(0,), (2,)], r"choice \(2,\) skips rank 1"),
        ([(1,)], r"choice \(1,\) skips rank 0"),
        ([(0,), (0, 0), (0, 2)], r"choice \(0, 2\) skips rank 1"),
        ([(0, 0)], r"choice \(0, 0\) has no parent choice \(0,\)"),
        ([(0,), (1, 0, 0), (1,)], r"choice \(1, 0, 0\) has no parent choice \(1, 0\)"),
        ([(0,), (-1,)], r"choice \(-1,\) has negative rank"),
    ],
)
def test_invalid_medusa_choices(choices, match):
    with pytest.raises(TreeError, match=match):
        from_medusa_choices(choices)


# --- 4. from_sglang -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [1, 2, 5, 8])
@pytest.mark.parametrize("num_draft_tokens", [2, 3, 6, 9, 64])
def test_from_sglang_topk1_is_chain(num_steps, num_draft_tokens):
    t = from_sglang(1, num_steps, num_draft_tokens)
    assert t == Tree.chain(min(num_steps, num_draft_tokens - 1))


def _reference_sglang(topk, num_steps, num_draft_tokens, decay=0.5):
    """The full-expansion definition: score every node of the topk-ary tree, keep the best."""
    cands = [(r,) for r in range(topk)]
    frontier = list(cands)
    for _ in range(num_steps - 1):
        frontier = [p + (r,) for p in frontier for r in range(topk)]
        cands.extend(frontier)
    cands.sort(key=lambda p: (-(decay ** sum(p)) * (0.9 ** len(p)), len(p), p))
    return sorted(cands[: num_draft_tokens - 1], key=lambda p: (len(p), p))


@st.composite
def sglang_settings(draw):
    topk = draw(st.integers(2, 10))
    num_steps = draw(st.integers(1, 10))
    budget = topk + (num_steps - 1) * topk * topk
    return topk, num_steps, draw(st.integers(2, budget + 1))


@PROPS
@given(sglang_settings())
def test_from_sglang_shape(args):
    topk, num_steps, num_draft_tokens = args
    t = from_sglang(topk, num_steps, num_draft_tokens)
    assert t.num_nodes == num_draft_tokens
    assert t.max_depth <= num_steps
    assert max(len(k) for k in t.children) <= topk
    assert list(t.depths) == sorted(t.depths)  # numbered level by level
    assert t.name == f"sglang:topk{topk}-steps{num_steps}-n{num_draft_tokens}"


@PROPS
@given(st.integers(2, 4), st.integers(1, 4), st.data(), st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))
def test_from_sglang_matches_full_expansion(topk, num_steps, data, decay):
    budget = topk + (num_steps - 1) * topk * topk
    n = data.draw(st.integers(2, budget + 1))
    t = from_sglang(topk, num_steps, n, decay=decay)
    assert t.to_medusa_choices() == _reference_sglang(topk, num_steps, n, decay)


def test_from_sglang_hand_written():
    # topk=2, num_steps=2, num_draft_tokens=5: the 4 best of (0) (1) (0,0) (0,1) (1,0) (1,1)
    # scored 0.9, 0.45, 0.81, 0.405, 0.405, 0.2025:
    #   0 ─ 1 ─ 3
    #   │   └── 4
    #   └── 2
    assert from_sglang(2, 2, 5).parents == (-1, 0, 0, 1, 1)
    # a typical SGLang EAGLE setting stays fast and exact in size
    t = from_sglang(8, 8, 64)
    assert t.num_nodes == 64 and t.max_depth <= 8


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 3, 4), r"topk >= 1"),
        ((2, 0, 4), r"num_steps >= 1"),
        ((2, 3, 1), r"num_draft_tokens >= 2"),
        ((2, 1, 4), r"scores only 2 candidates"),
        ((3, 2, 14), r"scores only 12 candidates"),
    ],
)
def test_from_sglang_errors(args, match):
    with pytest.raises(TreeError, match=match):
        from_sglang(*args)


def test_from_sglang_bad_decay():
    with pytest.raises(TreeError, match="decay"):
        from_sglang(2, 2, 4, decay=1.5)


# ----------------------------------------------------------------------------------------------------------
# One ancestor mask (`kernels.tree_ancestor_mask`) behind build_buffers, pad_trees, verify_plan and the SGLang
# CPU op build_tree_kernel_efficient_cpu
# ----------------------------------------------------------------------------------------------------------
@PROPS
@given(st.lists(parent_arrays(max_nodes=12), min_size=1, max_size=4))
def test_pad_trees_ancestors_are_each_trees_mask_padded_with_self(arrays):
    from entmtp_sglang.engine.batch_tree import pad_trees

    trees = [Tree(p) for p in arrays]
    padded = pad_trees(trees)
    n = padded.num_nodes
    for i, t in enumerate(trees):
        want = torch.eye(n, dtype=torch.bool)
        want[: t.num_nodes, : t.num_nodes] = _bool_mask([_ancestors_or_self(t.parents, j) for j in range(t.num_nodes)])
        assert torch.equal(padded.ancestors[i], want)
        assert padded.depths[i, : t.num_nodes].tolist() == list(t.depths)


def test_verify_plan_without_tree_mask_sees_a_chain():
    from entmtp_sglang.sglang.cpu.gather import verify_plan

    n, seq = 4, torch.tensor([2, 0])
    r2t = torch.arange(20).view(2, 10)
    plan = verify_plan(r2t, torch.tensor([0, 1]), seq, n, None)
    for b, s in enumerate(seq.tolist()):
        drafts = plan.mask[b, :, s : s + n]
        assert torch.equal(drafts, torch.tril(torch.ones(n, n, dtype=torch.bool)))
        assert bool(plan.mask[b, :, :s].all())


@pytest.mark.parametrize("mode", [0, 1])
def test_sglang_build_tree_mask_and_positions(mode):
    from entmtp_sglang.sglang.cpu.ops import build_tree_kernel_efficient_cpu

    # Two requests: a small tree (topk=2, depth=3), and a tree whose node 2 is an orphan (its parent
    # candidate was not selected): it sees the root and itself, and its child node 3 sees 0, 2, 3.
    cases = [
        ([[-1, 0, 1, 3, 4]], [[0, 1, 3, 4, 6]], 2, 3, 6,
         [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3, 5}], [0, 1, 1, 2, 2, 3]),
        ([[-1, 0, 1, 3, 4]], [[0, 4, 8]], 2, 3, 4, [{0}, {0, 1}, {0, 2}, {0, 2, 3}], [0, 1, 1, 2]),
    ]
    for parent_list, selected, topk, depth, n, rows, depths in cases:
        seq = 3
        mask = torch.ones(n * n + (seq * n if mode == 0 else 0), dtype=torch.bool)
        positions = torch.empty(n, dtype=torch.long)
        links = torch.full((3, 1, n), -1, dtype=torch.long)
        build_tree_kernel_efficient_cpu(torch.tensor(parent_list), torch.tensor(selected), torch.tensor([seq]), mask,
                                        positions, links[0], links[1], links[2], topk, depth, n, mode)
        drafts = mask.view(n, n) if mode == 1 else mask.view(n, seq + n)[:, seq:]
        assert torch.equal(drafts, _bool_mask(rows))
        assert positions.tolist() == [seq + d for d in depths]
