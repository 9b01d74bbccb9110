"""Row-wise float32 CPU ops of a decoder layer (``rowwise_ops.cpp``): RMSNorm with and without the residual add,
SiLU-and-mul, and rotary position embedding, each one pass over a row.

At decoding's few rows SGLang's ``forward_native`` versions (and the reference engine's) cost 50-140 us a call in
torch op overhead for microseconds of arithmetic; a 30-layer model calls them about 120 times a step. These compute
each row alone, in one fixed order, so a row's result does not depend on the rows beside it (batch-invariant), and
every vector width agrees. Built into the same extension as the few-row linear kernel (``fewrow_linear.py`` builds
and loads both); ``available()`` says whether it loaded.

The ``*_torch`` functions are the references, written as SGLang's ``forward_native`` computes them; the kernels
match them to float32 rounding (the rotary embedding exactly: the same element-wise ops, no fused multiply-add).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..settings import settings
from . import fewrow_linear as _ext


def available() -> bool:
    """Whether the compiled ops are loaded (building the extension on first call)."""
    return _ext.available() and hasattr(torch.ops.entmtp, "rmsnorm")


def unavailable_reason() -> str | None:
    return _ext.unavailable_reason()


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether callers should take the ops: built, and not switched off with ENTMTP_ROWWISE=0."""
    return settings().rowwise and available()


def takes(x: torch.Tensor) -> bool:
    """Whether the ops take x: float32 on the CPU, no autograd (training keeps torch's ops), the ops enabled."""
    return x.dtype is torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() and enabled()


# -- the ops -------------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` per row (x contiguous float32, last dimension = weight's)."""
    return torch.ops.entmtp.rmsnorm(x, weight, eps)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rmsnorm(s), s)``."""
    return torch.ops.entmtp.add_rmsnorm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``d = x.shape[-1] // 2``."""
    return torch.ops.entmtp.silu_and_mul(x)


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
         head_size: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of query and key, each (tokens, heads x head_size) or (tokens, heads, head_size): the first
    ``rotary_dim = cos_sin_cache.shape[1]`` features of every head rotated by its token's position's row of the cache
    (rotary_dim / 2 cosines, then the sines), the rest copied. New tensors of the inputs' shapes."""
    return torch.ops.entmtp.rope(positions, query, key, cos_sin_cache, head_size, neox)


# -- references ----------------------------------------------------------------------------------------------
def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)) * weight


def add_rmsnorm_torch(x, residual, weight, eps):
    s = x + residual
    return rmsnorm_torch(s, weight, eps), s


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rope_torch(positions, query, key, cos_sin_cache, head_size: int, neox: bool):
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def one(x):
        shape = x.shape
        x = x.reshape(positions.numel(), -1, head_size)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        if neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, rest), dim=-1).reshape(shape)

    return one(query), one(key)
