"""Ragged node counts inside SGLang's strided verify (issue 36, item 2): each row of a step verifies its own number
of tokens, down to 1 (a resting row: its root alone, plain decoding of one token), while SGLang keeps its
`bs x N` layout for everything after the target's forward.

How a row of n < N nodes rides in the step's (D levels, N nodes) shape:

* its tree is padded to N nodes (`pad_tree`): the N - n extra nodes hang where the shape has room (a node with
  fewer than top-k children, at most D deep, at most top-k expanded nodes per level), numbered after the row's own
  nodes, so the row drafts its own nodes exactly as its own tree would (a node's draft depends only on its
  ancestors and its rank);
* verification (SGLang's order: node k >= 1 is candidate `selected[k - 1]`) sees only the real nodes: the
  padding is unlinked from `retrieve_next_token` / `retrieve_next_sibling` (`verify_links`), so neither SGLang's
  acceptance walk nor its grammar walk ever visits it, as DSpark's compact verify keeps padded rows out;
* the target's verify forward runs only the real tokens: input ids, positions and cache locations packed
  (`packed_index`), attention over a ragged plan (`ragged_verify_plan`: each row's real queries over its prefix
  and its real drafts), and logits and hidden states scattered back to `bs x N` (`scatter_rows`, padding 0).

Pure torch; no SGLang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..tree import Tree
from .cpu.gather import _Plan, verify_plan
from .tree_plan import TreePlan, TreeShapeError, plan_tree


def pad_tree(tree: Tree, num_nodes: int, depth: int, topk: int) -> Tree | None:
    """`tree` with nodes appended up to `num_nodes`, laid out on `depth` draft levels of width `topk`, or None when
    it does not fit. The first `tree.num_nodes` nodes are `tree`'s own; each padding node goes under the first
    node (in node order) that already has children (the root counts) and can take one more, else under the first
    node whose level still has a free draft row:

        for each padding node:
            p = first node with children < topk and depth[p] < depth and expanded(p)  (root: always expanded)
                or first node with depth[p] < depth and its level's expanded count < topk
            parents.append(p)
    """
    if tree.num_nodes > num_nodes or tree.max_depth > depth:
        return None
    parents = list(tree.parents)
    d = [0] * len(parents)
    children = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        d[i] = d[p] + 1
        children[p] += 1
    expanded_at: dict[int, int] = {}
    for i, c in enumerate(children):
        if c and i:
            expanded_at[d[i]] = expanded_at.get(d[i], 0) + 1
    for _ in range(num_nodes - tree.num_nodes):
        spot = next((i for i in range(len(parents)) if d[i] < depth and children[i] < topk
                     and (i == 0 or children[i] > 0)), None)
        if spot is None:
            spot = next((i for i in range(len(parents)) if d[i] < depth and children[i] == 0 and i
                         and expanded_at.get(d[i], 0) < topk), None)
            if spot is None:
                return None
            expanded_at[d[spot]] = expanded_at.get(d[spot], 0) + 1
        parents.append(spot)
        d.append(d[spot] + 1)
        children.append(0)
        children[spot] += 1
    padded = Tree(tuple(parents), name=f"{tree.name}+pad{num_nodes}" if num_nodes > tree.num_nodes else tree.name)
    try:
        plan_tree(padded, topk, depth)
    except TreeShapeError:
        return None
    return padded


@dataclass(frozen=True)
class VerifyLinks:
    """One padded tree's verify layout in SGLang's node order (node k >= 1 is candidate `selected[k - 1]`):
    which nodes are real, and SGLang's first-child / next-sibling lists over the real nodes only (-1: none)."""

    real: tuple[bool, ...]
    next_token: tuple[int, ...]
    next_sibling: tuple[int, ...]


def verify_links(plan: TreePlan, real_nodes: int) -> VerifyLinks:
    """The links of `plan`'s tree with only its first `real_nodes` nodes (of the tree's own numbering) real:

        node_of[k]   = 0 if k == 0 else plan.selected_nodes[k - 1]
        real[k]      = node_of[k] < real_nodes
        next_token[k]   = the least real j whose parent is k                  (k real; else -1)
        next_sibling[k] = the least real j > k with k's parent               (k real; else -1)

    With every node real these are the lists SGLang's `build_tree_kernel_efficient` builds."""
    n = plan.num_nodes
    node_of = [0, *plan.selected_nodes]
    order = {node: k for k, node in enumerate(node_of)}
    parent = [-1] + [order[plan.tree.parents[node_of[k]]] for k in range(1, n)]
    real = [node_of[k] < real_nodes for k in range(n)]
    first = [-1] * n
    sibling = [-1] * n
    last_child: dict[int, int] = {}
    for k in range(1, n):
        if not real[k]:
            continue
        p = parent[k]
        if p in last_child:
            sibling[last_child[p]] = k
        else:
            first[p] = k
        last_child[p] = k
    return VerifyLinks(tuple(real), tuple(first), tuple(sibling))


def packed_index(real: torch.Tensor) -> torch.Tensor:
    """(T,) positions in the flat `bs x N` layout of the real nodes of `real` (bs, N), row by row, each row's in
    ascending node order: what the packed forward runs, in that order."""
    return real.reshape(-1).nonzero().squeeze(1)


def scatter_rows(packed: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    """(total, ...) zeros with `packed` (T, ...) written at rows `index` (T,): a packed output back in `bs x N`."""
    out = packed.new_zeros((total, *packed.shape[1:]))
    out.index_copy_(0, index, packed)
    return out


def ragged_verify_plan(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, n: int,
                       custom_mask: torch.Tensor | None, real: torch.Tensor, counts: Sequence[int]) -> _Plan:
    """The tree-verify plan (`gather.verify_plan`) for the real queries only: row b's queries are its real nodes
    `real[b]` (bs, N), in ascending node order, held in the packed tokens at `sum(counts[:b]) + j`; each sees the
    request's prefix and the real drafts the tree mask shows it (a real node's ancestors are real). Padding query
    rows (j >= counts[b]) get the root's visibility and are never written back."""
    full = verify_plan(req_to_token, req_pool_indices, seq_lens, n, custom_mask)
    bs, dev = real.shape[0], real.device
    q = max(max(counts), 1)
    cols = torch.arange(n, device=dev)
    order = torch.where(real, cols, n + cols).argsort(dim=1)[:, :q]               # (bs, Q) real nodes first
    counts_t = torch.tensor(list(counts), dtype=torch.long, device=dev)
    j = torch.arange(q, device=dev)
    q_valid = j[None, :] < counts_t[:, None]
    order = torch.where(q_valid, order, 0)                                         # padding queries: the root's row
    mask = full.mask.gather(1, order[:, :, None].expand(bs, q, full.mask.shape[2]))
    starts = torch.cumsum(counts_t, 0) - counts_t
    q_idx = torch.where(q_valid, starts[:, None] + j[None, :], 0)
    # every row as long as the longest (batch 1 always): the packed queries are exactly bs x Q in order, a view
    return _Plan(full.kv_idx, mask, q_idx, q_valid, dense=all(c == q for c in counts))


@dataclass(frozen=True)
class RaggedVerify:
    """This step's ragged verify: per row the real nodes of the `bs x N` layout (`real`, on device), their count
    (`counts`, host), the packed positions (`index`), and the verify links SGLang's acceptance and grammar walks
    follow (`next_token`, `next_sibling`, (bs, N))."""

    real: torch.Tensor
    counts: tuple[int, ...]
    index: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.real.shape[1])

    @property
    def total_tokens(self) -> int:
        return sum(self.counts)
