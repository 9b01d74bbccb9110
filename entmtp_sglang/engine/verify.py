"""Verification: map a drafted tree and the target's outputs at every node to the accepted path.

Drafting happens elsewhere; these functions see only tokens and target scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import verify_tree_greedy
from ..tree import Tree

NO_TOKEN = -1  # next_token when the target allows no token after the path (a grammar dead end or stop)


@dataclass(frozen=True)
class Accepted:
    """nodes: the accepted path, root first (node 0, then the accepted drafts). next_token: the token
    the target adds after the path (the bonus token, or the correction on a rejection), or NO_TOKEN
    where the target allows nothing there (a grammar-masked node with no legal token)."""

    nodes: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.nodes) - 1


def verify_greedy(tree: Tree, tokens: list[int], target_argmax: list[int]) -> Accepted:
    """Longest root path whose drafted tokens equal the target's argmax at their parent.
    A node whose argmax is NO_TOKEN (nothing allowed there) ends the path without a next token.

        node = 0
        while some child c of node has tokens[c] == target_argmax[node]: node = c   # the lowest such c
        next_token = target_argmax[node]

    One tree of the batched `kernels.verify_tree_greedy` (children are numbered in rank order, so the
    lowest matching child is the first in `tree.children`).
    """
    n = tree.num_nodes
    as_row = lambda x: torch.tensor([x[:n]], dtype=torch.int64)  # noqa: E731
    return verify_greedy_batch(as_row(tree.parents), [n], as_row(tokens), as_row(target_argmax))[0]


def verify_greedy_batch(parents: torch.Tensor, num_nodes: list[int], tokens: torch.Tensor,
                        target_argmax: torch.Tensor) -> list[Accepted]:
    """`verify_greedy` for a padded batch of trees in one `kernels.verify_tree_greedy` call: parents,
    tokens and target_argmax (B, N), row b's nodes >= num_nodes[b] padding."""
    accept_len, nodes, next_token = verify_tree_greedy(
        parents.long(), torch.tensor(num_nodes, dtype=torch.int64), tokens.long(), target_argmax.long())
    rows, lens, nxt = nodes.tolist(), accept_len.tolist(), next_token.tolist()
    return [Accepted(tuple(rows[b][: lens[b] + 1]), nxt[b]) for b in range(len(num_nodes))]


def verify_node_sampling(p: torch.Tensor, candidates: list[int], q: list[torch.Tensor | None],
                         generator: torch.Generator) -> tuple[int | None, int | None]:
    """Recursive rejection sampling over the sibling drafts of one node (SpecInfer / EAGLE).

    p: target distribution (V,) at this node. candidates: the children's tokens in rank order.
    q[i]: the distribution candidate i was drawn from, given candidates 0..i-1 were rejected, or
    None if the draft was chosen deterministically (point mass on candidates[i]).

        for each candidate x with draft distribution q:
            accept x with probability min(1, p(x) / q(x))      # p: target, q: draft
            otherwise p <- normalize(max(0, p - q))            # the residual
        if none is accepted: sample from the final residual p

    Returns (index of the accepted candidate, None) or (None, token sampled from the residual).
    The output token is distributed exactly as the original p.
    """
    p = p.clone()
    for i, x in enumerate(candidates):
        qi = q[i]
        q_x = 1.0 if qi is None else float(qi[x])
        p_x = float(p[x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            return i, None
        if qi is None:
            p[x] = 0.0
        else:
            p = torch.clamp(p - qi, min=0.0)
        total = float(p.sum())
        if total <= 0:  # numerically exhausted: the residual is undefined; fall back to the rest
            break
        p = p / total
    return None, int(torch.multinomial(p, 1, generator=generator))


def verify_sampling(tree: Tree, tokens: list[int], target_probs: torch.Tensor,
                    generator: torch.Generator, draft_probs: dict[int, list[torch.Tensor | None]] | None = None
                    ) -> Accepted:
    """Walk the tree from the root, at each node running recursive rejection over its children.

    target_probs: (N, V) target distribution at every node (after temperature/top-k/top-p).
    draft_probs[node]: per child of node, its q (see `verify_node_sampling`); default point masses.
    A node whose target row has no mass (nothing allowed there) ends the path with NO_TOKEN.
    """
    path = [0]
    node = 0
    while True:
        if not float(target_probs[node].sum()) > 0:
            return Accepted(tuple(path), NO_TOKEN)
        kids = list(tree.children[node])
        q = (draft_probs or {}).get(node, [None] * len(kids))
        if not kids:
            return Accepted(tuple(path), int(torch.multinomial(target_probs[node], 1, generator=generator)))
        idx, token = verify_node_sampling(target_probs[node], [tokens[c] for c in kids], q, generator)
        if idx is None:
            return Accepted(tuple(path), int(token))
        node = kids[idx]
        path.append(node)
