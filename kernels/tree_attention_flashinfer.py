"""FlashInfer backend of :func:`tree_attention` (imported lazily: needs flashinfer and a CUDA device).

The reference engine's KV cache of one layer is (B, n_kv, C, hd): that is FlashInfer's "HND" paged layout
with one page of C slots per request (page b holds request b), so the cache is read in place, nothing is
copied. Request b attends to slots [0, S) of its page (``last_page_len = S``) under its (T, S) block of the
mask, through ``BatchPrefillWithPagedKVCacheWrapper`` with a custom mask (FlashInfer 0.5.0 API).

The mask goes to ``plan(custom_mask=...)`` unpacked and FlashInfer packs it on the device
(``segment_packbits(..., bitorder="little")``, the layout ``tree_attention.segment_packbits_torch`` writes).
Handing it ``packed_custom_mask`` instead is not safe in 0.5.0: plan() then keeps the per-request mask
offsets in bits, while the kernel reads them as byte offsets, which is wrong from the second request on.

plan() (host work and a device sync) runs once per distinct mask: the layers of one forward pass share the
mask tensor, so they share one plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's float workspace (its examples use 128 MB, SGLang 384 MB)


@dataclass
class _Planned:
    """What the wrapper of one device was last planned for (the mask is held so its id stays unique)."""

    mask: torch.Tensor | None = None
    version: int = -1
    key: tuple = ()


@functools.lru_cache(maxsize=None)
def _wrapper(device_index: int):
    import flashinfer

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device_index))
    # backend "fa2": the one with custom masks ("auto" picks it for them too, after a check)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND", backend="fa2"), _Planned()


plans_made = 0  # plan() calls so far in this process (tests check that this path really ran)


def tree_attention_flashinfer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, nh, T, hd), k/v (B, n_kv, C, hd) CUDA float16/bfloat16, mask (B, 1, T, S) bool on q's device.
    Returns (B, nh, T, hd); semantics of :func:`tree_attention`."""
    global plans_made
    b, nh, t, hd = q.shape
    n_kv, capacity = k.shape[1], k.shape[2]
    span = mask.shape[-1]
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device}, the query on {q.device}: move the mask once per forward pass")
    wrapper, planned = _wrapper(q.device.index if q.device.index is not None else torch.cuda.current_device())
    key = (b, t, span, nh, n_kv, hd, capacity, q.dtype, k.dtype, k.stride(), v.stride())
    if planned.mask is not mask or planned.version != mask._version or planned.key != key:
        dev = q.device
        wrapper.plan(
            torch.arange(b + 1, dtype=torch.int32, device=dev) * t,  # qo_indptr: T queries per request
            torch.arange(b + 1, dtype=torch.int32, device=dev),  # paged_kv_indptr: one page per request
            torch.arange(b, dtype=torch.int32, device=dev),  # paged_kv_indices: page b is request b
            torch.full((b,), span, dtype=torch.int32, device=dev),  # last_page_len: slots [0, S) are read
            nh, n_kv, hd, capacity,
            custom_mask=mask[:, 0].reshape(-1),  # (B * T * S,) row-major per request
            q_data_type=q.dtype, kv_data_type=k.dtype)
        planned.mask, planned.version, planned.key = mask, mask._version, key
        plans_made += 1
    out = wrapper.run(q.transpose(1, 2).reshape(b * t, nh, hd), (k, v))  # (B * T, nh, hd)
    return out.view(b, t, nh, hd).transpose(1, 2)
