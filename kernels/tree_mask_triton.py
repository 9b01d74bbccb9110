"""Triton kernel for :func:`tree_ancestor_mask` (imported lazily: needs triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import check_tree_args, device_of


@triton.jit
def _tree_ancestor_mask_kernel(
    parents_ptr,  # (B, N) int, strides (stride_pb, stride_pn)
    num_nodes_ptr,  # (B,) int
    mask_ptr,  # (B, N, N) uint8, contiguous
    depths_ptr,  # (B, N) int64, contiguous
    N,
    stride_pb,
    stride_pn,
    BLOCK_N: tl.constexpr,
):
    # One program per (tree b, node i): walk i's ancestor chain up to the root, marking each node.
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    row = offs == i  # (BLOCK_N,) bool, self
    j = tl.where(i < n, i, 0)  # padding rows do not walk
    depth = i * 0
    while (j > 0) & (depth < N):  # depth bound only guards against malformed (cyclic) input
        j = tl.load(parents_ptr + b * stride_pb + j * stride_pn).to(tl.int32)
        row = row | (offs == j)
        depth += 1
    out = (b * N + i) * N
    tl.store(mask_ptr + out + offs, row.to(tl.uint8), mask=offs < N)
    tl.store(depths_ptr + b * N + i, depth.to(tl.int64))


def tree_ancestor_mask_triton(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backend of :func:`tree_ancestor_mask`."""
    check_tree_args(parents, num_nodes)
    b, n = parents.shape
    mask = torch.empty(b, n, n, dtype=torch.uint8, device=parents.device)  # (B, N, N)
    depths = torch.empty(b, n, dtype=torch.int64, device=parents.device)  # (B, N)
    if b * n == 0:
        return mask.view(torch.bool), depths
    with device_of(parents):
        _tree_ancestor_mask_kernel[(b, n)](
            parents, num_nodes.contiguous(), mask, depths, n, parents.stride(0), parents.stride(1),
            BLOCK_N=triton.next_power_of_2(n),
        )
    return mask.view(torch.bool), depths
