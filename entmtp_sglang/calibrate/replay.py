"""Replaying recorded calibration positions under a policy, without decoding (the benchmarks' policy studies)."""

from __future__ import annotations

from ..tree.construct import accepted_on
from ..tree.records import PositionRecord


def simulate(records: list[PositionRecord], choose) -> tuple[int, int, float]:
    """Replay greedy decoding of recorded positions with a policy `choose(record, history) -> TreeEntry`.

    Returns (tokens, steps, seconds) using each tree's measured batch-1 cost."""
    by_prompt: dict[int, list[PositionRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt, []).append(r)
    tokens = steps = 0
    seconds = 0.0
    for rows in by_prompt.values():
        pos, history = 0, []
        while pos < len(rows):
            entry = choose(rows[pos], history)
            a = accepted_on(entry.tree, rows[pos].ranks)
            a = min(a, len(rows) - pos - 1) if pos + a >= len(rows) else a
            history.append((rows[pos], a))
            tokens += a + 1
            steps += 1
            seconds += entry.cost(1)
            pos += a + 1
    return tokens, steps, seconds
