"""Tree choosers behind one interface (`__call__(view) -> Tree`), so comparisons differ only in policy.

* StaticPolicy       - one tree always.
* EntMTPPolicy       - the reference engine's side of `controller.TreeController`: signal bins or the
                       per-node acceptance predictor -> the tree with the most expected tokens per
                       second (chain:0, no speculation, included), with acceptance feedback and
                       hysteresis; one tree per step for the whole batch when given the engine's observer.
* AdaptiveEMAPolicy  - SGLang's `--speculative-adaptive` rule: an EMA of accepted length picks the
                       chain depth (same constants as sglang/srt/speculative/adaptive_spec_params.py).
* OraclePolicy       - in hindsight, the best tree of the set at each step (the ceiling).
(EAGLE-2's policy, `Eagle2Policy`, is in eagle2.py with its pruning.)
"""

from __future__ import annotations

from ..tree import Tree
from ..tree.acceptance import AcceptancePredictor
from ..tree.construct import accepted_on
from ..tree.treeset import TreeSet
from .chooser import StepView
from .controller import HYSTERESIS, MAX_REST, RequestInput, StageInput, TreeController
from .registry import ENTMTP_POLICIES, POLICIES
from .signals import draft_signal, signal_value, top_probs

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

    def rests(self, active: list[int]) -> bool:
        """chain:0 never needs the drafter (the engine's `rests` hook)."""
        return self.tree.max_depth == 0


class EntMTPPolicy:
    """EntMTP in the reference engine: the engine's step views -> `controller.TreeController`, which holds
    the policy's state (expectations from signal bins or the per-node predictor, acceptance feedback,
    hysteresis, one tree per batch step, chain:0 as the back-off).

    One tree for the whole batch when the engine's observer hook is connected
    (`engine.generate(prompts, n, policy, observer=policy.observe)`): the engine pads a batch to its
    widest tree, so one request's deep tree would make every request pay for it; and the cost is that of
    all the rows the engine computes (finished requests stay in the batch until it ends). Without the
    observer, or with one request left, each request chooses alone. Target-entropy signals of the other
    requests are one step old in batch mode (their histories as of their last call).

    Requests are keyed by their batch index; a new policy object per independent run. Consecutive generate
    calls on the same policy continue the same streams (the acceptance feedback carries over)."""

    def __init__(self, tree_set: TreeSet, window: int = 8, hysteresis: float = HYSTERESIS,
                 feedback: bool = True, predictor: AcceptancePredictor | None = None, staged: bool = False,
                 max_rest: int = MAX_REST):
        if staged and predictor is None:
            raise ValueError("staged decisions need the per-node acceptance predictor")
        self.staged = staged  # the engine calls `restage` after each drafted level
        self.tree_set = tree_set
        self.window = window
        self.controller = TreeController(tree_set, hysteresis, feedback, predictor, max_rest=max_rest)
        self._seen: dict[int, int] = {}  # request -> steps of its current segment already recorded
        self._history: dict[int, tuple] = {}  # request -> its step records at its last call
        self._observed: list[float] | None = None  # this step's draft value per batch row (batch mode)
        self._observed_probs: list[list[float]] | None = None  # this step's depth-1 top-k probabilities
        self._active: list[int] = []
        self._batched = False  # the engine's observer is connected: a batch chooses one tree together
        self._rows: int | None = None  # rows the engine computes this step (finished requests included)
        self._step_choice: int | None = None
        # request -> this step's (tree index, depth-1 draft probabilities, its nodes in the tree drafted, the
        # drafted tree's parents), for staged decisions
        self._chosen: dict[int, tuple] = {}
        self.name = "entmtp-staged" if staged else "entmtp" if predictor is None else "entmtp-predictor"

    @property
    def predictor(self) -> AcceptancePredictor | None:
        return self.controller.predictor

    def observe(self, state, lens, drafting, active) -> None:
        """The engine's observer: every request's drafter distribution, before any tree is chosen."""
        self._active = [i for i, a in enumerate(active) if a]
        self._batched = True
        self._rows = len(active)
        batch = len(self._active) > 1
        self._observed = draft_signal(self.tree_set.signal, state.root_logits).tolist() if batch else None
        self._observed_probs = (top_probs(state.root_logits).tolist()
                                if batch and self.predictor is not None else None)
        self._step_choice = None

    def scale(self, index: int) -> float:
        return self.controller.scale(index)

    def rests(self, active: list[int]) -> bool:
        """The engine's hook before a step: True when every active request (or the batch choosing together)
        is resting after a back-off to chain:0 (`TreeController.rests`), so the step decodes plainly without
        running the drafter."""
        groups = ["batch"] if self._batched and len(active) > 1 else list(active)
        return self.controller.rests(groups)

    def _signal(self, draft: float, history) -> float:
        return signal_value(self.tree_set.signal, draft, history, self.window)

    def __call__(self, view: StepView) -> Tree:
        seen = self._seen.get(view.index, 0)
        if len(view.history) < seen:  # a new request (segment) of the same stream: keep the feedback
            self.controller.record(view.index, None)
        elif len(view.history) > seen:
            self.controller.record(view.index, view.history[-1].accepted)
        self._seen[view.index] = len(view.history)
        self._history[view.index] = view.history
        # a step costs what the engine computes: every row of the batch, finished requests included
        rows = self._rows or view.batch_size
        if self._observed is not None and view.index in self._active:
            if self._step_choice is None:
                inputs = [RequestInput(i, self._signal(self._observed[i], self._history.get(i, ())),
                                       tuple(self._observed_probs[i]) if self._observed_probs else ())
                          for i in self._active]
                self._step_choice = self.controller.choose(inputs, rows)
            idx = self._step_choice
            probs = tuple(self._observed_probs[view.index]) if self._observed_probs else view.draft_probs
        else:
            mine = RequestInput(view.index, self._signal(view.draft_value(self.tree_set.signal), view.history),
                                view.draft_probs)
            idx = self.controller.choose([mine], rows, group=view.index)
            probs = view.draft_probs
        tree = self.tree_set.trees[idx].tree
        self._chosen[view.index] = (idx, probs, tuple(range(tree.num_nodes)), tree.parents)
        return tree

    def restage(self, depth: int, drafted: list[list[float | None]], drafting: list) -> dict:
        """The engine's staged decision after drafting `depth` (`Engine._draft`; `drafting[i]`: the tree request
        i is drafting, None when it is not): the requests that chose together (the batch, or each alone)
        re-choose among the prefixes of their tree (`TreeController.restage`). Returns {request: (tree, its
        nodes in the drafted tree)} for those that move to a smaller tree."""
        groups: dict[tuple, list[int]] = {}
        for i, (idx, _, image, chosen) in self._chosen.items():
            if i < len(drafting) and drafting[i] is not None and drafting[i].parents == chosen:
                key = (idx, image) if self._observed is not None and i in self._active else (idx, image, i)
                groups.setdefault(key, []).append(i)
        out = {}
        rows = self._rows or len(drafting)
        for (idx, image, *_), members in groups.items():
            inputs = [StageInput(i, self._chosen[i][1], tuple(drafted[i][m] for m in image)) for i in members]
            new, rel = self.controller.restage(idx, inputs, depth, rows)
            if new == idx:
                continue
            moved = tuple(image[m] for m in rel)
            for i in members:
                self._chosen[i] = (new, self._chosen[i][1], moved, self._chosen[i][3])
                out[i] = (self.tree_set.trees[new].tree, moved)
        return out


DEFAULT_USES_PREDICTOR = True  # `entmtp` = entmtp-predictor where the set carries a predictor (README: why)


def entmtp_policy(tree_set: TreeSet, kind: str = "entmtp", **kwargs) -> EntMTPPolicy:
    """The EntMTP policy by name (`registry.ENTMTP_POLICIES`): `entmtp-bins` (the set's signal bins),
    `entmtp-predictor` (its per-node acceptance predictor; ValueError when it carries none), `entmtp-staged`
    (the predictor, re-choosing after each drafted level) or `entmtp` (the default: the predictor when the set
    carries one and DEFAULT_USES_PREDICTOR, else the bins)."""
    if kind not in ENTMTP_POLICIES:
        raise ValueError(f"unknown EntMTP policy {kind!r}; choose from {', '.join(ENTMTP_POLICIES)}")
    info = POLICIES[kind]
    if info.predictor and tree_set.predictor is None:
        raise ValueError(f"the {tree_set.drafter}/{tree_set.task} tree set carries no acceptance predictor; refit "
                         "it with `entmtp calibrate ... --records-only`, or use entmtp-bins")
    use = info.predictor or (info.predictor is None and DEFAULT_USES_PREDICTOR)
    pred = AcceptancePredictor.from_json(tree_set.predictor) if use and tree_set.predictor is not None else None
    return EntMTPPolicy(tree_set, predictor=pred, staged=info.staged, **kwargs)


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

        self._next: dict[int, int] = {}  # request -> output index of its next step's root (known in hindsight)

    def _best(self, index: int, pos: int, batch_size: int) -> Tree:
        rows = self.ranks[index]
        if pos >= len(rows):
            return Tree.chain(0)
        r = rows[pos]
        best = max(self.tree_set.trees, key=lambda t: (accepted_on(t.tree, r) + 1) / t.cost(batch_size))
        return best.tree

    def __call__(self, view: StepView) -> Tree:
        pos = view.position - self.prompt_lens[view.index]  # index of the root in the output
        tree = self._best(view.index, pos, view.batch_size)
        rows = self.ranks[view.index]
        self._next[view.index] = pos + 1 + (accepted_on(tree, rows[pos]) if pos < len(rows) else 0)
        return tree

    def rests(self, active: list[int]) -> bool:
        """Rest the drafter on a step where, in hindsight, every request's best tree is chain:0."""
        if not active or any(i not in self._next for i in active):
            return False
        if any(self._best(i, self._next[i], len(active)).max_depth > 0 for i in active):
            return False
        for i in active:
            self._next[i] += 1
        return True
