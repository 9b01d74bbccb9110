"""The EntMTP selector: (entropy, batch size, tree set) -> the tree with the most expected tokens per second.

Pure functions; the policy objects that call them keep only the per-request current choice (for
hysteresis).
"""

from __future__ import annotations

from ..tree.treeset import TreeSet


def tree_values(tree_set: TreeSet, bin_index: int, batch_size: int) -> list[float]:
    """Expected tokens per second of one request, for every tree of the set, in this entropy bin."""
    return [t.tokens_per_second(bin_index, batch_size) for t in tree_set.trees]


def select_tree(tree_set: TreeSet, entropy_nats: float, batch_size: int, current: int | None = None,
                hysteresis: float = 0.0, max_nodes: int | None = None) -> int:
    """Index of the best tree for this entropy; keep `current` unless the best beats it by `hysteresis`.

        values = (expected_accepted[bin] + 1) / cost(batch_size) for each tree within max_nodes
        best = argmax(values)
        return current if values[current] * (1 + hysteresis) >= values[best] else best
    """
    b = tree_set.bin_of(entropy_nats)
    values = tree_values(tree_set, b, batch_size)
    allowed = [i for i, t in enumerate(tree_set.trees) if max_nodes is None or t.tree.num_nodes <= max_nodes]
    if not allowed:
        allowed = [min(range(len(tree_set.trees)), key=lambda i: tree_set.trees[i].tree.num_nodes)]
    best = max(allowed, key=lambda i: values[i])
    if current is not None and current in allowed and values[current] * (1 + hysteresis) >= values[best]:
        return current
    return best
