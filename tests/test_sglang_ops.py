"""The pure-torch sgl_kernel CPU ops (entmtp_sglang.sglang.cpu.ops), tested without SGLang installed.

The two tree ops are compared with straightforward Python transcriptions of SGLang 0.5.23's Triton
kernels (`sglang/kernels/ops/speculative/spec_tree.py`: `sgl_build_tree_kernel_efficient_triton`,
`verify_tree_greedy_kernel_triton`), on hand-drawn trees and on random trees produced by replaying
SGLang's EAGLE draft bookkeeping (`select_top_k_tokens` + `organize_draft_results`) with random
probabilities. NGRAM's `reconstruct_indices_from_tree_mask` is compared with a transcription of SGLang's
CUDA kernel (`sglang/kernels/jit/include/sgl_kernel/speculative/ngram.cuh`) on hand-drawn and random trees
and on random masks. The index ops are checked against hand-computed values. Where SGLang is installed,
its CPU path's `from sgl_kernel... import` lines are read (not run) and checked against `CPU_OPS`.

Set ENTMTP_SGLANG_SPEC_TREE=/path/to/sglang/kernels/ops/speculative/spec_tree.py and run with
`-m slow` to also compare against SGLang's own Triton kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
import types

import pytest
import torch

from entmtp_sglang.sglang.cpu import ops as cpu_ops
from entmtp_sglang.sglang.cpu.ops import (
    CPU_OP_NAMES,
    CPU_OPS,
    TREE_MASK_FULL,
    TREE_MASK_QLEN_ONLY,
    InstallOutcome,
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    install_if_missing,
    reconstruct_indices_from_tree_mask,
    sglang_platform_plugin,
    verify_tree_greedy_cpu,
)
from entmtp_sglang.tree import Tree, build_buffers

MODES = (TREE_MASK_FULL, TREE_MASK_QLEN_ONLY)


# ------------------------------------------------------------------------------------------------
# References: line-by-line Python transcriptions of SGLang's Triton kernels
# ------------------------------------------------------------------------------------------------
def ref_build_tree(parent_list, selected_index, seq_lens, topk, depth, n, mode, mask):
    """spec_tree.py:52-207, one program per request; `mask` is a flat Python list, edited in place."""
    bs = len(seq_lens)
    positions = [0] * (bs * n)
    r_index = [[-1] * n for _ in range(bs)]
    r_next = [[-1] * n for _ in range(bs)]
    r_sib = [[-1] * n for _ in range(bs)]
    seq_len_prefix_sum = 0
    for b in range(bs):
        sel, par, seq_len = selected_index[b], parent_list[b], seq_lens[b]
        seq_tree_idx = n * n * b + seq_len_prefix_sum * n
        positions[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            r_index[b][i] = b * n + i
            parent_tb_idx = sel[i - 1] // topk
            parent_position, found = 0, parent_tb_idx == 0
            if not found:
                parent_token_idx = par[parent_tb_idx]
                for pp in range(n - 1):
                    if sel[pp] == parent_token_idx:
                        parent_position, found = pp + 1, True
                        break
            if found:
                if r_next[b][parent_position] != -1:
                    r_sib[b][i] = r_next[b][parent_position]
                r_next[b][parent_position] = i
        r_index[b][0] = b * n
        for t in range(n):
            if mode == TREE_MASK_FULL:
                token_tree_idx = seq_tree_idx + (seq_len + n) * t + seq_len + 1
            else:
                token_tree_idx = n * n * b + n * t + 1
            mask[token_tree_idx - 1] = True
            for i in range(n - 1):
                mask[token_tree_idx + i] = False
            if t > 0:
                cur, position = t - 1, 0
                for _ in range(depth):
                    position += 1
                    mask[token_tree_idx + cur] = True
                    parent_tb_idx = sel[cur] // topk
                    if parent_tb_idx == 0:
                        break
                    parent_token_idx = par[parent_tb_idx]
                    found = False
                    for cp in range(n - 1):
                        if sel[cp] == parent_token_idx:
                            cur, found = cp, True
                            break
                    if not found:
                        break
                positions[b * n + t] = position + seq_len
        seq_len_prefix_sum += seq_len
    return positions, r_index, r_next, r_sib


def ref_verify_greedy(candidates, r_index, r_next, r_sib, target_predict, num_spec_step):
    """spec_tree.py:210-315, one program per request; returns (predicts, accept_index, accept_token_num)."""
    bs, n = len(candidates), len(candidates[0])
    target = [t for row in target_predict for t in row]
    predicts = [0] * (bs * n)
    accept_index = [[-1] * num_spec_step for _ in range(bs)]
    accept_token_num = [0] * bs
    for bx in range(bs):
        last = r_index[bx][0]
        accept_index[bx][0] = last
        num_accept, cur, should_continue = 0, 0, True
        for _ in range(1, num_spec_step):
            if not should_continue:
                break
            cur = r_next[bx][cur]
            target_token = target[last]
            found_match = 0
            for _ in range(n):
                if found_match != 0:
                    break
                is_valid = cur != -1
                safe = cur if is_valid else 0
                draft_index, draft_token = r_index[bx][safe], candidates[bx][safe]
                if is_valid and draft_token == target_token:
                    predicts[last] = target_token
                    num_accept += 1
                    accept_index[bx][num_accept] = draft_index
                    last = draft_index
                    found_match = 1
                elif not is_valid:
                    found_match = -1
                else:
                    cur = r_sib[bx][safe]
            if found_match != 1:
                should_continue = False
        accept_token_num[bx] = num_accept
        predicts[last] = target[last]
    return predicts, accept_index, accept_token_num


def ref_reconstruct(mask, seq_lens, bs, n):
    """ngram.cuh `reconstructIndicesFromTreeMask`, one thread per (request bid, node tid); `mask` a flat list.

    Returns (positions, retrive_index, retrive_next_token, retrive_next_sibling) as nested lists.
    """
    positions = [0] * (bs * n)
    r_index = [[0] * n for _ in range(bs)]
    r_next = [[0] * n for _ in range(bs)]
    r_sib = [[0] * n for _ in range(bs)]
    for bid in range(bs):
        token_idx, tree_mask_offset = bid * n, bid * n * n
        for tid in range(n):
            depth, parent_idx = 0, -1
            start_idx = tree_mask_offset + tid * n
            for i in range(tid - 1, -1, -1):
                if mask[start_idx + i]:
                    depth += 1
                    if parent_idx == -1:
                        parent_idx = i
            r_index[bid][tid] = token_idx + tid
            positions[token_idx + tid] = depth + seq_lens[bid]
            next_token_idx = -1
            for i in range(tid + 1, n):
                if mask[tree_mask_offset + i * n + tid]:
                    next_token_idx = i
                    break
            r_next[bid][tid] = next_token_idx
            next_sibling_idx = -1
            if parent_idx != -1:
                for i in range(tid + 1, n):
                    start = tree_mask_offset + i * n + parent_idx
                    if mask[start]:
                        is_sibling = True
                        for j in range(start + 1, tree_mask_offset + i * n + i):
                            if mask[j]:
                                is_sibling = False
                                break
                        if is_sibling:
                            next_sibling_idx = i
                            break
            r_sib[bid][tid] = next_sibling_idx
    return positions, r_index, r_next, r_sib


def simulate_eagle_draft(bs, topk, num_steps, num_draft_tokens, gen):
    """(parent_list, selected_index) exactly as SGLang's EAGLE draft builds them, from random probs.

    Replays sglang/srt/speculative/spec_utils.py `_select_top_k_tokens_first/_later` and
    eagle_utils.py `organize_draft_results`: candidate scores are cumulative products, each step
    expands the `topk` best candidates, and the `num_draft_tokens - 1` best of all are kept, sorted.
    """
    p0 = torch.rand(bs, topk, generator=gen).sort(dim=1, descending=True).values
    score_list = [p0.unsqueeze(1)]
    parents_list = [torch.arange(-1, topk).expand(bs, -1)]
    scores = p0
    for i in range(1, num_steps):
        p = torch.rand(bs * topk, topk, generator=gen).sort(dim=1, descending=True).values
        expand = scores.unsqueeze(2) * p.view(bs, topk, topk)
        scores, cs_index = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        parents_list.append(cs_index + (topk * topk * (i - 1) + topk))
    flat = torch.cat(score_list, dim=1).flatten(1)
    selected = torch.sort(torch.topk(flat, num_draft_tokens - 1, dim=-1).indices).values
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(bs, 0, dtype=torch.long)
    return parent_list.contiguous(), selected.contiguous()


def mask_numel(mode, seq_lens, n):
    bs = len(seq_lens)
    return bs * n * n if mode == TREE_MASK_QLEN_ONLY else sum(seq_lens) * n + bs * n * n


def run_build(parent_list, selected_index, seq_lens, topk, depth, n, mode):
    """Call the op the way eagle_utils.build_tree_kernel_efficient does (True-filled mask, -1 links)."""
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)
    bs = len(seq_lens)
    tree_mask = torch.full((mask_numel(mode, seq_lens, n),), True, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.long)
    retrieve_buf = torch.full((3, bs, n), -1, dtype=torch.long)
    build_tree_kernel_efficient_cpu(parent_list, selected_index, seq_lens_t, tree_mask, positions,
                                    retrieve_buf[0], retrieve_buf[1], retrieve_buf[2], topk, depth, n, mode)
    return tree_mask, positions, retrieve_buf


def assert_build_matches_reference(parent_list, selected_index, seq_lens, topk, depth, n, mode):
    tree_mask, positions, retrieve_buf = run_build(parent_list, selected_index, seq_lens, topk, depth, n, mode)
    ref_mask = [True] * mask_numel(mode, seq_lens, n)
    ref = ref_build_tree(parent_list.tolist(), selected_index.tolist(), seq_lens, topk, depth, n, mode,
                         ref_mask)
    assert tree_mask.tolist() == ref_mask
    assert positions.tolist() == ref[0]
    assert retrieve_buf[0].tolist() == ref[1]
    assert retrieve_buf[1].tolist() == ref[2]
    assert retrieve_buf[2].tolist() == ref[3]
    return tree_mask, positions, retrieve_buf


def run_verify(candidates, retrieve_buf, target_predict, num_spec_step):
    """Call the op with keyword arguments, exactly as spec_tree.verify_tree_greedy_func does on CPU."""
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32)
    accept_token_num = torch.empty(bs, dtype=torch.int32)
    verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrive_index=retrieve_buf[0],
        retrive_next_token=retrieve_buf[1],
        retrive_next_sibling=retrieve_buf[2],
        target_predict=target_predict,
    )
    return predicts, accept_index, accept_token_num


# ------------------------------------------------------------------------------------------------
# build_tree_kernel_efficient_cpu: hand-drawn trees
# ------------------------------------------------------------------------------------------------
# topk=2, depth (num_steps)=2, n=4. Candidates by global score index: 0, 1 are the root's children;
# 2, 3 the children of candidate 0; 4, 5 those of candidate 1. parent_list = [-1, 0, 1] maps
# s // topk to the parent's candidate. Selected (sorted): [0, 1, 3].
#
#        0 (root)          node 1 = candidate 0, node 2 = candidate 1
#       / \                node 3 = candidate 3 (3 // 2 = 1 -> parent_list[1] = 0 -> node 1)
#      1   2
#      |
#      3
TREE_A = dict(parent_list=[[-1, 0, 1]], selected_index=[[0, 1, 3]], topk=2, depth=2, n=4,
              parents=(-1, 0, 0, 1))

# topk=2, depth=3, n=6, two requests. parent_list = [-1, 0, 1, x, y] where x, y are the step-1
# candidates expanded at step 2; step-2 candidates 6, 7 are x's children and 8, 9 are y's.
#
# request 0: x, y = 3, 4; selected [0, 1, 3, 4, 6]     request 1: x, y = 2, 3; selected [0, 1, 2, 3, 6]
#        0                                                     0
#       / \          node 3 = cand 3 (child of 0 = node 1)     / \         node 3 = cand 2, node 4 = cand 3
#      1   2         node 4 = cand 4 (child of 1 = node 2)    1   2        (both children of cand 0)
#      |   |         node 5 = cand 6 (child of x=3 = node 3) / \           node 5 = cand 6 (child of x = 2
#      3   4                                               3   4           = node 3)
#      |                                                   |
#      5                                                   5
TREE_B = dict(parent_list=[[-1, 0, 1, 3, 4], [-1, 0, 1, 2, 3]],
              selected_index=[[0, 1, 3, 4, 6], [0, 1, 2, 3, 6]], topk=2, depth=3, n=6,
              parents=[(-1, 0, 0, 1, 2, 3), (-1, 0, 0, 1, 1, 3)])


def test_build_tree_hand_case_qlen_only():
    t = TREE_A
    tree_mask, positions, retrieve_buf = assert_build_matches_reference(
        torch.tensor(t["parent_list"]), torch.tensor(t["selected_index"]), [5], t["topk"], t["depth"], t["n"],
        TREE_MASK_QLEN_ONLY)
    assert tree_mask.view(4, 4).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    assert positions.tolist() == [5, 6, 6, 7]
    assert retrieve_buf[0].tolist() == [[0, 1, 2, 3]]
    assert retrieve_buf[1].tolist() == [[1, 3, -1, -1]]  # first child
    assert retrieve_buf[2].tolist() == [[-1, 2, -1, -1]]  # next sibling


def test_build_tree_hand_case_full_mask_keeps_prefix_fill():
    t = TREE_A
    seq_len, n = 2, t["n"]
    tree_mask, positions, _ = assert_build_matches_reference(
        torch.tensor(t["parent_list"]), torch.tensor(t["selected_index"]), [seq_len], t["topk"], t["depth"], n,
        TREE_MASK_FULL)
    # each row: seq_len prefix columns (left as the caller's True fill), then the n tree columns
    assert tree_mask.view(n, seq_len + n).int().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]
    assert positions.tolist() == [2, 3, 3, 4]


def test_build_tree_hand_case_two_requests():
    t = TREE_B
    n = t["n"]
    seq_lens = [3, 7]
    for mode in MODES:
        tree_mask, positions, retrieve_buf = assert_build_matches_reference(
            torch.tensor(t["parent_list"]), torch.tensor(t["selected_index"]), seq_lens, t["topk"], t["depth"],
            n, mode)
    assert retrieve_buf[0].tolist() == [list(range(0, 6)), list(range(6, 12))]
    assert retrieve_buf[1].tolist() == [[1, 3, 4, 5, -1, -1], [1, 3, -1, 5, -1, -1]]
    assert retrieve_buf[2].tolist() == [[-1, 2, -1, -1, -1, -1], [-1, 2, -1, 4, -1, -1]]
    assert positions.tolist() == [3, 4, 4, 5, 5, 6] + [7, 8, 8, 9, 9, 10]
    # the derived buffers agree with the repo's canonical tree form
    for b, parents in enumerate(t["parents"]):
        bufs = build_buffers(Tree(parents))
        assert retrieve_buf[1, b].tolist() == bufs.retrieve_next_token.tolist()
        assert retrieve_buf[2, b].tolist() == bufs.retrieve_next_sibling.tolist()


def test_build_tree_depth_one_takes_empty_parent_list():
    # num_steps=1: organize_draft_results passes a (bs, 0) parent_list; every node is a root child.
    #      0
    #    / | \
    #   1  2  3
    parent_list = torch.empty(2, 0, dtype=torch.long)
    selected = torch.tensor([[0, 1, 2], [0, 1, 3]])
    for mode in MODES:
        tree_mask, positions, retrieve_buf = assert_build_matches_reference(
            parent_list, selected, [4, 1], 4, 1, 4, mode)
    assert retrieve_buf[1].tolist() == [[1, -1, -1, -1]] * 2
    assert retrieve_buf[2].tolist() == [[-1, 2, 3, -1]] * 2
    assert positions.tolist() == [4, 5, 5, 5, 1, 2, 2, 2]


def test_build_tree_orphan_node_is_isolated_like_the_kernels():
    # Node 2 = candidate 4, whose parent (candidate 1) was not selected: the kernels skip its links
    # and its mask row holds only the root and itself. Its child, node 3 = candidate 8 (8 // 2 = 4 ->
    # parent_list[4] = 4 -> node 2), still links to it.
    #      0
    #      |       2 (orphan)
    #      1       |
    #              3
    parent_list = torch.tensor([[-1, 0, 1, 3, 4]])
    selected = torch.tensor([[0, 4, 8]])
    for mode in MODES:
        tree_mask, positions, retrieve_buf = assert_build_matches_reference(
            parent_list, selected, [0], 2, 3, 4, mode)
    assert tree_mask.view(4, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    assert retrieve_buf[1].tolist() == [[1, -1, 3, -1]]
    assert positions.tolist() == [0, 1, 1, 2]


def test_build_tree_rejects_bitpacked_mode_and_short_buffers():
    t = TREE_A
    args = (torch.tensor(t["parent_list"]), torch.tensor(t["selected_index"]), torch.tensor([5]))
    outs = (torch.empty(4, dtype=torch.long), torch.empty(1, 4, dtype=torch.long),
            torch.empty(1, 4, dtype=torch.long), torch.empty(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="FULL_MASK"):
        build_tree_kernel_efficient_cpu(*args, torch.ones(16, dtype=torch.bool), *outs, 2, 2, 4, 2)
    with pytest.raises(ValueError, match="tree_mask"):
        build_tree_kernel_efficient_cpu(*args, torch.ones(15, dtype=torch.bool), *outs, 2, 2, 4,
                                        TREE_MASK_QLEN_ONLY)


def test_build_tree_writes_only_the_head_of_a_preallocated_mask():
    # SGLang's VerifyMask buffer is sized for the captured max batch; a smaller batch uses its head.
    t = TREE_A
    tree_mask = torch.full((3 * 16,), True, dtype=torch.bool)
    outs = [torch.full((1, 4), -1, dtype=torch.long) for _ in range(3)]
    build_tree_kernel_efficient_cpu(torch.tensor(t["parent_list"]), torch.tensor(t["selected_index"]),
                                    torch.tensor([5]), tree_mask, torch.empty(4, dtype=torch.long), *outs,
                                    2, 2, 4, TREE_MASK_QLEN_ONLY)
    assert tree_mask[:16].int().tolist() == [1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1]
    assert tree_mask[16:].all()


# ------------------------------------------------------------------------------------------------
# build_tree_kernel_efficient_cpu: random EAGLE drafts
# ------------------------------------------------------------------------------------------------
RANDOM_SHAPES = [  # (topk, num_steps, num_draft_tokens)
    (1, 3, 4),
    (2, 2, 4),
    (2, 3, 6),
    (4, 3, 9),
    (3, 4, 10),
    (4, 5, 16),
    (8, 4, 32),
]


@pytest.mark.parametrize("topk, num_steps, n", RANDOM_SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_build_tree_random_drafts_match_reference(topk, num_steps, n, mode):
    gen = torch.Generator().manual_seed(1000 * topk + 10 * num_steps + n)
    for bs in (1, 3):
        parent_list, selected = simulate_eagle_draft(bs, topk, num_steps, n, gen)
        seq_lens = torch.randint(0, 9, (bs,), generator=gen).tolist()
        assert_build_matches_reference(parent_list, selected, seq_lens, topk, num_steps, n, mode)


@pytest.mark.parametrize("topk, num_steps, n", RANDOM_SHAPES)
def test_build_tree_random_drafts_agree_with_canonical_tree(topk, num_steps, n):
    """Metamorphic: the parent array read off the mask rebuilds the same links, depths and mask."""
    gen = torch.Generator().manual_seed(7 * topk + num_steps + 100 * n)
    bs = 4
    parent_list, selected = simulate_eagle_draft(bs, topk, num_steps, n, gen)
    seq_lens = torch.randint(1, 20, (bs,), generator=gen).tolist()
    tree_mask, positions, retrieve_buf = run_build(parent_list, selected, seq_lens, topk, num_steps, n,
                                                   TREE_MASK_QLEN_ONLY)
    mask = tree_mask.view(bs, n, n)
    for b in range(bs):
        # the nearest ancestor has the largest index: SGLang's node order is topological
        parents = tuple([-1] + [max(j for j in range(i) if mask[b, i, j]) for i in range(1, n)])
        bufs = build_buffers(Tree(parents))
        assert torch.equal(mask[b], bufs.ancestor_mask)
        assert retrieve_buf[1, b].tolist() == bufs.retrieve_next_token.tolist()
        assert retrieve_buf[2, b].tolist() == bufs.retrieve_next_sibling.tolist()
        assert (positions.view(bs, n)[b] - seq_lens[b]).tolist() == bufs.positions.tolist()
        assert Tree(parents).max_depth <= num_steps


def test_build_tree_accepts_int32_inputs_and_bool_or_uint8_masks():
    gen = torch.Generator().manual_seed(3)
    parent_list, selected = simulate_eagle_draft(2, 3, 3, 8, gen)
    seq_lens = [4, 2]
    expected = run_build(parent_list, selected, seq_lens, 3, 3, 8, TREE_MASK_QLEN_ONLY)
    tree_mask = torch.ones(2 * 64, dtype=torch.uint8)
    positions = torch.empty(16, dtype=torch.int32)
    retrieve_buf = torch.full((3, 2, 8), -1, dtype=torch.int32)
    seq_lens_int32 = torch.tensor(seq_lens, dtype=torch.int32)
    build_tree_kernel_efficient_cpu(parent_list.int(), selected.int(), seq_lens_int32, tree_mask, positions,
                                    *retrieve_buf, 3, 3, 8, TREE_MASK_QLEN_ONLY)
    assert tree_mask.bool().tolist() == expected[0].tolist()
    assert positions.tolist() == expected[1].tolist()
    assert retrieve_buf.tolist() == expected[2].tolist()


# ------------------------------------------------------------------------------------------------
# verify_tree_greedy_cpu
# ------------------------------------------------------------------------------------------------
def test_verify_greedy_hand_cases():
    # TREE_A for three requests. Node tokens: root (bonus) 7, node 1 -> 3, node 2 -> 5, node 3 -> 8.
    #        0 (7)
    #       / \
    #   (3) 1   2 (5)
    #       |
    #       3 (8)
    t = TREE_A
    _, _, retrieve_buf = run_build(torch.tensor(t["parent_list"] * 3), torch.tensor(t["selected_index"] * 3),
                                   [5, 5, 5], t["topk"], t["depth"], t["n"], TREE_MASK_QLEN_ONLY)
    candidates = torch.tensor([[7, 3, 5, 8]] * 3)
    target_predict = torch.tensor([
        [3, 8, 0, 11],  # root wants 3 (node 1), node 1 wants 8 (node 3), node 3 is a leaf: bonus 11
        [5, 0, 9, 0],   # root wants 5: node 1 (3) misses, its sibling node 2 (5) matches; bonus 9
        [1, 0, 0, 0],   # root wants 1: nothing matches, the correction token is 1
    ])
    predicts, accept_index, accept_token_num = run_verify(candidates, retrieve_buf, target_predict,
                                                          num_spec_step=t["depth"] + 1)
    assert accept_index.tolist() == [[0, 1, 3], [4, 6, -1], [8, -1, -1]]  # flat node indices b * n + i
    assert accept_token_num.tolist() == [2, 1, 0]
    assert predicts.tolist() == [3, 8, 0, 11, 5, 0, 9, 0, 1, 0, 0, 0]
    ref = ref_verify_greedy(candidates.tolist(), *(r.tolist() for r in retrieve_buf), target_predict.tolist(),
                            num_spec_step=3)
    assert (predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()) == ref


def test_verify_greedy_stops_at_num_spec_step():
    # A chain 0 - 1 - 2 - 3 fully matched, but accept_index has room for 3 slots: two drafts accepted,
    # node 2's prediction is the bonus token.
    parent_list = torch.tensor([[-1, 0, 1]])  # topk=1, depth=3: candidate s has parent s - 1
    selected = torch.tensor([[0, 1, 2]])
    _, _, retrieve_buf = run_build(parent_list, selected, [0], 1, 3, 4, TREE_MASK_QLEN_ONLY)
    candidates = torch.tensor([[9, 1, 2, 3]])
    target_predict = torch.tensor([[1, 2, 3, 4]])
    predicts, accept_index, accept_token_num = run_verify(candidates, retrieve_buf, target_predict, 3)
    assert accept_index.tolist() == [[0, 1, 2]]
    assert accept_token_num.tolist() == [2]
    assert predicts.tolist() == [1, 2, 3, 0]


@pytest.mark.parametrize("topk, num_steps, n", RANDOM_SHAPES)
def test_verify_greedy_random_matches_reference(topk, num_steps, n):
    gen = torch.Generator().manual_seed(31 * topk + 17 * num_steps + n)
    bs = 5
    parent_list, selected = simulate_eagle_draft(bs, topk, num_steps, n, gen)
    _, _, retrieve_buf = run_build(parent_list, selected, [0] * bs, topk, num_steps, n, TREE_MASK_QLEN_ONLY)
    total_accepted = 0
    for vocab in (2, 3, 5):  # small vocabularies so that many drafts match
        candidates = torch.randint(0, vocab, (bs, n), generator=gen)
        target_predict = torch.randint(0, vocab, (bs, n), generator=gen)
        out = run_verify(candidates, retrieve_buf, target_predict, num_steps + 1)
        ref = ref_verify_greedy(candidates.tolist(), *(r.tolist() for r in retrieve_buf),
                                target_predict.tolist(), num_steps + 1)
        assert (out[0].tolist(), out[1].tolist(), out[2].tolist()) == ref
        total_accepted += int(out[2].sum())
        # invariants: the accepted nodes form a root path whose tokens are the target's argmax
        for b in range(bs):
            path = [i - b * n for i in out[1][b].tolist() if i >= 0]
            assert len(path) == int(out[2][b]) + 1 and path[0] == 0
            for prev, node in zip(path, path[1:]):
                assert candidates[b, node] == target_predict[b, prev]
    if topk > 1 or num_steps > 1:
        assert total_accepted > 0  # the random cases exercise acceptance, not only rejection


@pytest.mark.parametrize("num_spec_step", [1, 3])
def test_verify_greedy_one_node_per_request_accepts_the_root_and_takes_the_bonus(num_spec_step):
    # A step without drafts, laid out as EAGLEWorkerV2._build_trivial_verify_input lays it out: one node per
    # request, retrieve_index b, no children, no siblings. (The fast path for n == 1 against the reference walk.)
    gen = torch.Generator().manual_seed(5)
    bs = 4
    r_index = torch.arange(bs).unsqueeze(1)
    none = torch.full((bs, 1), -1)
    candidates = torch.randint(0, 50, (bs, 1), generator=gen)
    target_predict = torch.randint(0, 50, (bs, 1), generator=gen)
    out = run_verify(candidates, (r_index, none, none), target_predict, num_spec_step)
    ref = ref_verify_greedy(candidates.tolist(), r_index.tolist(), none.tolist(), none.tolist(),
                            target_predict.tolist(), num_spec_step)
    assert (out[0].tolist(), out[1].tolist(), out[2].tolist()) == ref
    assert out[0].tolist() == target_predict.flatten().tolist() and out[2].tolist() == [0] * bs


def test_verify_tree_greedy_takes_sglang_keyword_names():
    # spec_tree.py:510-521 calls the op with these keywords (sgl-kernel's `retrive_*` spelling).
    names = list(inspect.signature(verify_tree_greedy_cpu).parameters)
    assert names == ["predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
                     "retrive_next_token", "retrive_next_sibling", "target_predict"]


# ------------------------------------------------------------------------------------------------
# reconstruct_indices_from_tree_mask (NGRAM)
# ------------------------------------------------------------------------------------------------
def run_reconstruct(tree_mask, seq_lens, bs, n):
    """Call the op as NGRAMWorker does: positionally, into int64 buffers (uninitialised there; -7 here)."""
    positions = torch.full((bs * n,), -7, dtype=torch.long)
    retrieve_buf = torch.full((3, bs, n), -7, dtype=torch.long)
    reconstruct_indices_from_tree_mask(tree_mask, seq_lens, positions, retrieve_buf[0], retrieve_buf[1],
                                       retrieve_buf[2], bs, n)
    return positions, retrieve_buf


def assert_reconstruct_matches_reference(tree_mask, seq_lens, bs, n):
    positions, retrieve_buf = run_reconstruct(tree_mask, torch.tensor(seq_lens), bs, n)
    ref = ref_reconstruct(tree_mask.reshape(-1).bool().tolist(), seq_lens, bs, n)
    assert positions.tolist() == ref[0]
    assert retrieve_buf[0].tolist() == ref[1]
    assert retrieve_buf[1].tolist() == ref[2]
    assert retrieve_buf[2].tolist() == ref[3]
    return positions, retrieve_buf


def ngram_mask(*parent_arrays):
    """NGRAM's flat bool mask for one tree per request: row i holds node i and its ancestors."""
    return torch.cat([build_buffers(Tree(p)).ancestor_mask.reshape(-1) for p in parent_arrays])


def test_reconstruct_hand_case_from_sgl_kernel():
    # sgl-kernel's own test (test_reconstruct_indices_from_tree_mask), seq_len 12:
    #      0
    #     / \
    #    1   2
    #        |
    #        3
    tree_mask = torch.tensor([1, 0, 0, 0,
                              1, 1, 0, 0,
                              1, 0, 1, 0,
                              1, 0, 1, 1], dtype=torch.bool)
    positions, retrieve_buf = assert_reconstruct_matches_reference(tree_mask, [12], 1, 4)
    assert positions.tolist() == [12, 13, 13, 14]
    assert retrieve_buf[0].tolist() == [[0, 1, 2, 3]]
    assert retrieve_buf[1].tolist() == [[1, -1, 3, -1]]   # first child
    assert retrieve_buf[2].tolist() == [[-1, 2, -1, -1]]  # next sibling


def test_reconstruct_hand_case_two_requests():
    # request 0, seq_len 3:          request 1, seq_len 0:
    #        0                              0
    #      / | \                            |
    #     1  2  4                           1
    #     |                                / \
    #     3                               2   3
    #                                         |
    #                                         4
    parents = [(-1, 0, 0, 1, 0), (-1, 0, 1, 1, 3)]
    positions, retrieve_buf = assert_reconstruct_matches_reference(ngram_mask(*parents), [3, 0], 2, 5)
    assert positions.tolist() == [3, 4, 4, 5, 4] + [0, 1, 2, 2, 3]
    assert retrieve_buf[0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert retrieve_buf[1].tolist() == [[1, 3, -1, -1, -1], [1, 2, -1, 4, -1]]
    assert retrieve_buf[2].tolist() == [[-1, 2, 4, -1, -1], [-1, -1, 3, -1, -1]]


def test_reconstruct_hand_case_masks_that_are_not_trees():
    # What the kernel writes for masks no NGRAM corpus produces: depth counts the earlier nodes a row sees,
    # the parent is the latest of them, the "first child" is the first later row that sees the node.
    #   row 0: . . .        row 2 sees node 1 but not node 0: parent 1, depth 1, and node 0's
    #   row 1: x . .        first child is 1; node 2 is the first row seeing 1
    #   row 2: . x .
    not_closed = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    positions, retrieve_buf = assert_reconstruct_matches_reference(not_closed, [5], 1, 3)
    assert positions.tolist() == [5, 6, 6]
    assert retrieve_buf[1].tolist() == [[1, 2, -1]] and retrieve_buf[2].tolist() == [[-1, -1, -1]]
    # only the diagonal (and cells above it, never read): every node a root, no links, no siblings
    upper = torch.ones(3, 3, dtype=torch.bool).triu().reshape(-1)
    positions, retrieve_buf = assert_reconstruct_matches_reference(upper, [5], 1, 3)
    assert positions.tolist() == [5, 5, 5]
    assert retrieve_buf[1:].tolist() == [[[-1, -1, -1]], [[-1, -1, -1]]]


def random_parents(n, gen):
    """A random tree in topological order: node i hangs under a uniformly drawn earlier node."""
    return tuple([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 16])  # 12: NGRAM's default speculative_num_draft_tokens
def test_reconstruct_random_trees_match_reference_and_canonical_tree(n):
    gen = torch.Generator().manual_seed(100 + n)
    for bs in (1, 3, 8):
        parents = [random_parents(n, gen) for _ in range(bs)]
        seq_lens = torch.randint(0, 50, (bs,), generator=gen).tolist()
        positions, retrieve_buf = assert_reconstruct_matches_reference(ngram_mask(*parents), seq_lens, bs, n)
        for b, p in enumerate(parents):
            bufs = build_buffers(Tree(p))
            assert retrieve_buf[1, b].tolist() == bufs.retrieve_next_token.tolist()
            assert retrieve_buf[2, b].tolist() == bufs.retrieve_next_sibling.tolist()
            assert (positions.view(bs, n)[b] - seq_lens[b]).tolist() == bufs.positions.tolist()


def sglang_function(relative: str, name: str):
    """A top-level function of an installed SGLang source file, compiled on its own (numpy and torch in scope);
    the test skips where SGLang is not installed."""
    import numpy as np

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    source = open(path).read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"np": np, "torch": torch}
    exec(compile(ast.Module([node], []), path, "exec"), scope)
    return scope[name]


@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_reconstruct_random_trees_match_sglangs_own_host_side_links(n):
    # SGLang's NGRAM worker derives the same links on the host for its grammar mask (`_derive_tree_links`,
    # "matching what reconstruct_indices_from_tree_mask produces on device"): the op must agree with it. The
    # function is taken from SGLang's source and run alone (importing its module needs sgl_kernel)
    _derive_tree_links = sglang_function("srt/speculative/ngram_worker.py", "_derive_tree_links")

    gen = torch.Generator().manual_seed(300 + n)
    for bs in (1, 2, 6):
        parents = [random_parents(n, gen) for _ in range(bs)]
        mask = ngram_mask(*parents)
        _, retrieve_buf = run_reconstruct(mask, torch.zeros(bs, dtype=torch.long), bs, n)
        next_token, next_sibling = _derive_tree_links(mask.numpy(), bs, n)
        assert retrieve_buf[1].tolist() == next_token.tolist()
        assert retrieve_buf[2].tolist() == next_sibling.tolist()


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12])
def test_reconstruct_random_masks_match_reference(n):
    gen = torch.Generator().manual_seed(200 + n)
    for bs in (1, 4, 7):
        for density in (0.2, 0.5, 0.8):
            tree_mask = torch.rand(bs * n * n, generator=gen) < density
            seq_lens = torch.randint(0, 30, (bs,), generator=gen).tolist()
            out = assert_reconstruct_matches_reference(tree_mask, seq_lens, bs, n)
            # the diagonal and the upper triangle are never read
            flipped = tree_mask.view(bs, n, n) ^ torch.ones(n, n, dtype=torch.bool).triu()
            again = run_reconstruct(flipped.reshape(-1), torch.tensor(seq_lens), bs, n)
            assert torch.equal(again[0], out[0]) and torch.equal(again[1], out[1])


@pytest.mark.parametrize("seq_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_reconstruct_writes_slices_of_preallocated_buffers_as_ngram_passes_them(seq_dtype, mask_dtype):
    # NGRAMWorker._init_preallocated_tensors: buffers for max_batch_size, each step passes [:bs] slices.
    max_bs, bs, n = 4, 2, 6
    gen = torch.Generator().manual_seed(9)
    parents = [random_parents(n, gen) for _ in range(bs)]
    tree_mask = torch.zeros(max_bs * n * n, dtype=mask_dtype)
    tree_mask[: bs * n * n] = ngram_mask(*parents).to(mask_dtype)
    positions = torch.full((max_bs * n,), -7, dtype=torch.int64)
    retrieve = [torch.full((max_bs, n), -7, dtype=torch.int64) for _ in range(3)]
    seq_lens = torch.tensor([10, 3], dtype=seq_dtype)
    reconstruct_indices_from_tree_mask(tree_mask, seq_lens, positions[: bs * n], *(r[:bs, :] for r in retrieve),
                                       bs, n)
    expected = run_reconstruct(ngram_mask(*parents), seq_lens.long(), bs, n)
    assert positions[: bs * n].tolist() == expected[0].tolist()
    assert [r[:bs].tolist() for r in retrieve] == expected[1].tolist()
    assert positions[bs * n:].eq(-7).all() and all(r[bs:].eq(-7).all() for r in retrieve)


def test_reconstruct_rejects_short_buffers_and_accepts_an_empty_batch():
    outs = (torch.empty(8, dtype=torch.long), *(torch.empty(2, 4, dtype=torch.long) for _ in range(3)))
    with pytest.raises(ValueError, match="tree_mask"):
        reconstruct_indices_from_tree_mask(torch.ones(31, dtype=torch.bool), torch.tensor([1, 2]), *outs, 2, 4)
    with pytest.raises(ValueError, match="positions"):
        reconstruct_indices_from_tree_mask(torch.ones(32, dtype=torch.bool), torch.tensor([1, 2]),
                                           torch.empty(7, dtype=torch.long), *outs[1:], 2, 4)
    with pytest.raises(ValueError, match="draft_token_num"):
        reconstruct_indices_from_tree_mask(torch.ones(0, dtype=torch.bool), torch.tensor([1, 2]), *outs, 2, 0)
    empty = torch.empty(0, dtype=torch.long)
    reconstruct_indices_from_tree_mask(torch.ones(0, dtype=torch.bool), empty, empty, empty.view(0, 4),
                                       empty.view(0, 4), empty.view(0, 4), 0, 4)


def test_reconstruct_takes_sgl_kernel_parameter_names():
    # sgl-kernel's schema (and SGLang's `reconstruct_indices_from_tree_mask_func`), `retrive_*` spelling included
    names = list(inspect.signature(reconstruct_indices_from_tree_mask).parameters)
    assert names == ["tree_mask", "verified_seq_len", "positions", "retrive_index", "retrive_next_token",
                     "retrive_next_sibling", "batch_size", "draft_token_num"]


# ------------------------------------------------------------------------------------------------
# Index arithmetic ops: hand-computed expectations
# ------------------------------------------------------------------------------------------------
def test_assign_req_to_token_pool_scatters_segments():
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),                       # req_pool_indices (int64)
        req_to_token,
        torch.tensor([1, 3], dtype=torch.int32),    # start_offset (int32, as eagle_prepare_for_decode passes)
        torch.tensor([3, 6], dtype=torch.int32),    # end_offset
        torch.tensor([10, 11, 20, 21, 22]),         # out_cache_loc (int64)
        8,
    )
    assert req_to_token.tolist() == [
        [0, 0, 0, 20, 21, 22, 0, 0],
        [0] * 8,
        [0, 10, 11, 0, 0, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="out_cache_loc"):
        assign_req_to_token_pool_cpu(torch.tensor([0]), req_to_token, torch.tensor([0]), torch.tensor([4]),
                                     torch.tensor([1, 2, 3]), 8)


def test_assign_extend_cache_locs_gathers_segments_and_leaves_the_tail():
    req_to_token = torch.arange(24, dtype=torch.int32).view(3, 8)
    backing = torch.full((14,), -7, dtype=torch.int64)
    out_cache_loc = backing[::2]  # deliberately non-contiguous
    assign_extend_cache_locs_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 5]), torch.tensor([3, 8]),
                                 out_cache_loc, 8)
    assert out_cache_loc.tolist() == [17, 18, 5, 6, 7, -7, -7]
    assert backing[1::2].eq(-7).all()


def test_assign_draft_cache_locs_contiguous_reads_slots_after_prefix():
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    backing = torch.zeros(16, dtype=torch.int64)
    out_cache_loc = backing[::2]  # deliberately non-contiguous
    assign_draft_cache_locs_contiguous_cpu(torch.tensor([3, 1]), req_to_token, torch.tensor([2, 5]),
                                           out_cache_loc, 10, 2, 2)
    assert out_cache_loc.tolist() == [32, 33, 34, 35, 15, 16, 17, 18]
    assert backing[1::2].eq(0).all()


def test_fill_bonus_tokens_picks_last_accepted():
    accept_tokens = torch.tensor([[7, 8, 9], [4, 5, 6]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3], dtype=torch.int32), bonus, 3)
    assert bonus.tolist() == [8, 6]


def test_fill_accept_out_cache_loc_compacts_across_requests():
    accept_index = torch.tensor([[0, 1, -1], [4, -1, -1], [8, 9, 11]], dtype=torch.int32)
    out_cache_loc = 100 + torch.arange(12)
    accept_out = torch.zeros(9, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out)
    assert accept_out.tolist() == [100, 101, 104, 108, 109, 111, 0, 0, 0]


@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_copy_all_layer_kv_cache_gathers_before_scattering(loc_dtype):
    torch.manual_seed(0)
    k = torch.randn(6, 2, 3)  # two "layers" with different row widths and dtypes
    v = torch.randn(6, 2, 2).to(torch.bfloat16)
    k0, v0 = k.clone(), v.clone()
    data_ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()])
    tgt = torch.tensor([1, 2], dtype=loc_dtype)
    src = torch.tensor([2, 3], dtype=loc_dtype)  # slot 2 is both read and overwritten
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for now, before in ((k, k0), (v, v0)):
        assert torch.equal(now[1], before[2]) and torch.equal(now[2], before[3])
        assert torch.equal(now[[0, 3, 4, 5]], before[[0, 3, 4, 5]])


def test_copy_all_layer_kv_cache_leaves_rows_copied_onto_themselves_and_moves_the_rest():
    torch.manual_seed(1)
    k = torch.randn(8, 2, 3)
    k0 = k.clone()
    data_ptrs = torch.tensor([k.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size()])
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, torch.tensor([0, 3, 5]), torch.tensor([0, 3, 5]))
    assert torch.equal(k, k0)                                   # all in place: nothing moves
    tgt, src = torch.tensor([0, 1, 2, 6]), torch.tensor([0, 4, 2, 1])   # 0 and 2 in place, 1 read and written
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    expect = k0.clone()
    expect[tgt] = k0[src]
    assert torch.equal(k, expect)


def test_ops_accept_empty_batches():
    req_to_token = torch.zeros(2, 4, dtype=torch.int32)
    empty = torch.empty(0, dtype=torch.long)
    assign_req_to_token_pool_cpu(empty, req_to_token, empty, empty, empty, 4)
    assign_extend_cache_locs_cpu(empty, req_to_token, empty, empty, empty, 4)
    assign_draft_cache_locs_contiguous_cpu(empty, req_to_token, empty, empty, 4, 2, 2)
    fill_accept_out_cache_loc_cpu(torch.full((2, 3), -1, dtype=torch.int32), torch.arange(4), empty)
    copy_all_layer_kv_cache_cpu(torch.empty(0, dtype=torch.uint64), empty, empty, empty)
    assert req_to_token.eq(0).all()


# ------------------------------------------------------------------------------------------------
# install_if_missing: where SGLang looks the ops up (`from sgl_kernel import NAME`,
# `from sgl_kernel.speculative import NAME`)
# ------------------------------------------------------------------------------------------------
OP_MODULES = sorted({module for module, _ in CPU_OPS})


@pytest.fixture
def cpu_engine(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")


@pytest.fixture
def no_sgl_kernel(monkeypatch):
    """`import sgl_kernel` (and its submodules) raise ImportError; whatever install puts there is undone after."""
    for module in OP_MODULES:
        monkeypatch.setitem(sys.modules, module, None)


def test_cpu_ops_table_names_every_op_once():
    assert CPU_OP_NAMES == tuple(name for _, name in CPU_OPS) and len(set(CPU_OP_NAMES)) == len(CPU_OPS)
    assert all(module == "sgl_kernel" or module.startswith("sgl_kernel.") for module, _ in CPU_OPS)
    assert all(callable(getattr(cpu_ops, name)) and name in cpu_ops.__all__ for name in CPU_OP_NAMES)
    assert ("sgl_kernel.speculative", "reconstruct_indices_from_tree_mask") in CPU_OPS


def test_install_does_nothing_outside_the_cpu_engine(monkeypatch, no_sgl_kernel):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert install_if_missing() is InstallOutcome.SKIPPED
    assert all(sys.modules[module] is None for module in OP_MODULES)


def test_install_puts_a_stub_when_sgl_kernel_does_not_import(no_sgl_kernel, cpu_engine):
    assert install_if_missing() is InstallOutcome.STUB_INSTALLED
    from sgl_kernel import build_tree_kernel_efficient_cpu as looked_up  # noqa: PLC0415
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask as ngram_looked_up  # noqa: PLC0415

    assert looked_up is build_tree_kernel_efficient_cpu
    assert ngram_looked_up is reconstruct_indices_from_tree_mask
    assert all(getattr(importlib.import_module(module), name) is getattr(cpu_ops, name) for module, name in CPU_OPS)
    assert importlib.import_module("sgl_kernel").speculative is sys.modules["sgl_kernel.speculative"]
    with pytest.raises(ImportError):
        from sgl_kernel import rmsnorm_cpu  # noqa: F401, PLC0415
    with pytest.raises(ImportError):
        from sgl_kernel.speculative import verify_tree_greedy  # noqa: F401, PLC0415
    with pytest.raises(ModuleNotFoundError):   # not a package: SGLang's optional `sgl_kernel.allreduce` stays absent
        importlib.import_module("sgl_kernel.allreduce")
    assert all(importlib.util.find_spec(module) is not None for module in OP_MODULES)  # specs: find_spec works
    assert install_if_missing() is InstallOutcome.STUB_PRESENT
    assert sglang_platform_plugin() is None  # the platform entry point: installs, activates nothing


def test_install_never_shadows_a_real_sgl_kernel(monkeypatch, no_sgl_kernel, cpu_engine):
    real = types.ModuleType("sgl_kernel")   # no `speculative` submodule: it gets our stub
    sentinel = object()
    real.verify_tree_greedy_cpu = sentinel
    real.rmsnorm_cpu = sentinel
    monkeypatch.setitem(sys.modules, "sgl_kernel", real)
    assert install_if_missing() is InstallOutcome.ADDED_TO_REAL
    assert sys.modules["sgl_kernel"] is real
    assert real.verify_tree_greedy_cpu is sentinel and real.rmsnorm_cpu is sentinel
    assert real.copy_all_layer_kv_cache_cpu is copy_all_layer_kv_cache_cpu
    assert real.speculative is sys.modules["sgl_kernel.speculative"]
    assert real.speculative.reconstruct_indices_from_tree_mask is reconstruct_indices_from_tree_mask
    assert install_if_missing() is InstallOutcome.REAL_COMPLETE


def test_install_fills_a_real_submodule_only_where_it_lacks_the_op(monkeypatch, no_sgl_kernel, cpu_engine):
    real = types.ModuleType("sgl_kernel")
    for name in CPU_OP_NAMES:
        setattr(real, name, getattr(cpu_ops, name))
    speculative = types.ModuleType("sgl_kernel.speculative")
    monkeypatch.setitem(sys.modules, "sgl_kernel", real)
    monkeypatch.setitem(sys.modules, "sgl_kernel.speculative", speculative)
    assert install_if_missing() is InstallOutcome.ADDED_TO_REAL
    assert speculative.reconstruct_indices_from_tree_mask is reconstruct_indices_from_tree_mask
    own = object()
    speculative.reconstruct_indices_from_tree_mask = own
    assert install_if_missing() is InstallOutcome.REAL_COMPLETE
    assert speculative.reconstruct_indices_from_tree_mask is own


# SGLang 0.5.23's modules that import sgl_kernel ops on the CPU path (the table in cpu/ops.py's docstring)
SGLANG_CPU_IMPORTERS = (
    "srt/mem_cache/allocation.py",
    "kernels/ops/kvcache/cache_move.py",
    "kernels/ops/speculative/cache_locs.py",
    "kernels/ops/speculative/eagle.py",
    "kernels/ops/speculative/spec_tree.py",
    "kernels/ops/speculative/reconstruct_tree.py",   # NGRAM
)


def _sglang_root() -> str | None:
    """The installed SGLang package directory, found without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


class _OnCpu(dict):
    """SGLang's device tests as a CPU process sees them: `_is_cpu`, `is_cpu()` true; other `_is_X`, `is_X()` false."""

    def __missing__(self, name):
        if name == "TYPE_CHECKING":
            return False
        if name.startswith("_is_"):
            return name == "_is_cpu"
        if name.startswith("is_"):
            return lambda: name == "is_cpu"
        raise KeyError(f"unexpected name {name!r} in a module-level `if`: re-read this file for the new SGLang")


def _cpu_path_sgl_kernel_imports(path: str) -> list[ast.ImportFrom]:
    """The module-level `from sgl_kernel[.x] import ...` statements a CPU process runs in `path` (read, not run)."""
    found = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sgl_kernel":
                found.append(node)
            elif isinstance(node, ast.If):
                taken = eval(compile(ast.Expression(node.test), path, "eval"), {}, _OnCpu())  # noqa: S307
                walk(node.body if taken else node.orelse)

    walk(ast.parse(open(path).read()).body)
    return found


def test_sglang_cpu_path_imports_exactly_our_ops_and_gets_the_torch_versions(no_sgl_kernel, cpu_engine):
    root = _sglang_root()
    if root is None:
        pytest.skip("SGLang is not installed")
    imports = {path: _cpu_path_sgl_kernel_imports(os.path.join(root, path)) for path in SGLANG_CPU_IMPORTERS}
    wanted = {(node.module, alias.name) for nodes in imports.values() for node in nodes for alias in node.names}
    assert wanted == set(CPU_OPS)
    assert {(n.module, a.name) for n in imports["kernels/ops/speculative/reconstruct_tree.py"] for a in n.names} == {
        ("sgl_kernel.speculative", "reconstruct_indices_from_tree_mask")}
    assert install_if_missing() is InstallOutcome.STUB_INSTALLED
    for path, nodes in imports.items():   # run SGLang's own import statements against the installed stubs
        namespace: dict = {}
        exec(compile(ast.Module(nodes, []), path, "exec"), namespace)  # noqa: S102
        for node in nodes:
            for alias in node.names:
                assert namespace[alias.asname or alias.name] is getattr(cpu_ops, alias.name), (path, alias.name)


# ------------------------------------------------------------------------------------------------
# Optional: SGLang's own Triton kernels, run by the Triton interpreter
# ------------------------------------------------------------------------------------------------
def _installed_spec_tree() -> str | None:
    """SGLang's spec_tree.py in the installed SGLang (found without importing SGLang)."""
    root = _sglang_root()
    return None if root is None else os.path.join(root, "kernels", "ops", "speculative", "spec_tree.py")


@pytest.mark.slow
def test_against_sglang_triton_kernels_interpreted(monkeypatch):
    path = os.environ.get("ENTMTP_SGLANG_SPEC_TREE") or _installed_spec_tree()
    if not path or not os.path.exists(path):
        pytest.skip("no SGLang: set ENTMTP_SGLANG_SPEC_TREE to sglang/kernels/ops/speculative/spec_tree.py")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    import triton.language as tl  # noqa: PLC0415

    # Only the two @triton.jit functions: the file's imports would pull in all of SGLang.
    wanted = ("sgl_build_tree_kernel_efficient_triton", "verify_tree_greedy_kernel_triton")
    source = ast.parse(open(path).read())
    kernels = ast.Module([n for n in source.body if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    namespace = {"triton": triton, "tl": tl}
    exec(compile(kernels, path, "exec"), namespace)
    build_kernel, verify_kernel = (namespace[name] for name in wanted)

    gen = torch.Generator().manual_seed(0)
    for topk, num_steps, n in RANDOM_SHAPES[:5]:
        for mode in MODES:
            bs = 2
            parent_list, selected = simulate_eagle_draft(bs, topk, num_steps, n, gen)
            seq_lens = torch.randint(1, 6, (bs,), generator=gen)
            tree_mask = torch.ones(mask_numel(mode, seq_lens.tolist(), n), dtype=torch.bool)
            positions = torch.empty(bs * n, dtype=torch.long)
            retrieve_buf = torch.full((3, bs, n), -1, dtype=torch.long)
            seq_len_prefix_sum = torch.cumsum(seq_lens, 0) - seq_lens
            build_kernel[(bs,)](parent_list, selected, seq_lens, seq_len_prefix_sum, tree_mask, positions,
                                *retrieve_buf, topk=topk, depth=num_steps, draft_token_num=n,
                                tree_mask_mode=mode, batch_size=bs, parent_list_stride=parent_list.stride(0),
                                selected_index_stride=selected.stride(0))
            ours = run_build(parent_list, selected, seq_lens.tolist(), topk, num_steps, n, mode)
            assert torch.equal(ours[0], tree_mask) and torch.equal(ours[1], positions)
            assert torch.equal(ours[2], retrieve_buf)

            candidates = torch.randint(0, 3, (bs, n), generator=gen)
            target_predict = torch.randint(0, 3, (bs, n), generator=gen)
            predicts = torch.zeros(bs * n, dtype=torch.int32)
            accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int32)
            accept_token_num = torch.empty(bs, dtype=torch.int32)
            verify_kernel[(bs,)](predicts, accept_index, accept_token_num, candidates, *retrieve_buf,
                                 target_predict, batch_size=bs, num_speculative_tokens=num_steps + 1,
                                 num_draft_tokens=n)
            out = run_verify(candidates, retrieve_buf, target_predict, num_steps + 1)
            assert torch.equal(out[0], predicts) and torch.equal(out[1], accept_index)
            assert torch.equal(out[2], accept_token_num)


@pytest.mark.slow
def test_reconstruct_against_sglang_triton_kernel_interpreted(monkeypatch):
    root = _sglang_root()
    path = None if root is None else os.path.join(root, "kernels", "ops", "speculative", "reconstruct_tree.py")
    if not path or not os.path.exists(path):
        pytest.skip("no SGLang with kernels/ops/speculative/reconstruct_tree.py")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    import triton.language as tl  # noqa: PLC0415

    source = ast.parse(open(path).read())
    kernel_ast = ast.Module([n for n in source.body
                             if isinstance(n, ast.FunctionDef) and n.name == "_reconstruct_tree_mask_kernel"], [])
    namespace = {"triton": triton, "tl": tl}
    exec(compile(kernel_ast, path, "exec"), namespace)  # noqa: S102
    kernel = namespace["_reconstruct_tree_mask_kernel"]

    gen = torch.Generator().manual_seed(4)
    for n in (1, 3, 5, 12):
        bs = 3
        trees = ngram_mask(*(random_parents(n, gen) for _ in range(bs)))
        for tree_mask in (trees, torch.rand(bs * n * n, generator=gen) < 0.4):
            seq_lens = torch.randint(0, 20, (bs,), generator=gen)
            positions = torch.empty(bs * n, dtype=torch.long)
            retrieve_buf = torch.empty(3, bs, n, dtype=torch.long)
            kernel[(bs,)](tree_mask, seq_lens, positions, *retrieve_buf, n, triton.next_power_of_2(n))
            ours = run_reconstruct(tree_mask, seq_lens, bs, n)
            assert torch.equal(ours[0], positions) and torch.equal(ours[1], retrieve_buf)
