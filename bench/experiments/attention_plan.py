"""The `entmtp_torch` backend's verify attention, as it runs inside SGLang, against how it ran before 2026-12-06's
change: one target forward's 30 layers of SmolLM2's attention (9 query heads, 3 KV heads, head size 64).

    .venv/bin/python bench/experiments/attention_plan.py        # about a minute; prints the table (nothing written)

`now`: `gather.attend` as shipped: the plan's mask handed to SDPA as an additive bias made once per forward, and a
ragged verify whose rows are all as long as the longest (batch 1 always) read and written as a view. `before`: the
bool mask handed to SDPA on every layer (SDPA converts it each call) and a ragged verify always read and written
through its query indices (`out[q_idx[q_valid]] = ...`). Both give the same bits (asserted). Median of 15 paired
repeats, interleaved.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.functional import scaled_dot_product_attention

from entmtp_sglang.sglang.cpu.gather import _rows, attend
from entmtp_sglang.sglang.ragged import packed_index, ragged_verify_plan

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CASES = ((1, 6, (6,), 200), (1, 20, (20,), 200), (1, 20, (20,), 600), (4, 20, (20, 6, 12, 3), 200),
         (16, 20, (20, 4, 8, 2) * 4, 200))


def attend_before(plan, q, k_buf, v_buf, scaling, out):
    """`attend` as it was: the bool mask on every call, the indexed path for every plan not marked dense."""
    R, Q = plan.q_idx.shape
    dense = plan.dense and q.shape[0] == R * Q
    qq = q.view(R, Q, *q.shape[1:]) if dense else _rows(q, plan.q_idx)
    kk, vv = _rows(k_buf, plan.kv_idx), _rows(v_buf, plan.kv_idx)
    o = scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                     attn_mask=None if plan.mask is None else plan.mask[:, None], scale=scaling,
                                     enable_gqa=q.shape[1] != kk.shape[2]).transpose(1, 2)
    if dense:
        out.view(R, Q, *out.shape[1:]).copy_(o)
    else:
        out[plan.q_idx[plan.q_valid]] = o[plan.q_valid].to(out.dtype)
    return out


def case(bs: int, n: int, counts: tuple[int, ...], context: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    width = context + n + 8
    r2t = torch.arange(bs * width).view(bs, width).to(torch.int32)
    k_buf = torch.randn(bs * width, KV_HEADS, HEAD_DIM, generator=gen)
    v_buf = torch.randn(bs * width, KV_HEADS, HEAD_DIM, generator=gen)
    seq = torch.full((bs,), context)
    mask = torch.zeros(n, n, dtype=torch.bool).tril_()     # a chain: every node sees its ancestors
    real = torch.zeros(bs, n, dtype=torch.bool)
    for b, c in enumerate(counts):
        real[b, :c] = True
    q = torch.randn(int(packed_index(real).numel()), HEADS, HEAD_DIM, generator=gen)

    def forward(fn, dense_allowed: bool):
        plan = ragged_verify_plan(r2t, torch.arange(bs), seq, n, mask.repeat(bs, 1, 1).view(-1), real, counts)
        plan.dense = plan.dense and dense_allowed
        out = torch.empty_like(q)
        for _ in range(LAYERS):
            fn(plan, q, k_buf, v_buf, 0.125, out)
        return out

    assert torch.equal(forward(attend, True), forward(attend_before, False))
    ms = {"now": [], "before": []}
    for _ in range(repeats):
        for name, fn, dense in (("before", attend_before, False), ("now", attend, True)):
            t0 = time.perf_counter()
            forward(fn, dense)
            ms[name].append(1000 * (time.perf_counter() - t0))
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    ratio = sorted(b / a for a, b in zip(ms["now"], ms["before"]))[repeats // 2]
    return {"batch": bs, "nodes": n, "counts": counts, "context": context, **med, "paired": ratio}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per verify forward ({LAYERS} layers)")
    print("| batch | verify width | real nodes per row | context | before (ms) | now (ms) | before / now, paired |")
    print("|---|---|---|---|---|---|---|")
    for bs, n, counts, context in CASES:
        r = case(bs, n, counts, context, args.repeats)
        shown = f"{counts[0]} each" if len(set(counts)) == 1 else ", ".join(map(str, counts[:4])) + (
            f" (x{len(counts) // 4})" if len(counts) > 4 else "")
        print(f"| {bs} | {n} | {shown} | {context} | {r['before']:.2f} | {r['now']:.2f} | {r['paired']:.2f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
