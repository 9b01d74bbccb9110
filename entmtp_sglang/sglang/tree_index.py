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
from typing import Callable

import torch

from .tree_plan import TreePlan


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
