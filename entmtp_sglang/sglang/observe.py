"""What verification saw, for ENTMTP's calibration through SGLang: the target's token after every tree node.

An AFTER hook on `eagle_utils.eagle_sample` (registered by plugin.py, active only for ENTMTP and only while a
worker asked for it with `enable()`) keeps, per verified step, the argmax of the target's logits at every
node of the tree (after SGLang applied grammar masks and penalties in place: what greedy verification
compares drafts with) and the target's entropy at the root. The worker takes them right after its verify
(`take()`), in the same process and thread, and turns them into calibration records (costs/online.py).
"""

from __future__ import annotations

import torch

from ..policy.signals import entropy_nats
from .patches import SAMPLE, hooked

_STATE: dict = {"enabled": False, "last": None}


def enable() -> None:
    _STATE["enabled"] = True


def take():
    """(target argmax (bs, nodes), root target entropy (bs,)) of the last verify, or None; clears it."""
    last, _STATE["last"] = _STATE["last"], None
    return last


def sample_after(result, *args, **kwargs):
    if not _STATE["enabled"]:
        return None
    verify_input = kwargs.get("verify_input", args[0] if args else None)
    logits_output = kwargs.get("logits_output", args[2] if len(args) > 2 else None)
    logits = getattr(logits_output, "next_token_logits", None)
    n = getattr(verify_input, "draft_token_num", None)
    if logits is None or not n or logits.shape[0] % n:
        return None
    rows = logits.view(logits.shape[0] // n, n, -1)
    with torch.no_grad():
        _STATE["last"] = (rows.argmax(-1).cpu(), entropy_nats(rows[:, 0].float()).cpu())
    return None


def register_hooks(check_signature) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(SAMPLE).items():
        check_signature(dotted, params)
    HookRegistry.register(SAMPLE, sample_after, HookType.AFTER)
