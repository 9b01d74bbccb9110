"""SGLang's float32 linear layers and output layer on the CPU through the path `model/linear.py` picks for this
machine (the few-row kernel, or oneDNN on a packed weight).

SGLang 0.5.23 on a CPU without AMX runs every projection as `F.linear` and the output layer as `torch.matmul`.
Those cost about twice as much for 4 rows as for 1 (the 49k-token output layer three times as much for 8 rows),
so a verify pass over a small tree paid for each node in every layer; and they are not batch-invariant (MKL
rounds one row differently from several), so a verified tree's root could differ from plain decoding's at a
near-tie. The chosen path reads each weight once for all rows and computes each row the same way whatever the
rows beside it (`bench/experiments/linear_head.py` measures it per shape).
Installed by the plugin in every SGLang process on the CPU engine, plain servers included: a plain server with
the package is as fast as stock SGLang or faster, and ENTMTP is checked against it on the same layers. Results
differ from SGLang's own by float rounding only.
Where the machine's choice is `F.linear` itself (`ENTMTP_LINEAR=torch`, or `ENTMTP_ONEDNN=0`), nothing is hooked.

Only where SGLang would itself call `F.linear` / `torch.matmul` on float32 CPU tensors: quantized, AMX, LoRA
and GPU layers keep SGLang's path.
"""

from __future__ import annotations

import logging

import torch

from ...kernels.fewrow_linear import FewRowWeight
from ...model.linear import PackedWeight, applies, packed_linear
from ..patches import LINEAR_APPLY, LM_HEAD, hooked

logger = logging.getLogger(__name__)
F32 = torch.float32


def _packed(module) -> PackedWeight:
    cache = getattr(module, "_entmtp_packed", None)
    if cache is None:
        cache = module._entmtp_packed = PackedWeight()
    return cache


def _plain_weight(module) -> bool:
    """A dense float32 weight SGLang would multiply with `F.linear` (not AMX-packed, not quantized)."""
    w = getattr(module, "weight", None)
    return (w is not None and type(w.data) is torch.Tensor
            and not getattr(module, "use_intel_amx_backend", False))


_announced = False


def _announce(cache: PackedWeight) -> None:
    """One log line per process, at the first hooked call (SGLang's logging is set up by then)."""
    global _announced
    if not _announced:
        _announced = True
        logger.info("ENTMTP: SGLang's float32 CPU linear layers take the %s path (batch-invariant, packed once; "
                    "`entmtp kernels` shows why)", cache.path)


def linear_apply(original, self, layer, x, bias=None):
    fast = layer.__dict__.get("_entmtp_fast")
    if fast is not None:   # the few-row kernel's weight as checked last call: a decode step's 120 calls stay cheap
        weight, version, packed, n, op = fast
        if (layer._parameters.get("weight") is weight and weight._version == version and x.dtype is F32
                and x.device.type == "cpu" and not torch.is_grad_enabled()
                and (bias is None or (bias.dtype is F32 and bias.device.type == "cpu"))):
            flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
            out = op(flat, packed, bias, n)
            return out if flat is x else out.view(*x.shape[:-1], n)
    if _plain_weight(layer) and applies(x, layer.weight, *(() if bias is None else (bias,))):
        cache = _packed(layer)
        packed = cache.get((layer.weight,))
        out = packed_linear(x, packed, bias)
        _announce(cache)
        if isinstance(packed, FewRowWeight) and isinstance(layer._parameters.get("weight"), torch.Tensor):
            w = layer._parameters["weight"]
            layer.__dict__["_entmtp_fast"] = (w, w._version, packed.packed, packed.out_features,
                                              torch.ops.entmtp.fewrow_linear.default)
        return out
    layer.__dict__.pop("_entmtp_fast", None)
    return original(self, layer, x, bias)


def lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    plain = (getattr(lm_head, "quant_method", None) is None or type(lm_head.quant_method).__name__
             in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"))
    if (plain and embedding_bias is None and kwargs.get("out") is None and _plain_weight(lm_head)
            and not hasattr(lm_head, "apply_lora") and not getattr(self, "use_fp32_lm_head", False)
            and getattr(self, "rl_on_policy_target", None) is None and applies(hidden_states, lm_head.weight)):
        return packed_linear(hidden_states, _packed(lm_head).get((lm_head.weight,)))
    return original(self, hidden_states, lm_head, embedding_bias, **kwargs)


def _torch_linear(_self, layer, x, bias=None):
    return torch.nn.functional.linear(x, layer.weight, bias)


def _plain_module_forward(module, x):
    """A `torch.nn.Linear`'s forward as `linear_apply` takes SGLang's layers (its cached fast path included), `F.linear`
    where the packed path does not apply."""
    return linear_apply(_torch_linear, None, module, x, module.bias)


def _packing_here() -> bool:
    """The CPU engine, on a machine whose chosen path is not `F.linear` itself: where the layers are taken."""
    import os

    from ...model import linear as packed

    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1" and packed.choose_path() != "torch"


def pack_torch_linears(model) -> int:
    """`model`'s plain `torch.nn.Linear` layers through the same path as SGLang's own linear layers: the EAGLE and
    EAGLE-3 drafters' `fc` (which SGLang builds as a torch module, out of the hooks' reach) ran as `F.linear`, about
    six times one row's cost for 4-8 rows and not batch-invariant, in every draft level and draft extend. Their
    `forward` becomes an instance attribute; returns how many were taken. Nothing where `register_hooks` hooks
    nothing."""
    if not _packing_here():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module.forward = _plain_module_forward.__get__(module)
            n += 1
    return n


def register_hooks(check_signature) -> None:
    """Install both hooks (CPU engine only; where the machine's path is `F.linear` itself, SGLang's layers stay)."""
    if not _packing_here():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(LINEAR_APPLY, LM_HEAD).items():
        check_signature(dotted, params)
    HookRegistry.register(LINEAR_APPLY, linear_apply, HookType.AROUND)
    HookRegistry.register(LM_HEAD, lm_head, HookType.AROUND)
