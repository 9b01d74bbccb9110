"""Tree choosers behind one interface (`__call__(view) -> Tree`), so comparisons differ only in policy.

* StaticPolicy       - one tree always.
* EntMTPPolicy       - signal bins -> best expected tokens per second in the tree set (which may hold
                       chain:0, no speculation), with acceptance feedback and hysteresis; one tree
                       per step for the whole batch when given the engine's observer.
* AdaptiveEMAPolicy  - SGLang's `--speculative-adaptive` rule: an EMA of accepted length picks the
                       chain depth (same constants as sglang/srt/speculative/adaptive_spec_params.py).
* OraclePolicy       - in hindsight, the best tree of the set at each step (the ceiling).
* Eagle2Policy       - EAGLE-2 style: expand a wide tree, verify the most confident nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import StepView
from ..tree import Tree
from ..tree.construct import accepted_on
from ..tree.treeset import TreeSet
from .selector import acceptance_scale, select_batch_tree, select_tree
from .signals import draft_signal, signal_value

# SGLang 0.5.23 DEFAULT_ADAPTIVE_CONFIG and AdaptiveSpecParams defaults
SGLANG_ADAPTIVE = {
    1: {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25, "up_hysteresis": 0.0},
    8: {"candidate_steps": [0, 1, 3], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
    32: {"candidate_steps": [0, 1], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
    64: {"candidate_steps": [0], "down_hysteresis": 0.0, "up_hysteresis": 0.0},
}
EMA_ALPHA, UPDATE_INTERVAL, WARMUP_BATCHES = 0.2, 5, 10
HYSTERESIS = 0.02  # EntMTP keeps its tree unless another is expected to be this much faster


# Policies keep per-request state keyed by the request's index in the batch; make a new policy object
# for each independent run. Consecutive generate calls on the same policy continue the same streams.


class StaticPolicy:
    def __init__(self, tree: Tree):
        self.tree = tree
        self.name = f"static[{tree.name}]"

    def __call__(self, view: StepView) -> Tree:
        return self.tree


@dataclass
class _RequestSums:
    """Acceptance feedback of one request (stream): sums over its verified steps."""

    accepted: float = 0.0  # drafts accepted
    expected: float = 0.0  # the tree set's E[accepted | bin, tree] for the same steps
    pending: float | None = None  # E[accepted] of the step chosen last, until its result is seen
    seen: int = 0  # steps of the current request already counted
    history: tuple = ()  # the request's step records at its last call


class EntMTPPolicy:
    """EntMTP: signal bins -> the tree with the most expected tokens per second, with acceptance feedback.

    At every step, for the active requests i (`selector.select_batch_tree`):

        bin_i   = tree_set.bin_of(signal_i)                      # the set's signal (policy/signals.py)
        scale_i = acceptance_scale(drafts i accepted so far, sum of E[accepted | bin, tree] of its steps)
        tree    = argmax_T sum_i (min(scale_i * E[accepted | bin_i, T], depth T) + 1) / cost(T, batch)
                  (the current tree is kept unless the best beats it by `hysteresis`)

    The set may hold chain:0 (no speculation), so the policy backs off to it when verification costs
    more than it returns (large batches, unpredictable text, or drafts accepted less than calibrated).

    One tree for the whole batch when the engine's observer hook is connected
    (`engine.generate(prompts, n, policy, observer=policy.observe)`): the engine pads a batch to its
    widest tree, so one request's deep tree would make every request pay for it; and the cost is that of
    all the rows the engine computes (finished requests stay in the batch until it ends). Without the
    observer, or with one request left, each request chooses from its own entropy. Target-entropy signals of the
    other requests are one step old in batch mode (their histories as of their last call)."""

    def __init__(self, tree_set: TreeSet, window: int = 8, hysteresis: float = HYSTERESIS,
                 feedback: bool = True):
        self.tree_set = tree_set
        self.window = window
        self.hysteresis = hysteresis
        self.feedback = feedback
        self.requests: dict[int, _RequestSums] = {}
        self.current: dict[int, int] = {}  # per-request choice (choosing alone)
        self.shared: int | None = None  # the batch's choice (batch mode)
        self._observed: list[float] | None = None  # this step's draft value (signal_value) per batch row
        self._active: list[int] = []
        self._rows: int | None = None  # rows the engine computes this step (finished requests included)
        self._step_choice: int | None = None
        self.name = "entmtp"

    def observe(self, state, lens, drafting, active) -> None:
        """The engine's observer: every request's drafter distribution, before any tree is chosen."""
        self._active = [i for i, a in enumerate(active) if a]
        self._rows = len(active)
        self._observed = (draft_signal(self.tree_set.signal, state.root_logits).tolist()
                          if len(self._active) > 1 else None)
        self._step_choice = None

    def scale(self, index: int) -> float:
        st = self.requests.get(index)
        if not self.feedback or st is None:
            return 1.0
        return acceptance_scale(st.accepted, st.expected)

    def _signal(self, draft: float, history) -> float:
        return signal_value(self.tree_set.signal, draft, history, self.window)

    def __call__(self, view: StepView) -> Tree:
        st = self.requests.setdefault(view.index, _RequestSums())
        if len(view.history) < st.seen:  # a new request (segment) of the same stream: keep the sums
            st.pending = None
        elif st.pending is not None and len(view.history) > st.seen:
            st.accepted += view.history[-1].accepted
            st.expected += st.pending
            st.pending = None
        st.seen, st.history = len(view.history), view.history
        ts = self.tree_set
        # a step costs what the engine computes: every row of the batch, finished requests included
        rows = self._rows or view.batch_size
        if self._observed is not None and view.index in self._active:
            if self._step_choice is None:
                signals = [self._signal(self._observed[i], self.requests[i].history if i in self.requests else ())
                           for i in self._active]
                scales = [self.scale(i) for i in self._active]
                self._step_choice = select_batch_tree(ts, signals, rows, scales, self.shared,
                                                      self.hysteresis)
                self.shared = self._step_choice
            idx = self._step_choice
            h = self._signal(self._observed[view.index], view.history)
        else:
            h = self._signal(view.draft_value(ts.signal), view.history)
            idx = select_tree(ts, h, rows, self.current.get(view.index), self.hysteresis,
                              scale=self.scale(view.index))
            self.current[view.index] = idx
        entry = ts.trees[idx]
        st.pending = entry.expected_accepted[ts.bin_of(h)]
        return entry.tree


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
