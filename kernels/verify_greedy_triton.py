"""Triton kernel for :func:`verify_tree_greedy` (imported lazily: needs triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import check_verify_args, device_of


@triton.jit
def _verify_tree_greedy_kernel(
    parents_ptr,  # (B, N) int, strides (stride_pb, stride_pn)
    num_nodes_ptr,  # (B,) int
    draft_ptr,  # (B, N) int, strides (stride_db, stride_dn)
    target_ptr,  # (B, N) int, strides (stride_tb, stride_tn)
    accept_len_ptr,  # (B,) int64
    accepted_ptr,  # (B, N) int64, contiguous
    bonus_ptr,  # (B,) int64
    N,
    stride_pb,
    stride_pn,
    stride_db,
    stride_dn,
    stride_tb,
    stride_tn,
    BLOCK_N: tl.constexpr,
):
    # One program per tree: the whole tree sits in registers; descend from the root one level per step.
    pid = tl.program_id(0)
    b = pid.to(tl.int64)
    offs = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n = tl.minimum(tl.load(num_nodes_ptr + b).to(tl.int32), N)
    valid = offs < n  # (BLOCK_N,)
    par = tl.load(parents_ptr + b * stride_pb + offs * stride_pn, mask=valid, other=0).to(tl.int32)
    par = tl.maximum(par, 0)  # root: -1 -> 0 (excluded below)
    draft = tl.load(draft_ptr + b * stride_db + offs * stride_dn, mask=valid, other=0).to(tl.int64)
    wanted = tl.load(target_ptr + b * stride_tb + par * stride_tn, mask=valid, other=0).to(tl.int64)
    match = valid & (offs >= 1) & (draft == wanted)  # (BLOCK_N,)
    cur = pid * 0  # last accepted node
    length = pid * 0
    path = tl.where(offs == 0, 0, -1)  # (BLOCK_N,)
    for step in range(1, n):
        cand = match & (par == cur)  # matching children of cur
        nxt = tl.min(tl.where(cand, offs, BLOCK_N), axis=0)  # lowest index, BLOCK_N if none
        found = nxt < BLOCK_N  # once False it stays False: cur no longer moves
        cur = tl.where(found, nxt, cur)
        length += found.to(tl.int32)
        path = tl.where((offs == step) & found, nxt, path)
    tl.store(accepted_ptr + b * N + offs, path.to(tl.int64), mask=offs < N)
    tl.store(accept_len_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, tl.load(target_ptr + b * stride_tb + cur * stride_tn).to(tl.int64))


def verify_tree_greedy_triton(
    parents: torch.Tensor, num_nodes: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backend of :func:`verify_tree_greedy`."""
    check_verify_args(parents, num_nodes, draft_tokens, target_argmax)
    b, n = parents.shape
    dev = parents.device
    accept_len = torch.empty(b, dtype=torch.int64, device=dev)  # (B,)
    accepted = torch.empty(b, n, dtype=torch.int64, device=dev)  # (B, N)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)  # (B,)
    if b == 0:
        return accept_len, accepted, bonus
    with device_of(parents):
        _verify_tree_greedy_kernel[(b,)](
            parents, num_nodes.contiguous(), draft_tokens, target_argmax, accept_len, accepted, bonus, n,
            parents.stride(0), parents.stride(1), draft_tokens.stride(0), draft_tokens.stride(1),
            target_argmax.stride(0), target_argmax.stride(1),
            BLOCK_N=triton.next_power_of_2(n),
        )
    return accept_len, accepted, bonus
