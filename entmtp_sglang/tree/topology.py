"""The one canonical tree form, a parent array, and every buffer derived from it.

A draft tree has `num_nodes` nodes in topological order. Node 0 is the root: the token the target has
already chosen (it is verified, not drafted). `parents[0] == -1` and `0 <= parents[i] < i` otherwise.
Children of a node are ranked by index: the first child carries the drafter's best token for that
position, the second the runner-up, and so on (`sibling_rank`).

    chain:3             0 - 1 - 2 - 3              parents (-1, 0, 1, 2)
    a small tree        0 - 1 - 3                  parents (-1, 0, 0, 1, 1)
                          |   ` 4
                          ` 2
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..kernels import tree_ancestor_mask


class TreeError(ValueError):
    """A tree that is not a valid parent array; the message names the offending node."""


def _parent_index(i: int, p) -> int:
    try:
        q = int(p)
    except (TypeError, ValueError):
        raise TreeError(f"node {i} has non-integer parent {p!r}") from None
    if isinstance(p, float) and p != q:
        raise TreeError(f"node {i} has non-integer parent {p!r}")
    return q


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self):
        parents = tuple(_parent_index(i, p) for i, p in enumerate(self.parents))
        object.__setattr__(self, "parents", parents)
        if not parents:
            raise TreeError("a tree needs at least the root node")
        if parents[0] != -1:
            raise TreeError(f"node 0 is the root and must have parent -1, not {parents[0]}")
        for i, p in enumerate(parents[1:], start=1):
            if p == -1:
                raise TreeError(f"node {i} has parent -1, but only node 0 may be a root")
            if p == i:
                raise TreeError(f"node {i} is its own parent (a cycle)")
            if p > i:
                raise TreeError(f"node {i} has parent {p}, which comes after it: parents must precede "
                                f"children (topological order), or the tree has a cycle")
            if p < -1:
                raise TreeError(f"node {i} has invalid parent {p}")
        if not self.name:
            object.__setattr__(self, "name", self.default_name())

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def chain(cls, depth: int) -> "Tree":
        if depth < 0:
            raise TreeError(f"chain depth must be >= 0, got {depth}")
        return cls(tuple(range(-1, depth)), name=f"chain:{depth}")

    @classmethod
    def parse(cls, spec: str) -> "Tree":
        """`chain:N` or a comma-separated parent array such as `-1,0,0,1`."""
        spec = spec.strip()
        if spec.startswith("chain:"):
            try:
                return cls.chain(int(spec.split(":", 1)[1]))
            except ValueError as e:
                raise TreeError(f"bad chain spec {spec!r}: {e}") from None
        parents = []
        for i, x in enumerate(spec.replace(" ", "").split(",")):
            try:
                parents.append(int(x))
            except ValueError:
                raise TreeError(f"node {i}: cannot read {x!r} as a parent index in {spec!r} (expected chain:N "
                                f"or a comma-separated parent array)") from None
        return cls(tuple(parents))

    def default_name(self) -> str:
        if self.parents == tuple(range(-1, len(self.parents) - 1)):
            return f"chain:{len(self.parents) - 1}"
        return f"tree:n{self.num_nodes}d{self.max_depth}"

    # --- derived facts ------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def sibling_rank(self) -> tuple[int, ...]:
        rank = [0] * self.num_nodes
        for kids in self.children:
            for r, c in enumerate(kids):
                rank[c] = r
        return tuple(rank)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_nodes) if not self.children[i])

    def path_to(self, node: int) -> tuple[int, ...]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    def check_depth(self, max_depth: int, what: str) -> None:
        if self.max_depth > max_depth:
            deepest = max(range(self.num_nodes), key=lambda i: self.depths[i])
            raise TreeError(f"tree {self.name}: node {deepest} is at depth {self.max_depth}, beyond the "
                            f"{max_depth} draft positions {what} provides")

    def to_medusa_choices(self) -> list[tuple[int, ...]]:
        """Each non-root node as its path of sibling ranks (Medusa's `medusa_choices` form)."""
        return [tuple(self.sibling_rank[n] for n in self.path_to(i)[1:]) for i in range(1, self.num_nodes)]


@dataclass(frozen=True)
class TreeBuffers:
    """Everything the engines need, derived from the parent array by `build_buffers`.

    ancestor_mask[i, j]: node i may attend to node j (j is i or an ancestor of i).
    positions: depth of each node (add the prefix length for absolute positions).
    retrieve_paths[l]: the root-to-leaf node path for leaf l, padded with -1.
    retrieve_next_token / retrieve_next_sibling: SGLang's layout (first child, next sibling; -1 = none).
    """

    parents: torch.Tensor
    positions: torch.Tensor
    sibling_rank: torch.Tensor
    ancestor_mask: torch.Tensor
    retrieve_paths: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


def embedding(small: Tree, big: Tree) -> tuple[int, ...] | None:
    """Where `small` sits inside `big` when it is a prefix of it: node i of `small` is node result[i] of `big`
    (the root on the root, the rank-r child of a node on the rank-r child of its image); None when some node
    of `small` has no such image. A tree set's smaller trees embed in its larger ones this way, so a step
    that drafted a large tree can verify a smaller one by keeping the image's nodes."""
    image = [0] * small.num_nodes
    for i in range(1, small.num_nodes):
        kids = big.children[image[small.parents[i]]]
        rank = small.sibling_rank[i]
        if rank >= len(kids):
            return None
        image[i] = kids[rank]
    return tuple(image)


def build_buffers(tree: Tree, device: torch.device | str = "cpu") -> TreeBuffers:
    n = tree.num_nodes
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    mask, _ = tree_ancestor_mask(as_t([tree.parents]), as_t([n]))  # (1, N, N): Triton on CUDA, else torch
    paths = torch.full((len(tree.leaves), tree.max_depth + 1), -1, dtype=torch.int64)
    for li, leaf in enumerate(tree.leaves):
        p = tree.path_to(leaf)
        paths[li, : len(p)] = torch.tensor(p)
    next_token = torch.full((n,), -1, dtype=torch.int64)
    next_sibling = torch.full((n,), -1, dtype=torch.int64)
    for i, kids in enumerate(tree.children):
        if kids:
            next_token[i] = kids[0]
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    return TreeBuffers(
        parents=as_t(tree.parents),
        positions=as_t(tree.depths),
        sibling_rank=as_t(tree.sibling_rank),
        ancestor_mask=mask[0],
        retrieve_paths=paths.to(device),
        retrieve_next_token=next_token.to(device),
        retrieve_next_sibling=next_sibling.to(device),
    )


def from_medusa_choices(choices, name: str = "") -> Tree:
    """Build a tree from Medusa-style choices: each a tuple of sibling ranks from the root.

    Nodes are numbered in the order the choices are given (duplicates and the empty root choice are
    skipped), except that a choice listed before its parent or its next-lower-ranked sibling is numbered
    right after them. So a list in valid topological order, such as `Tree.to_medusa_choices()`
    returns, keeps its order and `from_medusa_choices(t.to_medusa_choices()) == t`.
    """
    order = list(dict.fromkeys(tuple(int(r) for r in c) for c in choices))
    present = set(order) | {()}
    for path in sorted(present, key=lambda c: (len(c), c)):
        if not path:
            continue
        if path[-1] < 0:
            raise TreeError(f"choice {path} has negative rank {path[-1]}")
        if path[:-1] not in present:
            raise TreeError(f"choice {path} has no parent choice {path[:-1]}")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in present:
            raise TreeError(f"choice {path} skips rank {path[-1] - 1}: sibling ranks must be contiguous")
    index = {(): 0}
    parents = [-1]

    def place(path: tuple[int, ...]) -> None:
        # iterative, so deep chains cannot hit the recursion limit
        stack = [path]
        while stack:
            c = stack[-1]
            if c in index:
                stack.pop()
                continue
            deps = [c[:-1]] + ([c[:-1] + (c[-1] - 1,)] if c[-1] > 0 else [])
            missing = [d for d in deps if d not in index]
            if missing:
                stack.extend(reversed(missing))
                continue
            stack.pop()
            index[c] = len(parents)
            parents.append(index[c[:-1]])

    for path in order:
        place(path)
    return Tree(tuple(parents), name=name)


def from_sglang(topk: int, num_steps: int, num_draft_tokens: int, decay: float = 0.5) -> Tree:
    """The tree SGLang's EAGLE settings (topk, num_steps, num_draft_tokens) describe.

    SGLang expands `topk` children per node for `num_steps` levels and keeps the `num_draft_tokens - 1`
    best-scored nodes. The kept set depends on the scores; this importer assumes the typical case
    where the probability of the rank-r child decays geometrically (`decay ** r`, 0 <= decay <= 1), so
    it keeps the nodes with the highest product along their path. With topk=1 it is exactly a chain.
    SGLang scores `topk + (num_steps - 1) * topk**2` candidates, so with topk > 1 `num_draft_tokens - 1`
    may not exceed that. Nodes are numbered level by level (breadth first).
    """
    if topk < 1 or num_steps < 1 or num_draft_tokens < 2:
        raise TreeError("need topk >= 1, num_steps >= 1 and num_draft_tokens >= 2")
    if topk == 1:
        return Tree.chain(min(num_steps, num_draft_tokens - 1))
    if not 0.0 <= decay <= 1.0:
        raise TreeError(f"decay must be in [0, 1], got {decay}")
    budget = topk + (num_steps - 1) * topk * topk
    if num_draft_tokens - 1 > budget:
        raise TreeError(f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} drafted nodes, but "
                        f"topk={topk} with num_steps={num_steps} scores only {budget} candidates")

    def key(p: tuple[int, ...]):
        return (-(decay ** sum(p)) * (0.9 ** len(p)), len(p), p)

    # Best-first search: a child's key always exceeds its parent's (0 <= decay <= 1), so popping the
    # smallest key num_draft_tokens - 1 times yields exactly the best nodes of the full expansion
    # without enumerating all topk**num_steps of them.
    heap = [(key((r,)), (r,)) for r in range(topk)]
    heapq.heapify(heap)
    kept = []
    while len(kept) < num_draft_tokens - 1:
        _, p = heapq.heappop(heap)
        kept.append(p)
        if len(p) < num_steps:
            for r in range(topk):
                c = p + (r,)
                heapq.heappush(heap, (key(c), c))
    kept.sort(key=lambda p: (len(p), p))
    return from_medusa_choices(kept, name=f"sglang:topk{topk}-steps{num_steps}-n{num_draft_tokens}")
