"""Greedy verification of a drafted token tree against the target's argmax: dispatcher and torch reference."""

from __future__ import annotations

import torch

from ._backend import Backend, check_verify_args, resolve_backend


def verify_tree_greedy_torch(
    parents: torch.Tensor, num_nodes: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`verify_tree_greedy` (same semantics)."""
    check_verify_args(parents, num_nodes, draft_tokens, target_argmax)
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)  # (N,)
    valid = idx[None, :] < num_nodes[:, None]  # (B, N)
    par = torch.where(valid, parents.long(), 0).clamp(min=0)  # (B, N)
    wanted = target_argmax.long().gather(1, par)  # (B, N): target's token after each node's parent
    match = valid & (idx[None, :] >= 1) & (draft_tokens.long() == wanted)  # (B, N)
    kids = match[:, None, :] & (par[:, None, :] == idx[None, :, None])  # (B, N, N): [b, p, v] matching child v of p
    first = torch.where(kids.any(2), kids.to(torch.int8).argmax(2), -1)  # (B, N) lowest matching child, -1: none
    paths = []
    for row in first.tolist():  # descend from the root; at most N - 1 steps (guards against malformed input)
        path = [0]
        while len(path) < n and row[path[-1]] >= 0:
            path.append(row[path[-1]])
        paths.append(path)
    accept_len = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64, device=dev)  # (B,)
    accepted = torch.tensor([p + [-1] * (n - len(p)) for p in paths], dtype=torch.int64, device=dev).view(b, n)
    cur = torch.tensor([p[-1] for p in paths], dtype=torch.int64, device=dev)  # (B,) last accepted node
    bonus = target_argmax.long().gather(1, cur[:, None])[:, 0]  # (B,)
    return accept_len, accepted, bonus


def verify_tree_greedy(
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    draft_tokens: torch.Tensor,
    target_argmax: torch.Tensor,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Longest root path of drafted tokens that the target's greedy (argmax) choices agree with.

    ``parents``: (B, N) int, node 0 the root (parent -1), ``parents[b, i] < i`` (or ``i`` itself: a node
    linked to no parent, never accepted); nodes ``i >= num_nodes[b]`` (``num_nodes[b] >= 1``) are padding.
    ``draft_tokens``, ``target_argmax``: (B, N) int, ``target_argmax[b, v]`` the target's token after node
    ``v``. Returns ``accept_len`` (B,), ``accepted_nodes`` (B, N), ``bonus`` (B,), all int64::

        for b:
            cur, path = 0, [0]
            while some valid v >= 1 has parents[b, v] == cur and draft_tokens[b, v] == target_argmax[b, cur]:
                cur = lowest such v; path.append(cur)
            accept_len[b] = len(path) - 1
            accepted_nodes[b] = path + [-1] * (N - len(path))
            bonus[b] = target_argmax[b, cur]

    ``backend``: "torch", "triton" (CUDA, or any device under TRITON_INTERPRET=1), or "auto".
    """
    if resolve_backend(backend, parents) == "triton":
        from .verify_greedy_triton import verify_tree_greedy_triton

        return verify_tree_greedy_triton(parents, num_nodes, draft_tokens, target_argmax)
    return verify_tree_greedy_torch(parents, num_nodes, draft_tokens, target_argmax)
