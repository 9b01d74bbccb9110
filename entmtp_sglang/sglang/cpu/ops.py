"""Pure-torch versions of the `sgl_kernel` CPU ops that SGLang 0.5.23 imports on its CPU path.

SGLang runs on CPU with `SGLANG_USE_CPU_ENGINE=1`. Six of its modules then import CPU ops from
`sgl_kernel` at module import time (five under `if _is_cpu:`, with `from sgl_kernel import NAME`; the
NGRAM one on every device but CUDA, ROCm and XPU, from the submodule `sgl_kernel.speculative`), but PyPI
only publishes a CUDA build of sgl-kernel, so on a CPU machine `import sgl_kernel` fails and those
SGLang modules cannot be imported at all:

    sglang/srt/mem_cache/allocation.py:46                  assign_req_to_token_pool_cpu
    sglang/kernels/ops/kvcache/cache_move.py:10            copy_all_layer_kv_cache_cpu
    sglang/kernels/ops/speculative/cache_locs.py:28        assign_draft_cache_locs_contiguous_cpu,
                                                           assign_extend_cache_locs_cpu
    sglang/kernels/ops/speculative/eagle.py:10             fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu
    sglang/kernels/ops/speculative/spec_tree.py:40         build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu
    sglang/kernels/ops/speculative/reconstruct_tree.py:50  reconstruct_indices_from_tree_mask
                                                           (from sgl_kernel.speculative; NGRAM only)

SGLang looks these nine up as attributes of Python modules (never through `torch.ops.sgl_kernel.*`);
`CPU_OPS` names the module and attribute of each, and `install_if_missing()` provides them there: on
stub modules (`sgl_kernel`, `sgl_kernel.speculative`) placed in `sys.modules` when no real sgl_kernel
imports, or added (only the missing names) to a real one that lacks them. It never replaces anything a
real sgl_kernel defines.

Signatures and in-place contracts follow sgl-kernel 0.4.10 (the version SGLang 0.5.23 pins), whose
C++ CPU ops live in `sgl-kernel/csrc/cpu/` (`reconstruct_indices_from_tree_mask` has no CPU build there:
it follows the CUDA kernel); each op's docstring gives its semantics as a pseudo-loop and names the
SGLang call site and the CUDA/Triton kernel it mirrors. Every op mutates its output
tensors in place and returns None, like the C++ ops. Integer inputs may be int32 or int64.

Parameter names are sgl-kernel's schema, misspelling included (`retrive_index`, ...): SGLang calls
`verify_tree_greedy_cpu` with keyword arguments under those names (spec_tree.py:510-521).
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import importlib.machinery
import logging
import os
import sys
import types

import torch

from ...kernels import tree_ancestor_mask, verify_tree_greedy

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_OPS",
    "CPU_OP_NAMES",
    "InstallOutcome",
    "TREE_MASK_FULL",
    "TREE_MASK_QLEN_ONLY",
    "TREE_MASK_QLEN_ONLY_BITPACKING",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "install_if_missing",
    "reconstruct_indices_from_tree_mask",
    "sglang_platform_plugin",
    "verify_tree_greedy_cpu",
]

# SGLang's TreeMaskMode (sglang/kernels/ops/speculative/spec_tree.py:46); SGLang passes the IntEnum.
TREE_MASK_FULL = 0
TREE_MASK_QLEN_ONLY = 1
TREE_MASK_QLEN_ONLY_BITPACKING = 2


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _as_long(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.long)


def _segments(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For per-row lengths `lens` (bs,), the flat layout of their concatenation.

    Returns (row, offset_in_row, out_start): for each of the sum(lens) flat positions, the row it
    belongs to and its offset within that row; out_start[i] is where row i starts (exclusive cumsum).
    """
    lens = _as_long(lens).clamp(min=0)
    out_start = torch.cumsum(lens, 0) - lens
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    offset = torch.arange(rows.numel(), device=lens.device) - out_start[rows]
    return rows, offset, out_start


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `t` that writes through (a 1-D tensor may be strided; others must be contiguous)."""
    return t if t.dim() == 1 else t.view(-1)


def _check_req_to_token(req_to_token: torch.Tensor, pool_len: int) -> None:
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token must be (max_num_reqs, pool_len={pool_len}), "
                         f"got {tuple(req_to_token.shape)}")


def _check_numel(name: str, t: torch.Tensor, expected: int, at_least: bool = False) -> None:
    ok = t.numel() >= expected if at_least else t.numel() == expected
    if not ok:
        rel = "at least " if at_least else ""
        raise ValueError(f"{name} has {t.numel()} elements, expected {rel}{expected}")


# ------------------------------------------------------------------------------------------------
# KV-slot bookkeeping
# ------------------------------------------------------------------------------------------------
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter freshly allocated KV slots into the request-to-token map (in place).

        prefix = 0
        for i in range(bs):
            n = end_offset[i] - start_offset[i]
            req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[prefix:prefix + n]
            prefix += n

    Called by `assign_req_to_token_pool_func` (sglang/srt/mem_cache/allocation.py:737-756), the CPU
    branch of the Triton kernel `assign_req_to_token_pool` (allocation.py:692).
    req_to_token: (max_num_reqs, pool_len) int32; out_cache_loc: int64 with >= sum(n) entries.
    """
    _check_req_to_token(req_to_token, pool_len)
    rows, offset, out_start = _segments(end_offset - start_offset)
    _check_numel("out_cache_loc", out_cache_loc, rows.numel(), at_least=True)
    if rows.numel() == 0:
        return
    req = _as_long(req_pool_indices)[rows]
    col = _as_long(start_offset)[rows] + offset
    req_to_token[req, col] = out_cache_loc.reshape(-1)[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's KV slots in [start_offset, end_offset) into a dense vector (in place).

        prefix = 0
        for i in range(bs):
            n = end_offset[i] - start_offset[i]
            out_cache_loc[prefix:prefix + n] = req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]
            prefix += n
        # entries of out_cache_loc past the total are left untouched

    Called by `assign_extend_cache_locs_func` and `fill_front_out_cache_loc_func`
    (sglang/kernels/ops/speculative/cache_locs.py:679-776), the CPU branch of the Triton kernel
    `assign_extend_cache_locs` (cache_locs.py:500). out_cache_loc: int64, may be larger than needed.
    """
    _check_req_to_token(req_to_token, pool_len)
    rows, offset, _ = _segments(end_offset - start_offset)
    _check_numel("out_cache_loc", out_cache_loc, rows.numel(), at_least=True)
    if rows.numel() == 0:
        return
    values = req_to_token[_as_long(req_pool_indices)[rows], _as_long(start_offset)[rows] + offset]
    _flat(out_cache_loc)[: rows.numel()] = values.to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Read back the draft KV slots the allocator reserved after each request's prefix (in place).

        w = topk * num_steps
        for i in range(bs):
            out_cache_loc[i * w:(i + 1) * w] = req_to_token[req_pool_indices[i], seq_lens[i]:seq_lens[i] + w]

    Called by `assign_draft_cache_locs_contiguous_func` (cache_locs.py:85-105; on CPU it never writes
    positions), the CPU branch of the Triton kernel `assign_draft_cache_locs_contiguous`
    (cache_locs.py:42). Contiguous layout: SGLang only takes this path for page_size == 1 or topk == 1.
    out_cache_loc: (bs * topk * num_steps,) int64.
    """
    _check_req_to_token(req_to_token, pool_len)
    bs = req_pool_indices.numel()
    width = topk * num_steps
    _check_numel("out_cache_loc", out_cache_loc, bs * width)
    if bs == 0 or width == 0:
        return
    cols = _as_long(seq_lens).view(-1, 1) + torch.arange(width, device=seq_lens.device)
    values = req_to_token[_as_long(req_pool_indices).view(-1, 1), cols]  # (bs, width)
    out_cache_loc.copy_(values.reshape(out_cache_loc.shape).to(out_cache_loc.dtype))


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Pick each request's last accepted token (the bonus token) (in place).

        for i in range(bs):
            bonus_tokens[i] = accept_tokens.flatten()[accept_stride * i + accept_lens[i] - 1]

    Called by `fill_bonus_tokens_func` (sglang/kernels/ops/speculative/eagle.py:32-52), the CPU branch
    of the Triton kernel `fill_bonus_tokens` (eagle.py:14). accept_tokens: (bs, accept_stride) int32
    with accept_stride = accept_index.shape[1]; accept_lens counts the bonus token.
    """
    bs = accept_lens.numel()
    _check_numel("accept_tokens", accept_tokens, bs * accept_stride)
    _check_numel("bonus_tokens", bonus_tokens, bs)
    if bs == 0:
        return
    idx = torch.arange(bs, device=accept_lens.device) * accept_stride + _as_long(accept_lens).view(-1) - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].view(bonus_tokens.shape).to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the accepted tokens' KV slots, skipping rejected (-1) entries (in place).

        dst = 0
        for src in accept_index.flatten():
            if src > -1:
                accept_out_cache_loc[dst] = out_cache_loc[src]
                dst += 1
        # entries of accept_out_cache_loc from dst on are left untouched

    Called by `fill_accept_out_cache_loc_func` (eagle.py:73-91; note: three arguments, no `size`), the
    CPU branch of the Triton kernel `fill_accept_out_cache_loc` (eagle.py:56), which computes each
    dst as the number of earlier entries != -1. accept_index: (bs, spec_steps + 1) int32, flat order.
    """
    flat = _as_long(accept_index.reshape(-1))
    src = flat[flat > -1]
    _check_numel("accept_out_cache_loc", accept_out_cache_loc, src.numel(), at_least=True)
    if src.numel() == 0:
        return
    locs = out_cache_loc.reshape(-1)
    if int(src.max()) >= locs.numel():
        raise IndexError(f"accept_index entry {int(src.max())} is out of range for out_cache_loc "
                         f"of {locs.numel()} entries")
    _flat(accept_out_cache_loc)[: src.numel()] = locs[src].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV slot rows src_loc -> tgt_loc in every K/V buffer, given raw base addresses (in place).

        for b in range(len(data_ptrs)):
            rows = bytes at data_ptrs[b] viewed as (-1, strides[b])   # one row per KV slot
            staged = [rows[s] for s in src_loc]                       # gather first, so an
            for t, row in zip(tgt_loc, staged): rows[t] = row         # overlapping copy is safe

    Called by `copy_all_layer_kv_cache_func` (sglang/kernels/ops/kvcache/cache_move.py:181-197, with
    `tgt_loc[:num_locs], src_loc[:num_locs]`), the CPU branch of the Triton kernel
    `copy_all_layer_kv_cache_tiled` (cache_move.py:146), used by `MHATokenToKVPool.move_kv_cache`
    (sglang/srt/mem_cache/memory_pool.py:3423-3490) to move accepted draft KV into place after verify.
    data_ptrs: (num_buffers,) uint64 from `tensor.data_ptr()` of contiguous CPU buffers
    (memory_pool.py:2545-2565); strides: (num_buffers,) int64 bytes per slot row.

    The addresses are trusted exactly as the C++ and Triton kernels trust them; each buffer is viewed
    only up to the largest slot row touched.
    """
    if data_ptrs.numel() != strides.numel():
        raise ValueError(f"data_ptrs has {data_ptrs.numel()} entries but strides has {strides.numel()}")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries but src_loc has {src_loc.numel()}")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    if data_ptrs.device.type != "cpu":
        raise ValueError("copy_all_layer_kv_cache_cpu needs CPU buffers")
    tgt = _as_long(tgt_loc.reshape(-1)).cpu()
    src = _as_long(src_loc.reshape(-1)).cpu()
    if min(int(tgt.min()), int(src.min())) < 0:
        raise IndexError("copy_all_layer_kv_cache_cpu: negative slot index")
    # A row copied onto itself is already in place; every read happens before any write, so leaving such pairs
    # out changes nothing else. (After a one-token verify, and along an accepted first-child chain, they are all.)
    moved = tgt != src
    if not bool(moved.any()):
        return
    tgt, src = tgt[moved], src[moved]
    num_rows = max(int(tgt.max()), int(src.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)
        rows[tgt] = rows[src]  # advanced indexing gathers rows[src] into a new tensor first


# ------------------------------------------------------------------------------------------------
# EAGLE tree: build and greedy verify
# ------------------------------------------------------------------------------------------------
def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Turn EAGLE's top-scored draft candidates into the verify tree's buffers (in place).

    Node 0 of each request is the root (the bonus token); node i >= 1 is the candidate whose global
    score index is s = selected_index[b, i - 1] (sorted ascending by SGLang). Its parent is the root
    when s // topk == 0, else the node holding candidate parent_list[b, s // topk]:

        n = draft_token_num
        for b in range(bs):
            parent[0] = -1
            for i in 1..n-1:
                t = selected_index[b, i-1] // topk
                parent[i] = 0 if t == 0 else 1 + first j with selected_index[b, j] == parent_list[b, t]
                            (no such j: node i is "orphaned": linked nowhere, sees only itself and the root)
            retrive_index[b, i] = b * n + i                      for every i
            retrive_next_token[b, p] = smallest child of p, or -1
            retrive_next_sibling[b, i] = next larger child of parent[i], or -1
            row i of the mask: the root, i, and i's ancestors, walking up at most `depth` nodes
            positions[b * n + i] = verified_seq_len[b] + (nodes marked on that walk)   # depth of i

    Mask layouts (tree_mask is flat; SGLang pre-fills it with True):
      QLEN_ONLY (1): row i of request b is tree_mask[(b*n + i)*n : (b*n + i + 1)*n], all n cells written.
      FULL_MASK (0): request b's block starts at b*n*n + n*sum(verified_seq_len[:b]); row i is
        (verified_seq_len[b] + n) wide, and only its last n cells (the draft tokens) are written: the
        prefix cells keep the caller's fill (True).
      QLEN_ONLY_BITPACKING (2) is rejected, as by the C++ CPU op (no CPU producer uses it).

    Called by `build_tree_kernel_efficient_func` (sglang/kernels/ops/speculative/spec_tree.py:367-444)
    from `eagle_utils.build_tree_kernel_efficient` (sglang/srt/speculative/eagle_utils.py:138-234),
    which allocates retrive_* filled with -1 and positions (bs * n,). Mirrors the Triton kernel
    `sgl_build_tree_kernel_efficient_triton` (spec_tree.py:52-207) and the CUDA kernel
    `build_tree_efficient` (kernels/jit/include/sgl_kernel/speculative/eagle.cuh:35-124). A mask buffer
    larger than this batch needs (SGLang's preallocated `VerifyMask`) is accepted; only its head is
    written.
    """
    mode = int(tree_mask_mode)
    if mode not in (TREE_MASK_FULL, TREE_MASK_QLEN_ONLY):
        raise ValueError(f"build_tree_kernel_efficient_cpu supports FULL_MASK (0) and QLEN_ONLY (1), "
                         f"got {mode}")
    if topk < 1 or depth < 1 or draft_token_num < 1:
        raise ValueError(f"need topk, depth, draft_token_num >= 1, got {topk}, {depth}, {draft_token_num}")
    n = draft_token_num
    bs = verified_seq_len.numel()
    device = verified_seq_len.device
    for name, t in (("positions", positions), ("retrive_index", retrive_index),
                    ("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        _check_numel(name, t, bs * n)
    _check_numel("selected_index", selected_index, bs * (n - 1))
    if depth > 1 and (parent_list.dim() != 2 or parent_list.shape[1] != topk * (depth - 1) + 1):
        raise ValueError(f"parent_list must be (bs, topk * (depth - 1) + 1 = {topk * (depth - 1) + 1}), "
                         f"got {tuple(parent_list.shape)}")
    seq_len = _as_long(verified_seq_len.reshape(-1))
    if mode == TREE_MASK_QLEN_ONLY:
        _check_numel("tree_mask (QLEN_ONLY)", tree_mask, bs * n * n, at_least=True)
    else:
        _check_numel("tree_mask (FULL_MASK)", tree_mask, int(seq_len.sum()) * n + bs * n * n, at_least=True)
    if bs == 0:
        return

    node = torch.arange(n, device=device)
    parents = _node_parents(parent_list, selected_index, topk, bs, n)  # (bs, n): -1 root, -2 orphan

    # Linked lists: first child, next sibling (children in ascending node order).
    valid_child = parents >= 0  # (bs, n)
    is_child = (parents.unsqueeze(1) == node.view(1, n, 1)) & valid_child.unsqueeze(1)  # [b, p, i]
    next_token = _first_true(is_child)  # (bs, n)
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid_child.unsqueeze(2)  # [b, i, j]
    later = node.view(1, 1, n) > node.view(1, n, 1)
    next_sibling = _first_true(same_parent & later)

    # Ancestor mask and depths. The C++ and Triton kernels walk up from node i at most `depth` times and
    # stop after a child of the root or an orphan; an orphan sees the root and itself. SGLang's draft
    # numbers parents before children and is at most `depth` deep, so that bounded walk is the full
    # ancestor walk with each orphan hung under the root.
    if bool((parents >= node).any()):
        raise ValueError("build_tree_kernel_efficient_cpu: a draft node's parent comes after it (selected_index "
                         "must be sorted ascending, as SGLang sorts it)")
    anc, steps = tree_ancestor_mask(torch.where(parents == -2, 0, parents), torch.full((bs,), n, device=device))
    if bool((steps > depth).any()):
        raise ValueError(f"build_tree_kernel_efficient_cpu: the draft tree is deeper than depth={depth}")

    retrive_index.copy_((torch.arange(bs, device=device).view(bs, 1) * n + node).view(retrive_index.shape))
    retrive_next_token.copy_(next_token.view(retrive_next_token.shape))
    retrive_next_sibling.copy_(next_sibling.view(retrive_next_sibling.shape))
    positions.copy_((seq_len.view(bs, 1) + steps).view(positions.shape))

    cells = anc.reshape(-1).to(tree_mask.dtype)
    flat_mask = _flat(tree_mask)
    if mode == TREE_MASK_QLEN_ONLY:
        flat_mask[: bs * n * n] = cells
    else:
        block_start = torch.arange(bs, device=device) * n * n + n * (torch.cumsum(seq_len, 0) - seq_len)
        row_width = seq_len + n
        idx = (block_start.view(bs, 1, 1) + row_width.view(bs, 1, 1) * node.view(1, n, 1)
               + seq_len.view(bs, 1, 1) + node.view(1, 1, n))
        flat_mask[idx.reshape(-1)] = cells


def _node_parents(parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int, bs: int,
                  n: int) -> torch.Tensor:
    """(bs, n) parent node of every tree node: -1 for the root, -2 for an orphan (parent not selected)."""
    device = selected_index.device
    parents = torch.full((bs, n), -1, dtype=torch.long, device=device)
    if n == 1:
        return parents
    sel = _as_long(selected_index.reshape(bs, n - 1))
    parent_slot = sel // topk  # index into parent_list; 0 means "child of the root"
    width = parent_list.shape[1] if parent_list.dim() == 2 else 0
    in_range = parent_slot < width
    if width > 0:
        parent_candidate = _as_long(parent_list).gather(1, parent_slot.clamp(max=width - 1))
    else:  # depth 1: SGLang passes an empty (bs, 0) parent_list
        parent_candidate = torch.full_like(sel, -1)
    matches = sel.unsqueeze(1) == parent_candidate.unsqueeze(2)  # [b, i, j]: sel[b, j] == candidate of i
    found = matches.any(2) & in_range
    parent_node = torch.where(found, matches.to(torch.uint8).argmax(2) + 1, -2)
    parents[:, 1:] = torch.where(parent_slot == 0, 0, parent_node)
    return parents


def _first_true(x: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where there is none."""
    return torch.where(x.any(-1), x.to(torch.uint8).argmax(-1), -1)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: accept the longest root path whose draft tokens equal the target's argmax.

        for b in range(bs):
            last = retrive_index[b, 0]; accept_index[b, 0] = last; accepted = 0; cur = 0
            for j in 1..num_spec_step-1:
                cur = retrive_next_token[b, cur]                # first child
                while cur != -1:
                    if candidates[b, cur] == target_predict.flat[last]:
                        predicts[last] = target_predict.flat[last]
                        accepted += 1; accept_index[b, accepted] = retrive_index[b, cur]
                        last = retrive_index[b, cur]; break
                    cur = retrive_next_sibling[b, cur]          # try the next sibling
                if cur == -1: break
            accept_token_num[b] = accepted                      # drafts accepted, bonus excluded
            predicts[last] = target_predict.flat[last]          # the bonus token

    In place: predicts (bs * n,) int32, accept_index (bs, num_spec_step) int32 (the caller fills it with
    -1; only accepted slots are written), accept_token_num (bs,) int32. candidates, retrive_* and
    target_predict: (bs, n). Called with keyword arguments by `verify_tree_greedy_func`
    (sglang/kernels/ops/speculative/spec_tree.py:480-521) from `eagle_utils.eagle_sample`
    (sglang/srt/speculative/eagle_utils.py:641-652), which on CPU always takes this greedy path.
    Mirrors the Triton kernel `verify_tree_greedy_kernel_triton` (spec_tree.py:210-315) and the CUDA
    kernel `VerifyTreeGreedy` (kernels/jit/include/sgl_kernel/speculative/eagle.cuh:214-256).
    The walk itself is `entmtp_sglang.kernels.verify_tree_greedy`, run on the parent array read off the
    linked lists (see `_parents_from_links`) and cut to num_spec_step - 1 accepted drafts.
    """
    bs, n = candidates.shape
    num_spec_step = accept_index.shape[1]
    _check_numel("predicts", predicts, bs * n)
    _check_numel("accept_token_num", accept_token_num, bs)
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling), ("target_predict", target_predict)):
        _check_numel(name, t, bs * n)
    if bs == 0:
        return
    device = candidates.device
    ridx = _as_long(retrive_index.reshape(bs, n))
    target = target_predict.reshape(-1)
    if n == 1:   # one node per request (a step without drafts): the root is accepted and its prediction is the bonus
        path = ridx[:, 0]
        _flat(predicts)[path] = target[path].to(predicts.dtype)
        accept_index[:, 0] = path.to(accept_index.dtype)
        accept_token_num.zero_()
        return
    node = torch.arange(n, device=device)
    parents = _parents_from_links(_as_long(retrive_next_token.reshape(bs, n)),
                                  _as_long(retrive_next_sibling.reshape(bs, n)))
    target_at = target[ridx.clamp(0, target.numel() - 1)]  # (bs, n): the target's token after each node
    accept_len, nodes, _ = verify_tree_greedy(parents, torch.full((bs,), n, device=device), candidates, target_at)
    accept_len = accept_len.clamp(max=num_spec_step - 1)
    rows, cols = ((node <= accept_len[:, None]) & (nodes >= 0)).nonzero(as_tuple=True)  # the accepted paths
    path = ridx[rows, nodes[rows, cols]]  # flat index of each accepted node, the root included
    _flat(predicts)[path] = target[path].to(predicts.dtype)
    accept_index[rows, cols] = path.to(accept_index.dtype)
    accept_token_num.copy_(accept_len.view(accept_token_num.shape).to(accept_token_num.dtype))


def _parents_from_links(first_child: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """(bs, n) parent array of the trees the linked lists describe, for `verify_tree_greedy`.

    A node that no list reaches is its own parent, so verification never accepts it. The verifier
    takes the lowest-numbered matching child, the linked-list walk the first matching one in list
    order: the same node when siblings are listed in ascending order, as both SGLang's kernels and
    `build_tree_kernel_efficient_cpu` list them; other orders are rejected.
    """
    bs, n = first_child.shape
    node = torch.arange(n, device=first_child.device).expand(bs, n)
    if bool(((next_sibling >= 0) & (next_sibling <= node)).any()):
        raise ValueError("verify_tree_greedy_cpu: retrive_next_sibling must list siblings in ascending node order")
    parents = node.clone()
    link = first_child  # (bs, n): the k-th child of every node, k = 0, 1, ... (-1: none)
    for _ in range(n):
        linked = (link >= 0) & (link < n)
        if not bool(linked.any()):
            break
        b, p = linked.nonzero(as_tuple=True)
        parents[b, link[b, p]] = p
        link = torch.where(linked, next_sibling.gather(1, link.clamp(0, n - 1)), -1)
    parents[:, 0] = -1
    return parents


# ------------------------------------------------------------------------------------------------
# NGRAM tree: verify buffers from the tree mask
# ------------------------------------------------------------------------------------------------
def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Read NGRAM's draft tree off its mask: positions and the retrieve links (in place).

    tree_mask is flat, row-major, QLEN_ONLY: mask[b, i, j] = tree_mask[(b*n + i)*n + j] marks node j
    visible to node i (n = draft_token_num). Only the strict lower triangle (j < i) is read:

        for b in range(batch_size):
            for i in range(n):
                seen = [j for j in range(i) if mask[b, i, j]]          # i's ancestors
                parent[i] = max(seen) if seen else -1
                positions[b*n + i] = verified_seq_len[b] + len(seen)    # depth + prefix length
                retrive_index[b, i] = b*n + i
                retrive_next_token[b, i] = min(k > i with mask[b, k, i], else -1)          # first child
            for i in range(n):
                retrive_next_sibling[b, i] = -1 if parent[i] == -1 else \
                    min(k > i with parent[k] == parent[i], else -1)                        # next sibling

    On an ancestor-closed mask (NGRAM's: each row holds the node, its ancestors and nothing else) the
    first later node that sees i is i's first child; on any other mask the loops above still say what
    is written. Node 0 (the root) and nodes that see no earlier node get parent -1, hence no sibling.

    Called positionally by `reconstruct_indices_from_tree_mask_func`
    (sglang/kernels/ops/speculative/reconstruct_tree.py:163-194) from
    `NGRAMWorker._prepare_for_speculative_decoding` (sglang/srt/speculative/ngram_worker.py:342-351), with
    the bool mask of `NgramCorpus.batch_get` (bs * n * n), `batch.seq_lens` and slices of preallocated
    int64 buffers: positions (bs * n,), retrive_* (bs, n). Mirrors the CUDA kernel
    `reconstructIndicesFromTreeMask` (kernels/jit/include/sgl_kernel/speculative/ngram.cuh), whose
    sibling test "mask[k, parent] and nothing between parent and k" is parent[k] == parent[i], and the
    Triton kernel `_reconstruct_tree_mask_kernel` (reconstruct_tree.py:56-114). sgl-kernel has no CPU
    build of it. A mask buffer larger than the batch needs is accepted; only its head is read.
    """
    if draft_token_num < 1 or batch_size < 0:
        raise ValueError(f"need draft_token_num >= 1 and batch_size >= 0, got {draft_token_num}, {batch_size}")
    bs, n = batch_size, draft_token_num
    _check_numel("tree_mask", tree_mask, bs * n * n, at_least=True)
    _check_numel("verified_seq_len", verified_seq_len, bs)
    for name, t in (("positions", positions), ("retrive_index", retrive_index),
                    ("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        _check_numel(name, t, bs * n)
    if bs == 0:
        return
    device = verified_seq_len.device
    node = torch.arange(n, device=device)
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).bool()       # [b, i, j]: j visible to i
    seen = mask & (node.view(1, n) < node.view(n, 1))                       # strict lower triangle
    parent = torch.where(seen, node, -1).amax(-1)                           # (bs, n), -1: none
    next_token = _first_true(seen.transpose(1, 2))                          # [b, i, k]: k sees i
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent >= 0).unsqueeze(2)  # [b, i, k]
    next_sibling = _first_true(same_parent & (node.view(1, n) > node.view(n, 1)))

    positions.copy_((_as_long(verified_seq_len.reshape(bs, 1)) + seen.sum(-1)).reshape(positions.shape))
    retrive_index.copy_((torch.arange(bs, device=device).view(bs, 1) * n + node).reshape(retrive_index.shape))
    retrive_next_token.copy_(next_token.reshape(retrive_next_token.shape))
    retrive_next_sibling.copy_(next_sibling.reshape(retrive_next_sibling.shape))


# ------------------------------------------------------------------------------------------------
# Exposing the ops where SGLang looks them up
# ------------------------------------------------------------------------------------------------
# Where SGLang 0.5.23's CPU path looks each op up: (module, attribute); the attribute is this module's function
# of the same name. Modules other than `sgl_kernel` are its submodules, imported as `from sgl_kernel.X import`.
CPU_OPS: tuple[tuple[str, str], ...] = (
    ("sgl_kernel", "copy_all_layer_kv_cache_cpu"),
    ("sgl_kernel", "assign_req_to_token_pool_cpu"),
    ("sgl_kernel", "assign_draft_cache_locs_contiguous_cpu"),
    ("sgl_kernel", "assign_extend_cache_locs_cpu"),
    ("sgl_kernel", "fill_bonus_tokens_cpu"),
    ("sgl_kernel", "fill_accept_out_cache_loc_cpu"),
    ("sgl_kernel", "build_tree_kernel_efficient_cpu"),
    ("sgl_kernel", "verify_tree_greedy_cpu"),
    ("sgl_kernel.speculative", "reconstruct_indices_from_tree_mask"),
)
CPU_OP_NAMES: tuple[str, ...] = tuple(name for _, name in CPU_OPS)
# The modules that hold them, parents before submodules.
_OP_MODULES: tuple[str, ...] = tuple(sorted(dict.fromkeys(module for module, _ in CPU_OPS), key=lambda m: m.count(".")))

_STUB_MARKER = "__entmtp_sglang_stub__"


class InstallOutcome(enum.Enum):
    """What `install_if_missing` did."""

    SKIPPED = "skipped"  # SGLang's CPU engine is not selected (SGLANG_USE_CPU_ENGINE != 1)
    REAL_COMPLETE = "real_complete"  # a real sgl_kernel imports and has every op of CPU_OPS: nothing done
    ADDED_TO_REAL = "added_to_real"  # a real sgl_kernel imports but lacked some: only those were added
    STUB_INSTALLED = "stub_installed"  # no importable sgl_kernel: stub modules now sit in sys.modules
    STUB_PRESENT = "stub_present"  # our stub was already installed


def _ops_in(module_name: str) -> tuple[str, ...]:
    return tuple(name for module, name in CPU_OPS if module == module_name)


def _make_stub(module_name: str) -> types.ModuleType:
    names = _ops_in(module_name)
    stub = types.ModuleType(module_name, f"entmtp-sglang stand-in for a CPU build of {module_name}: only the "
                                         f"CPU ops SGLang's CPU path imports from it.")
    # A spec keeps importlib.util.find_spec(module_name) from raising on a module without one.
    stub.__spec__ = importlib.machinery.ModuleSpec(module_name, loader=None, origin=__name__)
    setattr(stub, _STUB_MARKER, True)
    this = sys.modules[__name__]
    for name in names:
        setattr(stub, name, getattr(this, name))

    def __getattr__(name: str):
        raise AttributeError(f"{module_name} (the entmtp-sglang CPU stub) has no {name!r}: no CPU build of "
                             f"sgl_kernel is installed, and the stub provides only {', '.join(names)}")

    stub.__getattr__ = __getattr__
    stub.__all__ = list(names)
    return stub


def _put_stub(module_name: str) -> types.ModuleType:
    """Our stub as `sys.modules[module_name]`, and as the attribute of its parent module for a submodule."""
    stub = sys.modules[module_name] = _make_stub(module_name)
    parent, _, leaf = module_name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, stub)
    return stub


def install_if_missing(*, only_for_cpu_engine: bool = True) -> InstallOutcome:
    """Make `from sgl_kernel[.X] import <op>` work for every op of CPU_OPS, never shadowing a real sgl_kernel.

    1. Unless `only_for_cpu_engine` is False, do nothing when SGLANG_USE_CPU_ENGINE != "1": only
       SGLang's CPU path imports these ops, and a stub `sgl_kernel` would turn GPU-path
       `import sgl_kernel` failures into later AttributeErrors.
    2. If `sys.modules["sgl_kernel"]` is already our stub: nothing to do.
    3. Try `import sgl_kernel`. If it imports, import each submodule of CPU_OPS too and set only the
       names each lacks (a CUDA build has none of the `*_cpu` ops; an older CPU build may lack some);
       existing attributes are never touched. A submodule that does not import gets our stub for it.
    4. If the import fails (not installed, or a CUDA build failing with `No module named
       'common_ops'`), put stub modules in sys.modules: `sgl_kernel` and each submodule of CPU_OPS
       (also set as an attribute of `sgl_kernel`), each holding exactly its ops; any other attribute
       raises AttributeError, so `from sgl_kernel import other` still raises ImportError as before.

    Must run before SGLang imports the modules listed in this file's docstring, in every process
    (SGLang spawns its scheduler processes): see docs/sglang.md ("Installing the CPU ops").
    """
    if only_for_cpu_engine and os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return InstallOutcome.SKIPPED
    current = sys.modules.get("sgl_kernel")
    if current is not None and getattr(current, _STUB_MARKER, False):
        return InstallOutcome.STUB_PRESENT
    # not a patches.py entry: provides a missing optional module (or its missing names), replaces nothing SGLang has
    try:
        importlib.import_module("sgl_kernel")
    except Exception as exc:  # ImportError, or OSError/RuntimeError from loading a CUDA build
        for module_name in _OP_MODULES:
            _put_stub(module_name)
        logger.info("sgl_kernel does not import (%s: %s); installed the entmtp-sglang CPU stubs %s with %s",
                    type(exc).__name__, exc, ", ".join(_OP_MODULES), ", ".join(CPU_OP_NAMES))
        return InstallOutcome.STUB_INSTALLED
    added = []
    this = sys.modules[__name__]
    for module_name in _OP_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a submodule this sgl_kernel does not have (or cannot import)
            _put_stub(module_name)
            added += [f"{module_name}.{name}" for name in _ops_in(module_name)]
            continue
        for name in _ops_in(module_name):
            if not hasattr(module, name):
                setattr(module, name, getattr(this, name))
                added.append(f"{module_name}.{name}")
    if not added:
        return InstallOutcome.REAL_COMPLETE
    logger.info("sgl_kernel lacks %s; added the entmtp-sglang torch versions", ", ".join(added))
    return InstallOutcome.ADDED_TO_REAL


def sglang_platform_plugin() -> None:
    """Entry point for SGLang's `sglang.srt.platforms` group: installs the CPU ops, activates nothing.

    SGLang calls every platform plugin when `sglang.srt.platforms.current_platform` is first read,
    which `sglang/srt/utils/common.py:102` does at import time in every process, before any module
    that imports the CPU ops. Returning None means "no platform here", so SGLang still picks its own
    CPU platform (sglang/srt/platforms/__init__.py:140-158). See docs/sglang.md.
    """
    install_if_missing()
    return None
