"""One tree's draft as device tensors: every index a fixed tree's draft needs, built once per tree of the set at
start-up on the server's device, and the draft levels over them.

`draft_tree` runs a tree's draft levels with gathers and scatters on device tensors only: no Python lists, no
host copies and no per-node branching inside a level, so the same code runs eagerly on a CPU and can be
captured in a CUDA graph (one per tree shape: every index here is a constant of the tree). Hooks for what
must read the host (grammar masks, calibration records) are optional and run only when given.

Pure torch over `tree_plan.TreePlan`; no SGLang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..tree import Tree
from .ragged import pad_tree, verify_links
from .tree_plan import TreePlan, plan_tree


def _long(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


@dataclass(frozen=True)
class TreeIndex:
    """A `TreePlan`'s indices as tensors on one device. Node ids are the tree's own (0 = root)."""

    plan: TreePlan
    first: torch.Tensor                    # (n1,) the depth-1 nodes
    first_rank: torch.Tensor               # (n1,) their ranks among the root's top-k
    rows: tuple[torch.Tensor, ...]         # per level: (topk,) the node each draft row feeds (padding repeats)
    row_parents: tuple[torch.Tensor, ...]  # per level: (topk,) that node's parent (whose hidden state it reads)
    expanded: tuple[torch.Tensor, ...]     # per level: the nodes expanded in this level, one per row
    children: tuple[torch.Tensor, ...]     # per level: the nodes drafted by this level (depth level + 2)
    child_src: tuple[torch.Tensor, ...]    # per level: each child's place in the level's top-k, row * topk + rank
    parent_list: torch.Tensor              # (1, 1 + (num_steps - 1) * topk): SGLang's candidate parents
    selected: torch.Tensor                 # (1, num_nodes - 1): SGLang's sorted candidate indices
    selected_nodes: torch.Tensor           # (num_nodes - 1,) the node holding each selected candidate
    row_offsets: tuple[torch.Tensor, ...]  # per level: (topk, A) draft-slot offsets each row attends to
    row_valid: tuple[torch.Tensor, ...]    # per level: (topk, A) which of those offsets are real

    @property
    def levels(self) -> int:
        """Draft forwards this tree needs (its depth minus one)."""
        return len(self.rows)

    @classmethod
    def build(cls, plan: TreePlan, device: torch.device | str = "cpu") -> TreeIndex:
        parents, depth, rank, topk = plan.tree.parents, plan.depth, plan.rank, plan.topk
        first = [i for i in range(1, plan.num_nodes) if depth[i] == 1]
        rows, row_parents, expanded, children, child_src = [], [], [], [], []
        for level, col in enumerate(plan.columns):
            if not col:
                break
            feed = list(col) + [col[0]] * (topk - len(col))
            kids = [i for i in range(1, plan.num_nodes) if depth[i] == level + 2]
            rows.append(_long(feed, device))
            row_parents.append(_long((parents[n] for n in feed), device))
            expanded.append(_long(col, device))
            children.append(_long(kids, device))
            child_src.append(_long((col.index(parents[i]) * topk + rank[i] for i in kids), device))
        offsets, valid = [], []
        for level_rows in plan.ancestor_offsets:   # every row attends to at least its own slot
            a = max(len(r) for r in level_rows)
            offsets.append(torch.tensor([list(r) + [0] * (a - len(r)) for r in level_rows], dtype=torch.long,
                                        device=device))
            valid.append(torch.tensor([[j < len(r) for j in range(a)] for r in level_rows], dtype=torch.bool,
                                      device=device))
        return cls(plan=plan, first=_long(first, device), first_rank=_long((rank[i] for i in first), device),
                   rows=tuple(rows), row_parents=tuple(row_parents), expanded=tuple(expanded),
                   children=tuple(children), child_src=tuple(child_src),
                   parent_list=_long(plan.parent_list, device).view(1, -1),
                   selected=_long(plan.selected, device).view(1, -1),
                   selected_nodes=_long(plan.selected_nodes, device),
                   row_offsets=tuple(offsets), row_valid=tuple(valid))


# forward_level(level, input_ids (bs * topk,), hidden (bs * topk, H)) -> (logits (bs, topk, V), hidden (bs, topk, H))
ForwardLevel = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# on_level(level, top (bs, topk rows, topk ranks) in the target vocabulary, logits, tokens (bs, N)); may edit top
OnLevel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def draft_tree(index: TreeIndex, root_top: torch.Tensor, root_hidden: torch.Tensor, forward_level: ForwardLevel,
               hot: torch.Tensor | None = None, on_level: OnLevel | None = None) -> torch.Tensor:
    """Draft one fixed tree for a batch. `root_top` (bs, topk): the root's children by rank, in the target
    vocabulary; `root_hidden` (bs, H): the hidden state the depth-1 nodes read; `hot` maps the drafter's
    vocabulary to the target's. Returns tokens (bs, num_nodes): each node's drafted token (column 0 unused).

    Each level feeds the tree's expanded nodes of one depth (one per row), takes the top-k of their next-token
    logits and scatters it to their children; the children's ranks say which of the top-k each one gets."""
    plan = index.plan
    bs = root_top.shape[0]
    tokens = root_top.new_zeros(bs, plan.num_nodes)
    tokens[:, index.first] = root_top[:, index.first_rank]
    hidden = root_hidden.new_zeros(bs, plan.num_nodes, root_hidden.shape[-1])
    hidden[:, 0] = root_hidden
    for level in range(index.levels):
        ids = tokens[:, index.rows[level]].flatten()
        logits, out = forward_level(level, ids, hidden[:, index.row_parents[level]].flatten(0, 1))
        top = torch.topk(logits, plan.topk, dim=-1).indices
        if hot is not None:
            top = hot[top]
        if on_level is not None:
            on_level(level, top, logits, tokens)
        hidden[:, index.expanded[level]] = out[:, : index.expanded[level].shape[0]]
        tokens[:, index.children[level]] = top.flatten(1)[:, index.child_src[level]]
    return tokens


# -- each row its own tree of one shape ------------------------------------------------------------------------
def _pad_rows(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Stack 1-d (or 2-d, padded on the last dim) tensors of different lengths, padding with `fill`."""
    width = max([r.shape[-1] for r in rows] + [1])
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=fill) for r in rows])


@dataclass(frozen=True)
class RowIndex:
    """The draft indices of trees of one shape (D draft steps, N nodes, top-k), one tree per leading entry: the
    fields of `TreeIndex`, each padded per level to the widest tree of the shape. `ShapeIndex` holds one entry per
    tree of the shape; `ShapeIndex.gather(rows)` one per batch row. A padded node id is N, a sink column that
    `draft_rows` drops; a tree with fewer levels than D feeds node 0 (the root) in the levels it lacks and
    scatters nothing from them."""

    num_nodes: int
    topk: int
    first: torch.Tensor                    # (R, F) depth-1 nodes (padding: N)
    first_rank: torch.Tensor               # (R, F) their ranks among the root's top-k (padding: 0)
    rows: tuple[torch.Tensor, ...]         # per level: (R, topk) the node each draft row feeds
    row_parents: tuple[torch.Tensor, ...]  # per level: (R, topk) that node's parent
    expanded: tuple[torch.Tensor, ...]     # per level: (R, E) the nodes expanded, one per draft row (padding: N)
    children: tuple[torch.Tensor, ...]     # per level: (R, C) the nodes drafted by the level (padding: N)
    child_src: tuple[torch.Tensor, ...]    # per level: (R, C) each child's place in the top-k (padding: 0)
    parent_list: torch.Tensor              # (R, 1 + (D - 1) * topk) SGLang's candidate parents
    selected: torch.Tensor                 # (R, N - 1) SGLang's sorted candidate indices
    selected_nodes: torch.Tensor           # (R, N - 1) the node holding each selected candidate
    row_offsets: tuple[torch.Tensor, ...]  # per level: (R, topk, A) draft-slot offsets each draft row attends to
    row_valid: tuple[torch.Tensor, ...]    # per level: (R, topk, A) which of those are real

    @property
    def levels(self) -> int:
        return len(self.rows)

    def take(self, rows: torch.Tensor) -> RowIndex:
        """Entries `rows` ((bs,) long, on this index's device) of every field: a device gather, no host read."""
        def g(t):
            return t.index_select(0, rows)

        return RowIndex(self.num_nodes, self.topk, g(self.first), g(self.first_rank),
                        *(tuple(g(t) for t in f) for f in (self.rows, self.row_parents, self.expanded,
                                                             self.children, self.child_src)),
                        g(self.parent_list), g(self.selected), g(self.selected_nodes),
                        tuple(g(t) for t in self.row_offsets), tuple(g(t) for t in self.row_valid))


@dataclass(frozen=True)
class ShapeIndex:
    """Every tree of one step shape, stacked: trees of N nodes and depth at most D, each laid out on D draft
    steps (`plan_tree(tree, topk, D)`), so that every row of a batch can draft its own (`gather`)."""

    trees: tuple[int, ...]   # tree ids (the caller's: indices into a tree set), in stack order
    plans: tuple[TreePlan, ...]
    stack: RowIndex
    # ragged shapes (`for_trees(..., ragged=True)`): each tree's own node count (the rest of its plan is padding,
    # ragged.pad_tree) and, stacked on device, its verify links over its real nodes (ragged.verify_links):
    # (real, next_token, next_sibling), each (R, N)
    real_nodes: tuple[int, ...] = ()
    links: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, trees: list[int], plans: list[TreePlan], device: torch.device | str = "cpu") -> ShapeIndex:
        if not plans or len(trees) != len(plans):
            raise ValueError("ShapeIndex needs one plan per tree id, at least one")
        n, topk, steps = plans[0].num_nodes, plans[0].topk, plans[0].num_steps
        bad = [p.tree.name for p in plans if (p.num_nodes, p.topk, p.num_steps) != (n, topk, steps)]
        if bad:
            raise ValueError(f"trees {bad} are not laid out on ({steps} steps, {n} nodes, top-{topk}) like "
                             f"{plans[0].tree.name}")
        idx = [TreeIndex.build(p, "cpu") for p in plans]
        levels = max(steps - 1, 0)
        zeros = torch.zeros(topk, dtype=torch.long)
        empty = torch.zeros(0, dtype=torch.long)

        def level_field(name, default):
            return tuple(_pad_rows([getattr(i, name)[lv] if lv < i.levels else default for i in idx],
                                   n if name in ("expanded", "children") else 0)
                         for lv in range(levels))

        offsets, valid = [], []
        for lv in range(levels):
            a = max(i.row_offsets[lv].shape[1] for i in idx)
            offsets.append(torch.stack([torch.nn.functional.pad(i.row_offsets[lv], (0, a - i.row_offsets[lv].shape[1]))
                                        for i in idx]))
            valid.append(torch.stack([torch.nn.functional.pad(i.row_valid[lv], (0, a - i.row_valid[lv].shape[1]),
                                                              value=False) for i in idx]))
        stack = RowIndex(n, topk, _pad_rows([i.first for i in idx], n), _pad_rows([i.first_rank for i in idx], 0),
                         level_field("rows", zeros), level_field("row_parents", zeros),
                         level_field("expanded", empty), level_field("children", empty),
                         level_field("child_src", empty),
                         torch.cat([i.parent_list for i in idx]), torch.cat([i.selected for i in idx]),
                         torch.stack([i.selected_nodes for i in idx]), tuple(offsets), tuple(valid))
        stack = RowIndex(n, topk, *(_to(f, device) for f in _fields(stack)))
        return cls(tuple(trees), tuple(plans), stack)

    @classmethod
    def for_trees(cls, trees: Sequence[Tree], topk: int, device: torch.device | str = "cpu", ragged: bool = False
                  ) -> dict[tuple[int, int], ShapeIndex]:
        """(levels D, nodes N) -> the stack of every tree of `trees` with N nodes and depth 1..D, laid out on D
        draft steps, tree ids their indices in `trees`: one per speculating shape of the set (each tree's own
        (depth, nodes)), the shapes a step runs in when its rows draft different trees of one node count.
        `ragged`: also every tree with fewer nodes (down to chain:0, the resting row) that pads into the shape
        (`ragged.pad_tree`), with its real node count and verify links."""
        out: dict[tuple[int, int], ShapeIndex] = {}
        for tree in trees:
            shape = (tree.max_depth, tree.num_nodes)
            if tree.max_depth == 0 or shape in out:
                continue
            d, n = shape
            if not ragged:
                ids = [i for i, t in enumerate(trees) if t.num_nodes == n and 1 <= t.max_depth <= d]
                out[shape] = cls.build(ids, [plan_tree(trees[i], topk, d) for i in ids], device)
                continue
            padded = {i: pad_tree(t, n, d, topk) for i, t in enumerate(trees) if t.num_nodes <= n and t.max_depth <= d}
            ids = [i for i, p in padded.items() if p is not None]
            plans = [plan_tree(padded[i], topk, d) for i in ids]
            built = cls.build(ids, plans, device)
            links = [verify_links(p, trees[i].num_nodes) for i, p in zip(ids, plans)]
            out[shape] = cls(built.trees, built.plans, built.stack, tuple(trees[i].num_nodes for i in ids),
                             (torch.tensor([x.real for x in links], dtype=torch.bool, device=device),
                              torch.tensor([x.next_token for x in links], dtype=torch.long, device=device),
                              torch.tensor([x.next_sibling for x in links], dtype=torch.long, device=device)))
        return out

    def position(self, tree: int) -> int:
        """Where tree id `tree` sits in the stack (what `gather` takes)."""
        return self.trees.index(tree)

    def gather(self, rows: torch.Tensor) -> RowIndex:
        """Each batch row's tree: `rows` (bs,) stack positions on this index's device."""
        return self.stack.take(rows)


def _fields(index: RowIndex) -> tuple:
    return (index.first, index.first_rank, index.rows, index.row_parents, index.expanded, index.children,
            index.child_src, index.parent_list, index.selected, index.selected_nodes, index.row_offsets,
            index.row_valid)


def _to(field, device):
    return tuple(t.to(device) for t in field) if isinstance(field, tuple) else field.to(device)


def draft_rows(index: RowIndex, root_top: torch.Tensor, root_hidden: torch.Tensor, forward_level: ForwardLevel,
               hot: torch.Tensor | None = None, on_level: OnLevel | None = None) -> torch.Tensor:
    """`draft_tree` with each row of the batch drafting its own tree (`index`: one entry per row, from
    `ShapeIndex.gather`). Returns tokens (bs, N). Per level, with node N a sink for padding:

        ids[b, c]             = tokens[b, rows[b, c]]
        hidden_in[b, c]       = hidden[b, row_parents[b, c]]
        top                   = topk(forward_level(ids, hidden_in).logits)
        hidden[b, expanded[b, j]]  = out[b, j]
        tokens[b, children[b, k]]  = top[b].flatten()[child_src[b, k]]

    Gathers and scatters on device tensors only (no host reads, capturable in a graph)."""
    n = index.num_nodes
    bs, width = root_top.shape[0], root_hidden.shape[-1]
    tokens = root_top.new_zeros(bs, n + 1)
    tokens.scatter_(1, index.first, root_top.gather(1, index.first_rank))
    hidden = root_hidden.new_zeros(bs, n + 1, width)
    hidden[:, 0] = root_hidden
    for level in range(index.levels):
        ids = tokens.gather(1, index.rows[level]).flatten()
        parents = index.row_parents[level][..., None].expand(-1, -1, width)
        logits, out = forward_level(level, ids, hidden.gather(1, parents).flatten(0, 1))
        top = torch.topk(logits, index.topk, dim=-1).indices
        if hot is not None:
            top = hot[top]
        if on_level is not None:
            on_level(level, top, logits, tokens[:, :n])
        expanded = index.expanded[level]
        hidden.scatter_(1, expanded[..., None].expand(-1, -1, width), out[:, : expanded.shape[1]].to(hidden.dtype))
        tokens.scatter_(1, index.children[level], top.flatten(1).gather(1, index.child_src[level]).to(tokens))
    return tokens[:, :n]
