"""Tree choosers behind one interface (`__call__(view) -> Tree`), so comparisons differ only in policy.

* StaticPolicy       - one tree always.
* EntMTPPolicy       - entropy bin -> best expected tokens per second in the tree set, with hysteresis.
* AdaptiveEMAPolicy  - SGLang's `--speculative-adaptive` rule: an EMA of accepted length picks the
                       chain depth (same constants as sglang/srt/speculative/adaptive_spec_params.py).
* OraclePolicy       - in hindsight, the best tree of the set at each step (the ceiling).
* Eagle2Policy       - EAGLE-2 style: expand a wide tree, verify the most confident nodes.
"""

from __future__ import annotations

from ..engine.engine import StepView
from ..tree import Tree
from ..tree.construct import accepted_on
from ..tree.treeset import TreeSet
from .selector import select_tree
from .signals import signal_value

# SGLang 0.5.23 DEFAULT_ADAPTIVE_CONFIG and AdaptiveSpecParams defaults
SGLANG_ADAPTIVE = {
    1: {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25, "up_hysteresis": 0.0},
    8: {"candidate_steps": [0, 1, 3], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
    32: {"candidate_steps": [0, 1], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
    64: {"candidate_steps": [0], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
}
EMA_ALPHA, UPDATE_INTERVAL, WARMUP_BATCHES = 0.2, 5, 10


# Policies keep per-request state keyed by the request's index in the batch; make a new policy object
# for each independent run. Consecutive generate calls on the same policy continue the same streams.


class StaticPolicy:
    def __init__(self, tree: Tree):
        self.tree = tree
        self.name = f"static[{tree.name}]"

    def __call__(self, view: StepView) -> Tree:
        return self.tree


class EntMTPPolicy:
    def __init__(self, tree_set: TreeSet, window: int = 8, hysteresis: float = 0.05):
        self.tree_set = tree_set
        self.window = window
        self.hysteresis = hysteresis
        self.current: dict[int, int] = {}
        self.name = "entmtp"

    def __call__(self, view: StepView) -> Tree:
        h = signal_value(self.tree_set.signal, view.draft_entropy, view.history, self.window)
        idx = select_tree(self.tree_set, h, view.batch_size, self.current.get(view.index), self.hysteresis)
        self.current[view.index] = idx
        return self.tree_set.trees[idx].tree


class AdaptiveEMAPolicy:
    """Per request (at batch 1 identical to SGLang's per-batch rule); chains only, as in SGLang."""

    def __init__(self, max_depth: int, batch_size: int = 1, initial_steps: int = 3):
        bucket = max(b for b in SGLANG_ADAPTIVE if b <= max(1, batch_size))
        cfg = SGLANG_ADAPTIVE[bucket]
        self.candidates = sorted({min(s, max_depth) for s in cfg["candidate_steps"]})
        self.down, self.up = cfg["down_hysteresis"], cfg["up_hysteresis"]
        self.initial_steps = initial_steps
        self.state: dict[int, dict] = {}
        self.name = "adaptive-ema"

    def _fresh(self) -> dict:
        c = self.candidates
        steps = self.initial_steps if self.initial_steps in c else c[len(c) // 2]
        return {"steps": steps, "ema": float(steps - 1), "count": 0, "seen": 0}

    def __call__(self, view: StepView) -> Tree:
        st = self.state.setdefault(view.index, self._fresh())
        if len(view.history) < st["seen"]:  # a new segment of the same stream: keep the EMA
            st["seen"] = 0
        for rec in view.history[st["seen"]:]:
            self._update(st, rec.accepted)
        st["seen"] = len(view.history)
        return Tree.chain(st["steps"])

    def _update(self, st: dict, accepted: int) -> None:
        if st["steps"] > 0:
            st["ema"] = (1 - EMA_ALPHA) * st["ema"] + EMA_ALPHA * accepted
        st["count"] += 1
        if st["count"] <= WARMUP_BATCHES or (st["count"] - WARMUP_BATCHES) % UPDATE_INTERVAL:
            return
        c = self.candidates
        idx = old = c.index(st["steps"])
        if st["steps"] == 0:
            idx = min(idx + 1, len(c) - 1)
            if c[idx] > 0 and st["ema"] < 0:
                st["ema"] = float(c[idx] - 1)
            st["steps"] = c[idx]
            return
        while idx > 0:
            drop = (0.5 if c[idx - 1] == 0 else c[idx - 1] - 0.5) + self.down
            if st["ema"] <= drop:
                idx -= 1
            else:
                break
        if idx == old:
            while idx < len(c) - 1 and st["ema"] > c[idx] - 0.5 + self.up:
                idx += 1
        st["steps"] = c[idx]


class OraclePolicy:
    """Knows, for each request and generated position, the rank vector of the true continuation."""

    def __init__(self, tree_set: TreeSet, ranks: list[list[list[int]]], prompt_lens: list[int]):
        self.tree_set = tree_set
        self.ranks = ranks
        self.prompt_lens = prompt_lens
        self.name = "oracle"

    def __call__(self, view: StepView) -> Tree:
        pos = view.position - self.prompt_lens[view.index]  # index of the root in the output
        rows = self.ranks[view.index]
        if pos >= len(rows):
            return Tree.chain(0)
        r = rows[pos]
        best = max(self.tree_set.trees,
                   key=lambda t: (accepted_on(t.tree, r) + 1) / t.cost(view.batch_size))
        return best.tree


class Eagle2Policy:
    """EAGLE-2 style: draft a wide tree, keep the `keep` nodes with the best cumulative draft
    confidence (the engine prunes after drafting, before verification)."""

    def __init__(self, wide: Tree, keep: int):
        from ..engine.engine import DynamicTree

        self.tree = DynamicTree(wide, keep)
        self.name = f"eagle2[{wide.num_nodes}->{keep}]"

    def __call__(self, view: StepView):
        return self.tree
