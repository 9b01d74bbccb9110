"""Triton kernel for :func:`softmax_entropy` (imported lazily: needs triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import check_entropy_args, device_of


@triton.jit
def _softmax_entropy_kernel(
    x_ptr,  # (N, V) logits, any float dtype, strides (stride_n, stride_v)
    out_ptr,  # (N,) float32
    V,
    stride_n,
    stride_v,
    temperature,
    BLOCK_V: tl.constexpr,
):
    # One program per row; a single pass over V with an online max m and, relative to m,
    #   s = sum exp(z - m)              t = sum exp(z - m) * (z - m)
    # so that H = log(s) - t / s.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    t = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs  # (BLOCK_V,)
        x = tl.load(x_ptr + row * stride_n + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
        z = x.to(tl.float32) / temperature  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: any finite reference
        e = tl.exp(z - m_ref)  # (BLOCK_V,), 0 where z == -inf
        ed = e * tl.where(z == float("-inf"), 0.0, z - m_ref)  # 0 * -inf := 0
        alpha = tl.exp(m - m_ref)  # rescale old sums to the new reference (0 while m == -inf)
        shift = tl.where(m == float("-inf"), 0.0, m - m_ref)
        t = alpha * (t + shift * s) + tl.sum(ed, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    tl.store(out_ptr + row, tl.log(s) - t / s)  # all -inf row: s == 0 -> NaN


def softmax_entropy_triton(logits: torch.Tensor, temperature: float = 1.0, block_v: int | None = None) -> torch.Tensor:
    """Triton backend of :func:`softmax_entropy`; ``block_v`` (power of two) overrides the V tile."""
    check_entropy_args(logits, temperature)
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
    if n == 0:
        return out
    if block_v is None:
        block_v = min(triton.next_power_of_2(v), 4096)
    num_warps = 8 if block_v >= 2048 else 4
    with device_of(logits):
        _softmax_entropy_kernel[(n,)](
            logits, out, v, logits.stride(0), logits.stride(1), float(temperature), BLOCK_V=block_v, num_warps=num_warps
        )
    return out
