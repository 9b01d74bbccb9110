"""Entropy signals: pure functions of what the engine already computed (no extra forward pass).

* draft_entropy  - the drafter's own entropy for the next position, for the step being drafted.
* target_window  - mean target entropy over the last `window` accepted positions (a sliding window).
* target_ema     - an exponential moving average of the same per-position target entropies.
"""

from __future__ import annotations

from typing import Sequence


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


def signal_value(kind: str, draft_entropy: float, history, window: int = 8, alpha: float = 0.3) -> float:
    """The entropy estimate (nats) that a tree set's bins refer to."""
    if kind == "draft_entropy":
        return draft_entropy
    recent = recent_target_entropies(history, window if kind == "target_window" else 4 * window)
    if kind == "target_window":
        return window_mean(recent, draft_entropy)
    if kind == "target_ema":
        return ema(recent, alpha, draft_entropy)
    raise ValueError(f"unknown entropy signal {kind!r}")
