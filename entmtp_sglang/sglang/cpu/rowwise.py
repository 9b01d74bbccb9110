"""SGLang's float32 RMSNorm, SiLU-and-mul and rotary embedding on the CPU engine through the row-wise ops of
`kernels/rowwise_ops.cpp`, each one pass over a row.

Without sgl-kernel's CPU build (PyPI publishes none), SGLang 0.5.23 runs these three as `forward_native`: 5-10 torch
ops each, 50-140 us a call at decoding's few rows, about 11 ms of SmolLM2's 56 ms plain decoding step on this CPU
(`bench/results/sglang_step_profile.md`), for microseconds of arithmetic. The ops compute the same formulas (the
rotary embedding bit for bit, the RMSNorm and SiLU to float32 rounding), each row alone and in one fixed order,
so a row's result does not depend on the rows beside it: a verified tree's root gets plain decoding's result.

Installed by the plugin in every SGLang process on the CPU engine, plain servers included (with the linear layers
of `linear.py`): ENTMTP is checked against plain SGLang with the same ops. Only where SGLang would itself take
`forward_native` on float32 CPU tensors in the plain form (no extra residual, no quantized projection, no partial
variance, no autograd); anything else keeps SGLang's path. `ENTMTP_ROWWISE=0` leaves all three alone.
"""

from __future__ import annotations

import logging
import os

import torch

from ...kernels import rowwise_ops as ops
from ...settings import settings
from ..patches import RMSNORM, ROPE, SILU_AND_MUL, hooked

logger = logging.getLogger(__name__)
F32 = torch.float32


def _f32_cpu(t) -> bool:
    return t.dtype is F32 and t.device.type == "cpu"


def rmsnorm(original, self, x, residual=None, post_residual_addition=None, quant_linear=None):
    w = self.weight
    if (post_residual_addition is None and quant_linear is None and self.variance_size_override is None
            and self.override_orig_dtype in (None, F32) and x.dtype is F32 and x.device.type == "cpu"
            and w.dtype is F32 and not torch.is_grad_enabled() and x.shape[-1] == self.hidden_size
            and (residual is None or (_f32_cpu(residual) and residual.shape == x.shape))):
        if residual is None:
            return _RMSNORM(x.contiguous(), w, self.variance_epsilon)
        return _ADD_RMSNORM(x.contiguous(), residual.contiguous(), w, self.variance_epsilon)
    return original(self, x, residual, post_residual_addition, quant_linear)


def silu_and_mul(original, self, x):
    if x.dtype is F32 and x.device.type == "cpu" and not torch.is_grad_enabled() and x.shape[-1] % 2 == 0:
        return _SILU_AND_MUL(x.contiguous())
    return original(self, x)


def rope(original, self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    cache = self.__dict__.get("_entmtp_cos_sin")
    if cache is None or cache[0] is not getattr(self, "cos_sin_cache", None):
        c = getattr(self, "cos_sin_cache", None)
        ok = (c is not None and not hasattr(self, "sin_cos_cache") and _f32_cpu(c) and c.dim() == 2
              and c.shape[1] == self.rotary_dim and c.is_contiguous())
        cache = self.__dict__["_entmtp_cos_sin"] = (c, ok, self.head_size, bool(self.is_neox_style))
    c, ok, head_size, neox = cache
    if (ok and offsets is None and fused_set_kv_buffer_arg is None and query.dtype is F32 and key.dtype is F32
            and query.device.type == "cpu" and positions.device.type == "cpu" and not torch.is_grad_enabled()):
        pos = positions.reshape(-1)
        if pos.dtype is not torch.int64:
            pos = pos.long()
        return _ROPE(pos.contiguous(), query.contiguous(), key.contiguous(), c, head_size, neox)
    return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)


def _op(name):
    def call(*args):   # resolved on first call (the extension loads in register_hooks), then bound directly
        fn = getattr(torch.ops.entmtp, name).default
        globals()["_" + name.upper()] = fn
        if name in ("rmsnorm", "add_rmsnorm") and not _announced:
            _announced.append(name)   # one line per process, at the first call (SGLang's logging is set up)
            logger.info("ENTMTP: SGLang's float32 RMSNorm, SiLU-and-mul and rotary embedding take the row-wise CPU "
                        "ops (batch-invariant; ENTMTP_ROWWISE=0 leaves them to SGLang)")
        return fn(*args)
    return call


_announced: list[str] = []


_RMSNORM, _ADD_RMSNORM, _SILU_AND_MUL, _ROPE = (_op(n) for n in ("rmsnorm", "add_rmsnorm", "silu_and_mul", "rope"))


def register_hooks(check_signature) -> None:
    """Install the three hooks (CPU engine only, where the ops are built and ENTMTP_ROWWISE is not 0)."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1" or not settings().rowwise:
        return
    if not ops.available():
        logger.warning("ENTMTP: the row-wise CPU ops are unavailable (%s); SGLang's own RMSNorm, SiLU and rotary "
                       "embedding stay", ops.unavailable_reason())
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(RMSNORM, SILU_AND_MUL, ROPE).items():
        check_signature(dotted, params)
    HookRegistry.register(RMSNORM, rmsnorm, HookType.AROUND)
    HookRegistry.register(SILU_AND_MUL, silu_and_mul, HookType.AROUND)
    HookRegistry.register(ROPE, rope, HookType.AROUND)
