"""Exact sampled verification for ENTMTP on CPU: SGLang's tree rejection sampling, in torch.

On CPU SGLang 0.5.23 verifies every speculative algorithm greedily (`eagle_utils._verify_uses_greedy`
returns True for `is_cpu`), because its sampling kernel (`tree_speculative_sampling_target_only`, a CUDA JIT
kernel) and the top-k / top-p renormalisations it uses (FlashInfer) have no CPU build. A sampled request
through ENTMTP on CPU would then return the argmax at every verified position: not the target distribution.

This module supplies torch versions with the CUDA kernel's semantics
(sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh, `TreeSpeculativeSamplingTargetOnly`):

* walk the tree from the root; at each accepted node one coin `u` is drawn (`uniform_samples[b, node]`) and
  the node's children are tried in sibling order, accumulating their target probabilities; the first child
  with `u < accumulated / threshold_acc` (or its own probability >= `threshold_single`) is accepted. With
  both thresholds 1 the children's intervals partition [0, sum p(children)), so child i is accepted with
  probability exactly p(child i);
* where no child is accepted, the bonus token is sampled from the target distribution with the rejected
  children's mass removed and renormalised, so every token keeps probability p. At full depth it is sampled
  from the target distribution itself.

`register_hooks` (plugin.py) makes eagle_sample take its sampling branch on CPU for ENTMTP requests only,
through the functions below; `ENTMTP_CPU_SAMPLING=0` restores SGLang's greedy verification (used by the test
that shows the greedy fallback fails the chi-square test). What stays SGLang's: `min_p` is not applied at
verification (as on GPU); with both top-k and top-p set, top-p is taken over the top-k-renormalised
distribution (FlashInfer's order, as on GPU), while SGLang's plain CPU sampler takes it over the original one.
"""

from __future__ import annotations

import torch

from ...settings import settings
from ..patches import USES_GREEDY, hooked

ENV_CPU_SAMPLING = "ENTMTP_CPU_SAMPLING"
# names eagle_utils imports from SGLang's kernel modules, which leave them None where no kernel is built (CPU)
CPU_KERNELS = ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob")


def _sample_index(weights: torch.Tensor, coin: float) -> int:
    """Inverse-CDF draw from unnormalised non-negative `weights` with one uniform `coin` in [0, 1)."""
    cdf = torch.cumsum(weights.double(), 0)
    total = float(cdf[-1])
    if not total > 0:
        return int(torch.argmax(weights))
    i = int(torch.searchsorted(cdf, torch.tensor([coin * total], dtype=cdf.dtype), right=True)[0])
    if i >= weights.numel() or weights[i] <= 0:   # rounding at the top end: the last token with mass
        i = int(torch.nonzero(weights > 0)[-1])
    return i


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Fills `predicts` (bs * n,), `accept_index` (bs, depth + 1) and `accept_token_num` (bs,) in place.

    candidates, retrive_*: (bs, n) int64, SGLang's tree encoding (first child / next sibling, -1 = none);
    uniform_samples: (bs, n) coins, one per node; target_probs: (bs, n, vocab) normalised target
    distributions after each node; draft_probs: (bs, n, vocab), zeros (target-only), written like the kernel
    (a rejected child's target probability at its parent's row)."""
    if not (0 <= threshold_single <= 1 and 0 <= threshold_acc <= 1):
        raise ValueError(f"thresholds must lie in [0, 1], got {threshold_single}, {threshold_acc}")
    threshold_acc = max(float(threshold_acc), 1e-9)
    bs, n = candidates.shape
    spec = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    coins, final = uniform_samples.tolist(), uniform_samples_for_final_sampling.tolist()
    for b in range(bs):
        row, coin, acc, num, cur = 0, coins[b][0], 0.0, 0, 0
        last = ridx[b][0]
        accept_index[b, 0] = last
        for _ in range(1, spec):
            cur = nxt[b][cur]
            while cur != -1:
                tok = cand[b][cur]
                p = float(target_probs[b, row, tok])
                acc += p
                if p > 0 and (coin < acc / threshold_acc or p >= threshold_single):
                    acc, row, coin = 0.0, cur, coins[b][cur]
                    predicts[last] = tok
                    num += 1
                    accept_index[b, num] = ridx[b][cur]
                    last = ridx[b][cur]
                    break
                draft_probs[b, row, tok] = target_probs[b, row, tok]
                cur = sib[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = num
        q = target_probs[b, row]
        residual = q if num == spec - 1 else (q - draft_probs[b, row]).clamp_(min=0)
        predicts[last] = _sample_index(residual, final[b])


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_ks[row]` largest probabilities (ties at the boundary by sort order), renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = torch.arange(probs.shape[-1], device=probs.device).view(1, -1) < top_ks.view(-1, 1).to(probs.device)
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus (a token is dropped when the mass before it exceeds `top_ps[row]`, as SGLang's
    torch sampler does), renormalised."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(sorted_p, -1) - sorted_p
    sorted_p = sorted_p.masked_fill(before > top_ps.view(-1, 1).to(probs), 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def cpu_sampling_enabled() -> bool:
    """ENTMTP_CPU_SAMPLING (settings.py): exact tree rejection sampling for sampled requests on CPU."""
    return settings().cpu_sampling


def uses_greedy_around(original, **kwargs):
    """AROUND hook of `_verify_uses_greedy`: on CPU, ENTMTP verifies sampled requests by rejection sampling."""
    from ..admission import is_entmtp

    if kwargs.get("is_cpu") and is_entmtp() and cpu_sampling_enabled():
        _install_cpu_kernels()
        kwargs = {**kwargs, "is_cpu": False}
    return original(**kwargs)


def _install_cpu_kernels() -> None:
    """The sampling kernel and FlashInfer's renormalisations are None in eagle_utils on CPU: ours fill them
    (only where None, so a platform with its own kernels keeps them)."""
    import sys

    # not a patches.py entry: fills module attributes SGLang left None (no function of SGLang's is replaced)
    mod = sys.modules["sglang.srt.speculative.eagle_utils"]
    for name in CPU_KERNELS:
        if getattr(mod, name, None) is None:
            setattr(mod, name, globals()[name])


def register_hooks(check_signature) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(USES_GREEDY).items():
        check_signature(dotted, params)
    HookRegistry.register(USES_GREEDY, uses_greedy_around, HookType.AROUND)
