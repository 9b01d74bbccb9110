"""Linear layers on CPU through oneDNN with a cached pre-packed weight.

On this project's CPU (2 cores, AVX2) `F.linear` costs almost twice as much for 2 rows as for 1 and three times
as much for 3, so a decoding step that verifies a small tree paid for every drafted node in every layer.
oneDNN's linear on a weight packed once (`torch.ops.mkldnn._linear_pointwise`) costs about the same for 1-3
rows as for one, 1.2-1.9x less than `F.linear` at 2-8 rows of the decoder's projections, and 2.5-6x less for
SmolLM2's 49k-token output layer (`bench/linear_head.py`); a verification step with 1-4 drafts costs 1.4-1.9x
less, plain decoding 1.2x. For one row of a small projection alone the call is slower (a fixed ~0.05 ms).
It is also batch-invariant: a row's result does not depend on how many rows share the call, so the linear
layers give the root of a verified tree bit for bit what they give plain decoding. That holds for 2 rows and more:
for a single row oneDNN takes another kernel, which for SmolLM2's 1536-wide down projection rounds differently,
so fewer than `MIN_ROWS` (6) rows are computed padded to 6 with zero rows. Six rows cost what one does here (the
reference engine decoding SmolLM2 at 13.3 tok/s either way, measured 2026-12-03).

`linear(x, weight, bias)` takes that path on CPU, in float32, without autograd, when torch has oneDNN; it
takes `F.linear` everywhere else (other devices and dtypes, training). Results differ from `F.linear`'s by
float rounding only. The packed copy (as large as the weight) is cached with its module (`Linear`; the Llama
layers stack q, k, v and gate, up into one `PackedWeight` each), or per weight for a bare tensor (`linear`), and
rebuilt when a weight changes in place or is replaced. `ENTMTP_ONEDNN=0` in the environment (or `ONEDNN = False`
here) turns it off.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN = os.environ.get("ENTMTP_ONEDNN", os.environ.get("ENTMTP_ONEDNN_HEAD", "1")) != "0"
MIN_ROWS = 6   # oneDNN computes a single row apart (a 1536-wide input: other rounding); 6 rows cost what 1 does


def _available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_HAS_ONEDNN = _available()


def applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `x @ weight.T` takes oneDNN's packed path (module docstring)."""
    return (ONEDNN and _HAS_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_grad_enabled() and x.numel() > 0 and all(w.dtype == torch.float32 for w in weights))


class PackedWeight:
    """A packed copy of one weight, or of several stacked along the output dimension (one call computes a
    layer's q, k and v projections together), rebuilt when any of them changes in place or is replaced."""

    __slots__ = ("_key", "packed")

    def __init__(self):
        self._key: tuple = ()
        self.packed: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()  # a copied module packs its own (copied) weights on first use

    def __reduce__(self):
        return (PackedWeight, ())  # oneDNN tensors do not pickle; a loaded module packs again

    def get(self, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        key = self._key
        if (len(key) != len(weights) or any(r() is not w or v != w._version for (r, v), w in zip(key, weights))):
            dense = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.detach().contiguous(), None)
            self._key = tuple((weakref.ref(w), w._version) for w in weights)
        return self.packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for the packed weight W (call only where `applies`); fewer than `MIN_ROWS` rows are
    computed as `MIN_ROWS`, zero rows after them (module docstring)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows < MIN_ROWS:
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


_free: dict[int, PackedWeight] = {}  # id(weight) -> its packed copy, for weights that no Linear module owns


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           cache: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN on a packed weight where that applies (module docstring).
    `cache` holds the packed copy (a `Linear` passes its own); without one it is kept per weight."""
    if not applies(x, weight, *(() if bias is None else (bias,))):
        return F.linear(x, weight, bias)
    if cache is None:
        cache = _free.get(id(weight))
        if cache is None:
            cache = _free[id(weight)] = PackedWeight()
            for k in [k for k, c in _free.items() if c._key and c._key[0][0]() is None]:
                del _free[k]
    return packed_linear(x, cache.get((weight,)), bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose forward is `linear`, packed copy kept here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed)
