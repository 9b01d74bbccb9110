"""The EntMTP selector: (signal, batch size, tree set) -> the tree with the most expected tokens per second.

The signal is whatever the tree set's bins refer to (`policy/signals.py`): the drafter's entropy, its
top-1 margin, or a window of target entropy.

Pure functions; the policy objects that call them keep only per-request sums and the current choice.

A tree set holds "no speculation" (chain:0: one token per target pass, nothing accepted) like any other
tree, with its measured cost, so the selector backs off to it whenever no tree pays for its verification.
Costs are per *batch* step: the engine pads a batch to its widest tree, so a batch is best served by one
tree chosen for all of its requests (`select_batch_tree`).
"""

from __future__ import annotations

from typing import Sequence

from ..tree.acceptance import AcceptancePredictor
from ..tree.treeset import TreeSet

# Acceptance feedback (`acceptance_scale`): a request's realized accepted drafts over the tree set's
# expectation for the same steps, with FEEDBACK_PRIOR expected drafts of pseudo-evidence for 1.0, clipped.
FEEDBACK_PRIOR = 2.0
SCALE_MIN, SCALE_MAX = 0.25, 2.0


def acceptance_scale(accepted: float, expected: float, prior: float = FEEDBACK_PRIOR,
                     lo: float = SCALE_MIN, hi: float = SCALE_MAX) -> float:
    """How much of the calibrated expectation this request really gets:

        clip((accepted + prior) / (expected + prior), lo, hi)

    accepted: drafts it accepted so far; expected: the sum of E[accepted | bin, tree] over the same
    steps (for the trees it ran). No history gives 1.0."""
    if prior <= 0 or lo > hi:
        raise ValueError(f"need prior > 0 and lo <= hi, got prior={prior}, lo={lo}, hi={hi}")
    return min(hi, max(lo, (accepted + prior) / (expected + prior)))


def tree_values(tree_set: TreeSet, bin_index: int, batch_size: int) -> list[float]:
    """Expected tokens per second of one request, for every tree of the set, in this signal bin."""
    return [t.tokens_per_second(bin_index, batch_size) for t in tree_set.trees]


def binned_expected(tree_set: TreeSet, signal: float) -> list[float]:
    """E[accepted | bin of `signal`, T] for every tree T of the set (the set's calibrated table)."""
    b = tree_set.bin_of(signal)
    return [t.expected_accepted[b] for t in tree_set.trees]


def predicted_expected(tree_set: TreeSet, predictor: AcceptancePredictor, probs) -> list[float]:
    """E[accepted | draft probabilities, T] for every tree T of the set, from the per-node predictor
    (`probs[d]`: the top-k draft probabilities known at depth d + 1; at least depth 1)."""
    return [predictor.expected_accepted(t.tree, probs) for t in tree_set.trees]


def batch_tokens(tree_set: TreeSet, expected: Sequence[Sequence[float]],
                 scales: Sequence[float] | None = None) -> list[float]:
    """Expected tokens of one batch step if every request runs tree T, for each T:

        tokens[T] = sum_i min(scale_i * expected_i[T], depth(T)) + 1

    expected_i: one request's E[accepted] per tree (`binned_expected` or `predicted_expected`)."""
    scales = [1.0] * len(expected) if scales is None else scales
    if len(scales) != len(expected):
        raise ValueError(f"{len(expected)} requests but {len(scales)} acceptance scales")
    return [sum(min(s * e[k], t.tree.max_depth) + 1.0 for e, s in zip(expected, scales))
            for k, t in enumerate(tree_set.trees)]


def batch_values(tree_set: TreeSet, expected: Sequence[Sequence[float]], batch_size: int,
                 scales: Sequence[float] | None = None) -> list[float]:
    """Expected tokens per second of the whole batch if every request runs tree T, for each T:

        values[T] = tokens[T] / cost(T, batch_size)        (tokens from `batch_tokens`)
    """
    tokens = batch_tokens(tree_set, expected, scales)
    return [k / t.cost(batch_size) for k, t in zip(tokens, tree_set.trees)]


def _allowed(tree_set: TreeSet, max_nodes: int | None) -> list[int]:
    allowed = [i for i, t in enumerate(tree_set.trees) if max_nodes is None or t.tree.num_nodes <= max_nodes]
    return allowed or [min(range(len(tree_set.trees)), key=lambda i: tree_set.trees[i].tree.num_nodes)]


def select_by_expected(tree_set: TreeSet, expected: Sequence[Sequence[float]], batch_size: int,
                       scales: Sequence[float] | None = None, current: int | None = None,
                       hysteresis: float = 0.0, max_nodes: int | None = None) -> int:
    """Index of the one tree for a whole batch step (chain:0, if in the set, means no speculation):

        values = batch_values(expected, batch_size, scales)      # over trees within max_nodes
        best = argmax(values)
        return current if values[current] * (1 + hysteresis) >= values[best] else best
    """
    if not expected:
        raise ValueError("the selector needs the expectations of at least one request")
    values = batch_values(tree_set, expected, batch_size, scales)
    allowed = _allowed(tree_set, max_nodes)
    best = max(allowed, key=lambda i: values[i])
    if current is not None and current in allowed and values[current] * (1 + hysteresis) >= values[best]:
        return current
    return best


def select_batch_tree(tree_set: TreeSet, signals: Sequence[float], batch_size: int,
                      scales: Sequence[float] | None = None, current: int | None = None,
                      hysteresis: float = 0.0, max_nodes: int | None = None) -> int:
    """`select_by_expected` with each request's expectations from its signal bin (`binned_expected`)."""
    if not signals:
        raise ValueError("select_batch_tree needs the signal of at least one request")
    return select_by_expected(tree_set, [binned_expected(tree_set, h) for h in signals], batch_size, scales,
                              current, hysteresis, max_nodes)


def select_tree(tree_set: TreeSet, signal: float, batch_size: int, current: int | None = None,
                hysteresis: float = 0.0, max_nodes: int | None = None, scale: float = 1.0) -> int:
    """Index of the best tree for one request's signal (`select_batch_tree` for a batch of one):

        values = (min(scale * expected_accepted[bin], depth) + 1) / cost(batch_size) for each tree
        best = argmax(values)
        return current if values[current] * (1 + hysteresis) >= values[best] else best
    """
    return select_batch_tree(tree_set, [signal], batch_size, [scale], current, hysteresis, max_nodes)


def speculation_pays(tree_set: TreeSet, batch_size: int, plain_seconds: float) -> bool:
    """Whether some tree of the set, in some signal bin, is expected to produce more tokens per second
    than decoding without a drafter at all (one token per `plain_seconds` step) at this batch size.

    When it does not, a server should not even run the drafter: every step would choose chain:0 and
    still pay for the drafter's first head."""
    if plain_seconds <= 0:
        raise ValueError(f"plain_seconds must be positive, got {plain_seconds}")
    plain = 1.0 / plain_seconds
    return any(v > plain for b in range(tree_set.num_bins) for v in tree_values(tree_set, b, batch_size))
