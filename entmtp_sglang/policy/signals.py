"""Signals: pure functions of what the engine already computed (no extra forward pass), registered once.

* draft_entropy  - the drafter's own entropy for the next position, for the step being drafted.
* draft_margin   - the drafter's top-1 minus top-2 probability for the same position (high = predictable).
* target_window  - mean target entropy over the last `window` accepted positions (a sliding window; the
                   paper's signal).
* target_ema     - an exponential moving average of the same per-position target entropies.

A tree set names the signal its bins refer to; calibration keeps the one that best predicts acceptance.
Every signal is a `SignalKind` in `SIGNAL_KINDS`: its per-step draft value (from the drafter's logits) and,
for target signals, how it folds the request's recent target entropies. Nothing else switches on the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..tree.treeset import SIGNALS

EMA_ALPHA = 0.3


def entropy_nats(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of softmax(logits) in nats (masked -inf entries allowed).

    Runs the fused Triton kernel on CUDA and its torch reference elsewhere (`entmtp_sglang.kernels`)."""
    from ..kernels import softmax_entropy

    if logits.dim() == 1:
        return softmax_entropy(logits.float().unsqueeze(0))[0]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return softmax_entropy(flat).reshape(logits.shape[:-1])


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) p(top-1) - p(top-2) of softmax(logits). Masked (-inf) entries count as
    probability 0; a row with a single allowed token has margin 1."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)
    top = torch.exp(x.topk(min(2, x.shape[-1]), -1).values - lse)  # the two largest probabilities
    second = top[..., 1] if top.shape[-1] > 1 else torch.zeros_like(top[..., 0])
    return (top[..., 0] - second).nan_to_num(0.0)


def top_probs(logits: torch.Tensor, k: int = 6) -> torch.Tensor:
    """(..., V) logits -> (..., k) the k largest probabilities of softmax(logits), descending (masked
    entries count as 0; a row with nothing allowed gives zeros)."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)
    return torch.exp(x.topk(min(k, x.shape[-1]), -1).values - lse).nan_to_num(0.0)


def window_mean(values: Sequence[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def ema(values: Sequence[float], alpha: float, default: float) -> float:
    if not values:
        return default
    acc = values[0]
    for v in values[1:]:
        acc = (1 - alpha) * acc + alpha * v
    return acc


@dataclass(frozen=True)
class SignalKind:
    name: str
    draft: Callable[[torch.Tensor], torch.Tensor]   # (..., V) drafter logits -> (...) this step's draft value
    high_is_predictable: bool                       # margin: yes; entropies: no
    record_field: str                               # the calibration record's field holding the draft value
    # target signals: (recent target entropies, oldest first, this step's draft value) -> the signal
    from_history: Callable[[Sequence[float], float], float] | None = None
    history_window: int = 1                          # how many windows of history from_history reads

    @property
    def least_predictable(self) -> float:
        """The value of a request the policy knows nothing about (it lands in the last-resort bin)."""
        return -math.inf if self.high_is_predictable else math.inf


SIGNAL_KINDS: dict[str, SignalKind] = {k.name: k for k in (
    SignalKind("draft_entropy", entropy_nats, False, "draft_entropy"),
    SignalKind("draft_margin", top_margin, True, "draft_margin"),
    SignalKind("target_window", entropy_nats, False, "draft_entropy",
               lambda recent, draft: window_mean(recent, draft), 1),
    SignalKind("target_ema", entropy_nats, False, "draft_entropy",
               lambda recent, draft: ema(recent, EMA_ALPHA, draft), 4),
)}
assert tuple(SIGNAL_KINDS) == SIGNALS, "tree/treeset.py's SIGNALS must list the registered signal kinds"


def signal_kind(name: str) -> SignalKind:
    try:
        return SIGNAL_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; expected one of {tuple(SIGNAL_KINDS)}") from None


def draft_signal(kind: str, logits: torch.Tensor) -> torch.Tensor:
    """The per-row draft value a tree set of signal `kind` needs from the drafter's logits: the margin
    for draft_margin, otherwise the entropy (target signals fall back to it before any history)."""
    return signal_kind(kind).draft(logits)


def least_predictable(kind: str) -> float:
    """The signal value of a request the policy knows nothing about (it lands in the last-resort bin)."""
    return signal_kind(kind).least_predictable


def recent_target_entropies(history, window: int) -> list[float]:
    """The last `window` per-position target entropies from a request's step records (oldest first)."""
    out: list[float] = []
    for step in reversed(history):
        for e in reversed(step.target_entropy):
            out.append(e)
            if len(out) >= window:
                return out[::-1]
    return out[::-1]


def signal_value(kind: str, draft: float, history, window: int = 8) -> float:
    """The value a tree set's bins refer to. `draft` is `draft_signal(kind, ...)` for this step: the
    drafter's entropy (nats), or its margin for draft_margin."""
    k = signal_kind(kind)
    if k.from_history is None:
        return draft
    return k.from_history(recent_target_entropies(history, k.history_window * window), draft)


def recorded_signal(kind: SignalKind, record, earlier_target_entropies: Sequence[float], window: int) -> float:
    """The signal at a calibration record, from what the engine knew at that step: the record's draft value
    and the target entropies of the positions before it (oldest first)."""
    draft = getattr(record, kind.record_field)
    if kind.from_history is None:
        return draft
    span = kind.history_window * window
    return kind.from_history(list(earlier_target_entropies[-span:]), draft)
