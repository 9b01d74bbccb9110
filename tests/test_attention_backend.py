"""The `entmtp_torch` attention backend's gather plans against a dense per-query reference (float32,
random pools, random trees). Pure torch: SGLang is not imported here."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.sglang.cpu.gather import attend, decode_plan, extend_plan, rows_plan, verify_plan
from entmtp_sglang.tree import Tree, build_buffers


def dense(q, k_rows, v_rows, visible, scale):
    """q (H, D) one query; k_rows/v_rows (L, Hkv, D); visible (L,) bool."""
    H, Hkv = q.shape[0], k_rows.shape[1]
    k = k_rows[visible].repeat_interleave(H // Hkv, 1)
    v = v_rows[visible].repeat_interleave(H // Hkv, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, -1)
    return torch.einsum("hl,lhd->hd", w, v)


def pool(gen, slots=200, hkv=2, d=8, reqs=3, width=64):
    k = torch.randn(slots, hkv, d, generator=gen)
    v = torch.randn(slots, hkv, d, generator=gen)
    r2t = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(reqs)]).int()
    return k, v, r2t


def test_extend_and_decode_are_causal_over_the_request_rows():
    gen = torch.Generator().manual_seed(0)
    k, v, r2t = pool(gen)
    rpi = torch.tensor([2, 0, 1])
    seq = torch.tensor([9, 5, 13])
    ext = torch.tensor([4, 5, 1])
    q = torch.randn(int(ext.sum()), 4, 8, generator=gen)
    out = attend(extend_plan(r2t, rpi, seq, ext), q, k, v, 0.3, torch.zeros_like(q))
    t = 0
    for b in range(3):
        rows = r2t[rpi[b], : seq[b]].long()
        for i in range(int(ext[b])):
            pos = int(seq[b] - ext[b]) + i
            vis = torch.arange(int(seq[b])) <= pos
            torch.testing.assert_close(out[t], dense(q[t], k[rows], v[rows], vis, 0.3))
            t += 1


@pytest.mark.parametrize("parents", [(-1, 0, 1, 2), (-1, 0, 0, 1, 1, 2, 4), (-1,)])
def test_tree_verify_sees_the_prefix_and_its_ancestors(parents):
    gen = torch.Generator().manual_seed(len(parents))
    k, v, r2t = pool(gen)
    tree = Tree(parents)
    n = tree.num_nodes
    anc = build_buffers(tree).ancestor_mask
    rpi, seq = torch.tensor([1, 2]), torch.tensor([7, 11])
    mask = anc.flatten().repeat(2)                 # QLEN_ONLY layout, same tree for both requests
    q = torch.randn(2 * n, 4, 8, generator=gen)
    out = attend(verify_plan(r2t, rpi, seq, n, mask), q, k, v, 0.5, torch.zeros_like(q))
    for b in range(2):
        rows = r2t[rpi[b], : seq[b] + n].long()
        for i in range(n):
            vis = torch.cat([torch.ones(int(seq[b]), dtype=torch.bool), anc[i]])
            torch.testing.assert_close(out[b * n + i], dense(q[b * n + i], k[rows], v[rows], vis, 0.5))


def test_chain_verify_equals_causal_extend():
    gen = torch.Generator().manual_seed(3)
    k, v, r2t = pool(gen)
    rpi, seq, n = torch.tensor([0, 2]), torch.tensor([6, 10]), 5
    q = torch.randn(2 * n, 4, 8, generator=gen)
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool)).flatten().repeat(2)
    a = attend(verify_plan(r2t, rpi, seq, n, chain), q, k, v, 0.4, torch.zeros_like(q))
    b = attend(extend_plan(r2t, rpi, seq + n, torch.full((2,), n)), q, k, v, 0.4, torch.zeros_like(q))
    torch.testing.assert_close(a, b)


def test_draft_rows_see_prefix_and_listed_slots():
    gen = torch.Generator().manual_seed(4)
    k, v, r2t = pool(gen)
    pre = r2t[[0, 0, 1, 1], :6].long()
    extra = torch.tensor([[10, 11], [12, 0], [20, 21], [22, 23]])
    valid = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    q = torch.randn(4, 4, 8, generator=gen)
    out = attend(rows_plan(pre, torch.ones_like(pre, dtype=torch.bool), extra, valid), q, k, v, 0.3,
                 torch.zeros_like(q))
    for r in range(4):
        rows = torch.cat([pre[r], extra[r]])
        vis = torch.cat([torch.ones(6, dtype=torch.bool), valid[r]])
        torch.testing.assert_close(out[r], dense(q[r], k[rows], v[rows], vis, 0.3))


def _indexed(plan):
    """The same plan read and written through its query indices, not as a view."""
    plan.dense = False
    return plan


def test_dense_plans_read_queries_as_a_view_and_give_the_indexed_result_exactly():
    """Decode, verify and draft-row plans lay their queries out as rows x queries in order; `attend` reads and writes
    them as views. The result is the indexed path's, bit for bit, and decode is extend with one query each."""
    gen = torch.Generator().manual_seed(5)
    k, v, r2t = pool(gen)
    rpi, seq = torch.tensor([2, 0, 1]), torch.tensor([9, 5, 13])
    q = torch.randn(3, 4, 8, generator=gen)
    plan = decode_plan(r2t, rpi, seq)
    assert plan.dense
    got = attend(plan, q, k, v, 0.3, torch.zeros_like(q))
    assert torch.equal(got, attend(_indexed(decode_plan(r2t, rpi, seq)), q, k, v, 0.3, torch.zeros_like(q)))
    assert torch.equal(got, attend(extend_plan(r2t, rpi, seq, torch.ones_like(seq)), q, k, v, 0.3, torch.zeros_like(q)))

    n = 4
    mask = build_buffers(Tree((-1, 0, 0, 1))).ancestor_mask.flatten().repeat(3)
    q = torch.randn(3 * n, 4, 8, generator=gen)
    got = attend(verify_plan(r2t, rpi, seq, n, mask), q, k, v, 0.5, torch.zeros_like(q))
    assert torch.equal(got, attend(_indexed(verify_plan(r2t, rpi, seq, n, mask)), q, k, v, 0.5, torch.zeros_like(q)))

    pre = r2t[[0, 1], :6].long()
    extra, valid = torch.tensor([[10, 11], [20, 0]]), torch.tensor([[True, True], [True, False]])
    q = torch.randn(2, 4, 8, generator=gen)
    rows = rows_plan(pre, torch.ones_like(pre, dtype=torch.bool), extra, valid)
    assert rows.dense and not extend_plan(r2t, rpi, seq, torch.tensor([2, 1, 3])).dense
    got = attend(rows, q, k, v, 0.3, torch.zeros_like(q))
    assert torch.equal(got, attend(_indexed(rows_plan(pre, torch.ones_like(pre, dtype=torch.bool), extra, valid)),
                                   q, k, v, 0.3, torch.zeros_like(q)))



def test_the_plans_additive_mask_is_the_bool_mask_bit_for_bit():
    """`attend` hands SDPA the plan's mask as an additive bias made once per forward (not the bool mask, which SDPA
    converts on every layer): the output is the bool mask's bit for bit, for grouped-query heads too."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    gen = torch.Generator().manual_seed(8)
    k, v, r2t = pool(gen)
    rpi, seq, n = torch.tensor([2, 0, 1]), torch.tensor([9, 5, 13]), 4
    mask = build_buffers(Tree((-1, 0, 0, 1))).ancestor_mask.flatten().repeat(3)
    plan = verify_plan(r2t, rpi, seq, n, mask)
    for heads in (2, 4):   # the pool's 2 KV heads: plain and grouped (2 queries a KV head)
        q = torch.randn(3 * n, heads, 8, generator=gen)
        got = attend(plan, q, k, v, 0.5, torch.zeros_like(q))
        kk, vv = k[plan.kv_idx].transpose(1, 2), v[plan.kv_idx].transpose(1, 2)
        want = sdpa(q.view(3, n, heads, 8).transpose(1, 2), kk, vv, attn_mask=plan.mask[:, None], scale=0.5,
                    enable_gqa=heads != 2).transpose(1, 2).reshape(3 * n, heads, 8)
        assert torch.equal(got, want)
    assert plan.bias(torch.float32) is plan.bias(torch.float32)   # made once, shared by every layer


def test_decode_of_equal_lengths_runs_unmasked_and_matches_the_masked_plan():
    """Nothing is padded when every request has the same length (batch 1 always): the decode plan carries no mask,
    so SDPA takes its unmasked path, as SGLang's plain decoding does; the values are the masked plan's."""
    gen = torch.Generator().manual_seed(6)
    k, v, r2t = pool(gen)
    for rpi, seq in ((torch.tensor([1]), torch.tensor([11])), (torch.tensor([2, 0, 1]), torch.tensor([7, 7, 7]))):
        q = torch.randn(len(rpi), 4, 8, generator=gen)
        plan = decode_plan(r2t, rpi, seq)
        assert plan.mask is None and plan.dense
        got = attend(plan, q, k, v, 0.3, torch.zeros_like(q))
        torch.testing.assert_close(got, attend(extend_plan(r2t, rpi, seq, torch.ones_like(seq)), q, k, v, 0.3,
                                               torch.zeros_like(q)))
        for b in range(len(rpi)):
            rows = r2t[int(rpi[b]), : int(seq[b])].long()
            torch.testing.assert_close(got[b], dense(q[b], k[rows], v[rows], torch.ones(int(seq[b]), dtype=torch.bool),
                                                     0.3))
    assert decode_plan(r2t, torch.tensor([0, 1]), torch.tensor([5, 6])).mask is not None


def test_per_row_draft_slots_give_each_request_its_own_trees_rows():
    """`MultiStepDraftBackend.set_draft_rows` with (bs, topk, A) offsets (each request its own tree): request b's
    draft rows read the KV slots that the shared (topk, A) offsets of b's tree give it alone."""
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip()
    from types import SimpleNamespace

    from entmtp_sglang.sglang.cpu.attention import MultiStepDraftBackend

    gen = torch.Generator().manual_seed(5)
    _, _, r2t = pool(gen, reqs=3)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             token_to_kv_pool=None)
    topk, steps = 2, 3
    # per tree, per draft step: (topk, A) offsets and validity
    trees = [[torch.tensor([[0, 1], [3, 0]]), torch.tensor([[0, 1], [4, 5]])],
             [torch.tensor([[0, 0], [1, 0]]), torch.tensor([[0, 2], [1, 2]])]]
    valid = [[torch.tensor([[True, True], [True, False]]), torch.ones(2, 2, dtype=torch.bool)],
             [torch.tensor([[True, False], [True, False]]), torch.tensor([[True, True], [False, True]])]]
    batch = SimpleNamespace(req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=torch.tensor([7, 5, 9]))
    choice = [1, 0, 1]

    def plans(offsets, valids):
        backend = MultiStepDraftBackend(runner, topk, steps)
        backend.set_draft_rows(offsets, valids)
        backend.init_forward_metadata(batch)
        return [(c.draft_plan.kv_idx, c.draft_plan.mask) for c in backend.attn_backends]

    per_row = plans([torch.stack([trees[k][s] for k in choice]) for s in range(2)],
                    [torch.stack([valid[k][s] for k in choice]) for s in range(2)])
    shared = [plans(trees[k], valid[k]) for k in range(2)]
    for s in range(2):
        for b, k in enumerate(choice):
            rows = slice(b * topk, (b + 1) * topk)
            assert torch.equal(per_row[s][0][rows], shared[k][s][0][rows])
            assert torch.equal(per_row[s][1][rows], shared[k][s][1][rows])
    assert not torch.equal(per_row[1][0][:topk], shared[0][1][0][:topk])   # row 0 is not tree 0's
