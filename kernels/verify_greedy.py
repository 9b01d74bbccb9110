"""Greedy verification of a drafted token tree against the target's argmax: dispatcher and torch reference."""

from __future__ import annotations

import torch

from ._backend import Backend, check_tree_args, resolve_backend


def _check(
    parents: torch.Tensor, num_nodes: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> None:
    check_tree_args(parents, num_nodes)
    if parents.shape[1] == 0:
        raise ValueError("trees need N >= 1 node slots (node 0 is the root)")
    for name, t in (("draft_tokens", draft_tokens), ("target_argmax", target_argmax)):
        if t.shape != parents.shape:
            raise ValueError(f"{name} must have the shape of parents {tuple(parents.shape)}, got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != parents.device:
            raise ValueError(f"{name} must be on the device of parents")


def verify_tree_greedy_torch(
    parents: torch.Tensor, num_nodes: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`verify_tree_greedy` (same semantics)."""
    _check(parents, num_nodes, draft_tokens, target_argmax)
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)  # (N,)
    valid = idx[None, :] < num_nodes[:, None]  # (B, N)
    par = torch.where(valid, parents.long(), 0).clamp(min=0)  # (B, N)
    wanted = target_argmax.long().gather(1, par)  # (B, N): target's token after each node's parent
    match = valid & (idx[None, :] >= 1) & (draft_tokens.long() == wanted)  # (B, N)
    cur = torch.zeros(b, dtype=torch.int64, device=dev)  # (B,) last accepted node
    accept_len = torch.zeros(b, dtype=torch.int64, device=dev)  # (B,)
    accepted = torch.full((b, n), -1, dtype=torch.int64, device=dev)  # (B, N)
    accepted[:, :1] = 0
    for step in range(1, n):
        cand = match & (par == cur[:, None])  # (B, N) matching children of cur
        found = cand.any(dim=1)  # (B,); once False it stays False (cur no longer moves)
        if not bool(found.any()):
            break
        nxt = cand.to(torch.int8).argmax(dim=1)  # (B,) lowest matching index (argmax returns the first max)
        cur = torch.where(found, nxt, cur)
        accepted[:, step] = torch.where(found, nxt, -1)
        accept_len += found.long()
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

    ``parents``: (B, N) int, node 0 the root (parent -1), ``parents[b, i] < i``; nodes
    ``i >= num_nodes[b]`` (``num_nodes[b] >= 1``) are padding. ``draft_tokens``, ``target_argmax``:
    (B, N) int, ``target_argmax[b, v]`` the target's token after node ``v``. Returns
    ``accept_len`` (B,), ``accepted_nodes`` (B, N), ``bonus`` (B,), all int64::

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
