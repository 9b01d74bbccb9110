"""Gather plans for tree attention: which keys each query row sees, and one batched SDPA over them.

Pure torch, no SGLang import (the `entmtp_torch` backend in attention.py builds on these; tests check
them against a dense reference without loading SGLang).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from ...kernels import tree_ancestor_mask


class _Plan:
    """Per-forward gather plan: query rows x keys, shared by every layer of one forward."""

    __slots__ = ("kv_idx", "mask", "q_idx", "q_valid", "dense", "_bias", "_write")

    def __init__(self, kv_idx: torch.Tensor, mask: torch.Tensor | None, q_idx: torch.Tensor, q_valid: torch.Tensor,
                 dense: bool = False):
        self.kv_idx = kv_idx      # (R, L) int64 KV pool slots (padding: 0)
        self.mask = mask          # (R, Q, L) bool: query q of row r may attend key l; None: every query every key
        self.q_idx = q_idx        # (R, Q) int64 index into the flat query tokens (padding: 0)
        self.q_valid = q_valid    # (R, Q) bool
        # the flat queries are exactly the R x Q rows in order (q_idx == arange, none padded), known from how the
        # plan was built (decode, verify, draft rows): read and written as a view, without index copies
        self.dense = dense
        self._bias: torch.Tensor | None = None                    # the mask as SDPA's additive bias, made once
        self._write: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows of the R x Q output, their slots in out)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """(R, 1, Q, L) additive mask (0 visible, -inf hidden) in `dtype`, made on the first layer and reused by
        every other layer of the forward (SDPA otherwise turns the bool mask into this on every call; the result is
        the bool mask's bit for bit)."""
        if self.mask is None:
            return None
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))[:, None]
        return self._bias

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For an indexed (not dense) plan: which of the R x Q output rows are real queries, and the flat query
        each is written to, made once per forward."""
        if self._write is None:
            flat = self.q_valid.reshape(-1)
            self._write = (flat.nonzero().reshape(-1), self.q_idx.reshape(-1)[flat])
        return self._write


def _ragged_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor):
    """(R, L) slots req_to_token[req, :len] padded with 0, and (R, L) validity."""
    L = int(lens.max()) if lens.numel() else 0
    L = max(L, 1)
    cols = torch.arange(L, device=lens.device)
    valid = cols[None, :] < lens[:, None]
    rows = req_to_token[:, :L].index_select(0, req_pool_indices.long()).long()   # only the first L columns
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def extend_plan(req_to_token, req_pool_indices, seq_lens, extend_lens) -> _Plan:
    """Causal extend: request b has seq_lens[b] keys; its last extend_lens[b] positions are queries."""
    seq_lens, extend_lens = seq_lens.long(), extend_lens.long()
    kv_idx, kv_valid = _ragged_rows(req_to_token, req_pool_indices, seq_lens)
    Q = max(int(extend_lens.max()), 1)
    qi = torch.arange(Q, device=seq_lens.device)
    q_valid = qi[None, :] < extend_lens[:, None]
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    q_idx = torch.where(q_valid, starts[:, None] + qi[None, :], torch.zeros_like(qi)[None, :])
    q_pos = (seq_lens - extend_lens)[:, None] + qi[None, :]                       # (R, Q) absolute
    k_pos = torch.arange(kv_idx.shape[1], device=seq_lens.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    mask |= ~q_valid[:, :, None] & (k_pos == 0)[None, None, :]                   # padding rows: key 0
    return _Plan(kv_idx, mask, q_idx, q_valid)


def decode_plan(req_to_token, req_pool_indices, seq_lens) -> _Plan:
    """Decode: one query per request, the request's new token, over its seq_lens[b] keys."""
    seq_lens = seq_lens.long()
    plan = extend_plan(req_to_token, req_pool_indices, seq_lens, torch.ones_like(seq_lens))
    plan.dense = True
    if seq_lens.numel() and bool((seq_lens == seq_lens[0]).all()):
        plan.mask = None   # equal lengths (batch 1 always): nothing padded, so SDPA runs unmasked, as plain decoding's
    return plan


def verify_plan(req_to_token, req_pool_indices, seq_lens, n: int, custom_mask: torch.Tensor | None) -> _Plan:
    """Tree verify: n draft queries per request; prefix visible; drafts by the QLEN_ONLY tree mask."""
    seq_lens = seq_lens.long()
    bs = seq_lens.shape[0]
    kv_idx, kv_valid = _ragged_rows(req_to_token, req_pool_indices, seq_lens + n)
    L = kv_idx.shape[1]
    dev = seq_lens.device
    if custom_mask is None or custom_mask.numel() == 0:  # no tree mask: the drafts form a chain
        chain = torch.arange(-1, n - 1, device=dev)[None]  # (1, n) parents
        tree = tree_ancestor_mask(chain, torch.tensor([n], device=dev))[0].expand(bs, n, n)
    else:
        tree = custom_mask[: bs * n * n].view(bs, n, n).bool()
    k_pos = torch.arange(L, device=dev)
    rel = k_pos[None, :] - seq_lens[:, None]                                     # (bs, L)
    in_draft = (rel >= 0) & (rel < n)
    draft_vis = torch.gather(tree, 2, rel.clamp(0, n - 1)[:, None, :].expand(bs, n, L))
    mask = torch.where(in_draft[:, None, :], draft_vis, (rel < 0)[:, None, :]) & kv_valid[:, None, :]
    q_idx = torch.arange(bs * n, device=dev).view(bs, n)
    return _Plan(kv_idx, mask, q_idx, torch.ones(bs, n, dtype=torch.bool, device=dev), dense=True)


def rows_plan(prefix_idx: torch.Tensor, prefix_valid: torch.Tensor, extra_idx: torch.Tensor,
              extra_valid: torch.Tensor) -> _Plan:
    """One query per row over its prefix slots and extra (draft) slots."""
    kv_idx = torch.cat([prefix_idx, extra_idx], 1)
    valid = torch.cat([prefix_valid, extra_valid], 1)
    R = kv_idx.shape[0]
    q_idx = torch.arange(R, device=kv_idx.device)[:, None]
    return _Plan(kv_idx, valid[:, None, :], q_idx, torch.ones(R, 1, dtype=torch.bool, device=kv_idx.device),
                 dense=True)


def _rows(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """buf[idx] for a 2-D index over buf's first dimension, through index_select (on CPU a fraction of what
    advanced indexing costs: about 10 us against 30-55 us for a few hundred rows of SmolLM2's KV, twice per layer)."""
    return buf.index_select(0, idx.reshape(-1)).view(*idx.shape, *buf.shape[1:])


def attend(plan: _Plan, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scaling: float,
           out: torch.Tensor) -> torch.Tensor:
    """q (T, H, D) flat queries -> out (T, H, Dv), following the plan."""
    H = q.shape[1]
    R, Q = plan.q_idx.shape
    dense = plan.dense and q.shape[0] == R * Q
    qq = q.view(R, Q, *q.shape[1:]) if dense else _rows(q, plan.q_idx)    # (R, Q, H, D)
    kk = _rows(k_buf, plan.kv_idx)                         # (R, L, Hkv, D)
    vv = _rows(v_buf, plan.kv_idx)
    if kk.dtype != qq.dtype:
        kk, vv = kk.to(qq.dtype), vv.to(qq.dtype)
    o = scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                     attn_mask=plan.bias(qq.dtype), scale=scaling,
                                     enable_gqa=H != kk.shape[2])
    o = o.transpose(1, 2)                                  # (R, Q, H, Dv)
    if dense:
        out.view(R, Q, *out.shape[1:]).copy_(o)
    else:
        rows, slots = plan.write_index()
        out.index_copy_(0, slots, o.reshape(R * Q, *o.shape[2:]).index_select(0, rows).to(out.dtype))
    return out
