"""Tree attention over a padded KV cache with an explicit boolean mask: dispatcher and torch references,
including the packed custom-mask layout FlashInfer reads.

One target pass verifies a whole token tree: each query (tree node) sees the committed prefix and its own
ancestors, which an explicit (B, 1, T, S) mask says. ``tree_attention`` computes::

    for b, h, t:                                      # q (B, nh, T, hd); k, v (B, n_kv, C, hd), C >= S
        g = h // (nh // n_kv)                         # grouped-query attention: the head's key/value head
        keys = [s for s in range(S) if mask[b, 0, t, s]]
        w = softmax(q[b, h, t] . k[b, g, keys] / sqrt(hd))
        out[b, h, t] = w @ v[b, g, keys]              # out (B, nh, T, hd)

Backends: "torch" runs ``scaled_dot_product_attention`` with the mask (any device and dtype; what the CPU
always runs); "flashinfer" runs FlashInfer's batch prefill with a custom mask, reading the cache in place
(``tree_attention_flashinfer.py``: CUDA, float16/bfloat16, head_dim 64/128/256); "auto" picks flashinfer
where it applies and flashinfer imports, else torch. FlashInfer is imported lazily, only when it runs.

The packed mask (FlashInfer's ``segment_packbits(..., bitorder="little")``): request b's (T, S) block is
flattened row-major into a segment of T * S bits; each segment is packed on its own into
ceil(T * S / 8) bytes starting at byte ``packed_indptr[b]``; element i of a segment is bit i % 8 (the least
significant bit first) of byte i // 8. The kernel reads mask[b, t, s] as
``(packed[packed_indptr[b] + (t * S + s) // 8] >> ((t * S + s) % 8)) & 1``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ._backend import flashinfer_available

AttentionBackend = Literal["auto", "torch", "flashinfer"]
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be (B, nh, T, hd) and k, v (B, n_kv, C, hd); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, nh, t, hd = q.shape
    if k.shape[0] != b or k.shape[3] != hd or nh % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (batch, head_dim, or heads not a "
                         "multiple of key/value heads)")
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:3] != (b, 1, t) or mask.shape[3] > k.shape[2]:
        raise ValueError(f"mask must be bool (B, 1, T, S) = ({b}, 1, {t}, S <= {k.shape[2]}); got {mask.dtype} "
                         f"{tuple(mask.shape)}")


def tree_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`tree_attention` (SDPA with the explicit mask; same semantics)."""
    _check(q, k, v, mask)
    span = mask.shape[-1]
    k, v = k[:, :, :span], v[:, :, :span]  # (B, n_kv, S, hd)
    # grouped-query heads read their key/value head in place (the same bits as repeating k and v per head, without
    # copying the cache three times a layer: 2.6x faster at one query on SmolLM2's 9 / 3 heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def resolve_attention_backend(backend: str, q: torch.Tensor) -> Literal["torch", "flashinfer"]:
    """Map ``"auto" | "torch" | "flashinfer"`` to the backend that runs for query ``q``.

    "auto" picks flashinfer for CUDA float16/bfloat16 queries with a head_dim FlashInfer builds, when
    flashinfer imports; an explicit "flashinfer" raises (with the reason) where it cannot run."""
    if backend == "torch":
        return "torch"
    fits = q.is_cuda and q.dtype in FLASHINFER_DTYPES and q.shape[-1] in FLASHINFER_HEAD_DIMS
    if backend == "auto":
        return "flashinfer" if fits and flashinfer_available() else "torch"
    if backend == "flashinfer":
        if not flashinfer_available():
            raise ImportError("attention backend 'flashinfer' requested but flashinfer is not importable")
        if not fits:
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA float16/bfloat16 query with head_dim in "
                             f"{FLASHINFER_HEAD_DIMS}; got {q.device} {q.dtype} head_dim {q.shape[-1]}")
        return "flashinfer"
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   backend: AttentionBackend = "auto") -> torch.Tensor:
    """Masked attention of ``q`` (B, nh, T, hd) over slots [0, S) of ``k``, ``v`` (B, n_kv, C, hd) under
    ``mask`` (B, 1, T, S) bool (True = may attend); returns (B, nh, T, hd). See the module docstring.

    Every query row must allow at least one slot. ``backend``: "torch", "flashinfer" or "auto"."""
    if resolve_attention_backend(backend, q) == "flashinfer":
        from .tree_attention_flashinfer import tree_attention_flashinfer

        _check(q, k, v, mask)
        return tree_attention_flashinfer(q, k, v, mask)
    return tree_attention_torch(q, k, v, mask)


# ------------------------------------------------------------------------------------------ packed masks


def segment_packbits_torch(bits: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``flashinfer.segment_packbits(bits, indptr, bitorder="little")``.

    ``bits`` (nnz,) bool; segment i is ``bits[indptr[i]:indptr[i + 1]]``. Returns ``packed`` (uint8) and
    ``packed_indptr`` (int32, B + 1)::

        for i: packed_indptr[i + 1] = packed_indptr[i] + ceil(len(segment i) / 8)
        for i, j: bit j % 8 of packed[packed_indptr[i] + j // 8] = segment_i[j]     # least significant first
    """
    if bits.dim() != 1 or bits.dtype != torch.bool:
        raise ValueError(f"bits must be a 1-D bool tensor, got {bits.dtype} {tuple(bits.shape)}")
    indptr = indptr.to(bits.device, torch.int64)
    seglen = indptr[1:] - indptr[:-1]  # (B,)
    packed_indptr = torch.zeros(len(indptr), dtype=torch.int64, device=bits.device)
    packed_indptr[1:] = torch.cumsum((seglen + 7) // 8, 0)
    seg = torch.repeat_interleave(torch.arange(len(seglen), device=bits.device), seglen)  # (nnz,)
    local = torch.arange(bits.numel(), device=bits.device) - indptr[seg]  # (nnz,) index within its segment
    byte = packed_indptr[seg] + local // 8
    weight = torch.bitwise_left_shift(torch.ones_like(local), local % 8)  # 1 << bit position
    packed = torch.zeros(int(packed_indptr[-1]), dtype=torch.int64, device=bits.device)
    packed.index_add_(0, byte, bits.long() * weight)
    return packed.to(torch.uint8), packed_indptr.to(torch.int32)


def pack_tree_mask_torch(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, 1, T, S) bool mask as FlashInfer's packed custom mask: one segment of T * S bits per request
    (row-major), packed as :func:`segment_packbits_torch` does. Returns (packed uint8, packed_indptr int32)."""
    b, _, t, s = mask.shape
    indptr = torch.arange(b + 1, device=mask.device) * (t * s)
    return segment_packbits_torch(mask.reshape(-1), indptr)


def unpack_tree_mask_torch(packed: torch.Tensor, packed_indptr: torch.Tensor, qo_len: int, kv_len: int
                           ) -> torch.Tensor:
    """The (B, 1, qo_len, kv_len) bool mask a FlashInfer kernel reads from a packed custom mask::

        mask[b, 0, t, s] = (packed[packed_indptr[b] + (t * kv_len + s) // 8] >> ((t * kv_len + s) % 8)) & 1
    """
    b = len(packed_indptr) - 1
    offset = torch.arange(qo_len * kv_len, device=packed.device).view(1, -1)  # (1, T * S)
    start = packed_indptr[:b].to(packed.device, torch.int64).view(b, 1)  # (B, 1)
    byte = packed.long()[start + offset // 8]  # (B, T * S)
    bit = torch.bitwise_right_shift(byte, offset % 8) & 1
    return bit.bool().view(b, 1, qo_len, kv_len)


def tree_attention_packed_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: torch.Tensor,
                                packed_indptr: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Torch reference of attention under a packed custom mask, read as the FlashInfer kernel reads it
    (:func:`unpack_tree_mask_torch`), over slots [0, kv_len) of k, v."""
    mask = unpack_tree_mask_torch(packed, packed_indptr, q.shape[2], kv_len)
    return tree_attention_torch(q, k, v, mask)
