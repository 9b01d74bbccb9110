"""Linear layers on CPU through oneDNN with a cached pre-packed weight.

On this project's CPU (2 cores, AVX2) `F.linear` costs almost twice as much for 2 rows as for 1 and three times
as much for 3, so a decoding step that verifies a small tree paid for every drafted node in every layer.
oneDNN's linear on a weight packed once (`torch.ops.mkldnn._linear_pointwise`) costs about the same for 1-3
rows as `F.linear` does for one, half as much at 4-8, and halves SmolLM2's 49k-token output layer
(`bench/linear_head.py`). It is also batch-invariant: a row's result does not depend on how many rows share
the call, so the root of a verified tree gets bit for bit the logits plain decoding gets.

`linear(x, weight, bias)` takes that path on CPU, in float32, without autograd, when torch has oneDNN; it
takes `F.linear` everywhere else (other devices and dtypes, training). Results differ from `F.linear`'s by
float rounding only. The packed copy (as large as the weight) is cached per weight and rebuilt when the weight
changes in place. `ENTMTP_ONEDNN=0` in the environment (or `ONEDNN = False` here) turns it off.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN = os.environ.get("ENTMTP_ONEDNN", os.environ.get("ENTMTP_ONEDNN_HEAD", "1")) != "0"
_packed: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its version, its packed copy)


def _available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_HAS_ONEDNN = _available()


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    cached = _packed.get(key)
    if cached is None or cached[0]() is not weight or cached[1] != weight._version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        cached = (weakref.ref(weight), weight._version, packed)
        _packed[key] = cached
        for k in [k for k, c in _packed.items() if c[0]() is None]:
            del _packed[k]
    return cached[2]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN on a packed weight where that applies (module docstring)."""
    if (not ONEDNN or not _HAS_ONEDNN or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32)
            or torch.is_grad_enabled() or x.numel() == 0):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, _packed_weight(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
