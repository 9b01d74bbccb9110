"""Ancestor (tree-attention) mask and node depths of batched parent-array trees: dispatcher and torch reference."""

from __future__ import annotations

import torch

from ._backend import Backend, check_tree_args, resolve_backend


def tree_ancestor_mask_torch(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`tree_ancestor_mask` (same semantics)."""
    check_tree_args(parents, num_nodes)
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)  # (N,)
    valid = idx[None, :] < num_nodes[:, None]  # (B, N)
    par = torch.where(valid, parents.long(), 0).clamp(min=0)  # (B, N); root and padding -> 0 (unused)
    mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(b, 1, 1)  # (B, N, N)
    depths = torch.zeros(b, n, dtype=torch.int64, device=dev)  # (B, N)
    rows = torch.arange(b, device=dev)  # (B,)
    for i in range(1, n):  # parents[i] < i: the parent's row is final before row i is built
        p = par[:, i]  # (B,)
        ok = valid[:, i]  # (B,)
        mask[:, i] |= mask[rows, p] & ok[:, None]
        depths[:, i] = torch.where(ok, depths[rows, p] + 1, 0)
    return mask, depths


def tree_ancestor_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask and depth of every node of B padded parent-array trees.

    ``parents``: (B, N) int, node 0 the root (parent -1), ``parents[b, i] < i``; nodes
    ``i >= num_nodes[b]`` are padding. Returns ``mask`` (B, N, N) bool and ``depths`` (B, N) int64::

        for b, i:
            mask[b, i, :] = False; mask[b, i, i] = True; depths[b, i] = 0
            if i < num_nodes[b]:
                j = i
                while j > 0:                      # walk up to the root
                    j = parents[b, j]
                    mask[b, i, j] = True
                    depths[b, i] += 1

    ``backend``: "torch", "triton" (CUDA, or any device under TRITON_INTERPRET=1), or "auto".
    """
    if resolve_backend(backend, parents) == "triton":
        from .tree_mask_triton import tree_ancestor_mask_triton

        return tree_ancestor_mask_triton(parents, num_nodes)
    return tree_ancestor_mask_torch(parents, num_nodes)
