"""Ancestor (tree-attention) mask and node depths of batched parent-array trees: dispatcher and torch reference."""

from __future__ import annotations

import torch

from ._backend import Backend, check_tree_args, resolve_backend


def tree_ancestor_mask_torch(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`tree_ancestor_mask` (same semantics)."""
    check_tree_args(parents, num_nodes)
    b, n = parents.shape
    dev = parents.device
    node = torch.arange(n, device=dev).expand(b, n)  # (B, N)
    valid = node < num_nodes[:, None]  # (B, N)
    par = torch.where(valid, parents.long(), 0).clamp(min=0)  # (B, N); root and padding -> 0
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=dev)  # (B, N, N)
    cur = torch.where(valid, node, 0)  # (B, N) every node walks up to the root, all one step at a time
    for _ in range(n - 1):  # max-depth steps; the bound only guards against malformed (cyclic) input
        if not bool(cur.any()):
            break
        cur = par.gather(1, cur)
        mask.scatter_(2, cur.unsqueeze(2), True)  # padding rows get the root too: cleared below
    mask &= valid[:, :, None]
    mask |= torch.eye(n, dtype=torch.bool, device=dev)
    depths = mask.sum(2) - 1  # (B, N) int64: ancestors, self excluded
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
