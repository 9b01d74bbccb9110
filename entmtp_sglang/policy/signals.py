"""Signals: pure functions of what the engine already computed (no extra forward pass).

* draft_entropy  - the drafter's own entropy for the next position, for the step being drafted.
* draft_margin   - the drafter's top-1 minus top-2 probability for the same position (high = predictable).
* target_window  - mean target entropy over the last `window` accepted positions (a sliding window).
* target_ema     - an exponential moving average of the same per-position target entropies.

A tree set names the signal its bins refer to; calibration keeps the one that best predicts acceptance.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..engine.sampling import entropy_nats, top_margin
from ..tree.treeset import SIGNALS


def draft_signal(kind: str, logits: torch.Tensor) -> torch.Tensor:
    """The per-row draft value a tree set of signal `kind` needs from the drafter's logits: the margin
    for draft_margin, otherwise the entropy (target signals fall back to it before any history)."""
    if kind not in SIGNALS:
        raise ValueError(f"unknown signal {kind!r}; expected one of {SIGNALS}")
    return top_margin(logits) if kind == "draft_margin" else entropy_nats(logits)


def least_predictable(kind: str) -> float:
    """The signal value of a request the policy knows nothing about (it lands in the last-resort bin)."""
    return -math.inf if kind == "draft_margin" else math.inf


def recent_target_entropies(history, window: int) -> list[float]:
    """The last `window` per-position target entropies from a request's step records (oldest first)."""
    out: list[float] = []
    for step in reversed(history):
        for e in reversed(step.target_entropy):
            out.append(e)
            if len(out) >= window:
                return out[::-1]
    return out[::-1]


def window_mean(values: Sequence[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def ema(values: Sequence[float], alpha: float, default: float) -> float:
    if not values:
        return default
    acc = values[0]
    for v in values[1:]:
        acc = (1 - alpha) * acc + alpha * v
    return acc


def signal_value(kind: str, draft: float, history, window: int = 8, alpha: float = 0.3) -> float:
    """The value a tree set's bins refer to. `draft` is `draft_signal(kind, ...)` for this step: the
    drafter's entropy (nats), or its margin for draft_margin."""
    if kind in ("draft_entropy", "draft_margin"):
        return draft
    recent = recent_target_entropies(history, window if kind == "target_window" else 4 * window)
    if kind == "target_window":
        return window_mean(recent, draft)
    if kind == "target_ema":
        return ema(recent, alpha, draft)
    raise ValueError(f"unknown signal {kind!r}; expected one of {SIGNALS}")
