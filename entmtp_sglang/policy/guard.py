"""Speculation judged by what it delivered: a guard that makes a server rest where its speculating steps have
emitted fewer tokens per second than its resting steps, at the same batch size.

The policy chooses trees by a model: expected tokens from an acceptance predictor, seconds from a step-cost line
fitted on the server's own steps (`costs/ragged_cost.py`). Where that model is wrong (a line fitted across batch
sizes that misprices one of them, a fit from a noisy stretch, a machine whose per-row cost the set never saw) the
policy can speculate on every step of a batch size where plain decoding is faster, for the server's whole life: the
product runs saw ENTMTP below plain SGLang in a mixed batch of 8 or 16 requests more than once. The guard checks the
model against the outcome, per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, ...):

    rate(arm) = decayed sum of tokens emitted / decayed sum of seconds, over the bucket's steps of that arm
                (arm: a step that speculated, or one that rested: every row one token, spans included)
    force a rest  when both arms have `min_steps` steps and rate(speculate) < (1 - margin) * rate(rest),
                  except one step in a gap, which the policy chooses (its rate stays current); the gap starts at
                  `explore_every` and doubles at each such try while speculation keeps losing, up to
                  `max_explore_every` (a try costs what speculation loses on a step: at 4-16 requests on a CPU a
                  speculating step costs 1.3-1.9x a plain one, so a try every 8 steps alone cost ~3% there), and
                  starts again at `explore_every` once it stops losing;
    explore       a rest where the resting arm has fewer than `min_steps` steps, every `measure_rest_every`-th
                  step (a bucket where the policy never rests would otherwise never measure resting; every other
                  step, so that a fresh server judges a batch size within about 2 * `min_steps` steps: the policy's
                  step cost is fitted mostly at one request, where a verified token is nearly free, and at 4-16
                  requests on a CPU a speculating step costs 1.3-1.9x a plain one, so the policy speculating there
                  lost about 15% until the guard judged, 2026-12-07).

Selection biases it towards not interfering: the policy rests where drafts would fail (high entropy), so the
resting arm's steps are the harder ones, and a forced rest needs speculation to lose even so. What the two arms
compare is the content of the same stretch of traffic only where many requests share the steps: with one request
the arms see different content in turn (a chat request's tail against a JSON answer's run of predictable text), so
batches of fewer than `min_rows` (4) requests are left to the policy, whose step cost there is the weights' read,
the best-measured part of its model. Pure state and
arithmetic (no clocks, no SGLang): the worker feeds it each step's rows, tokens and seconds (`observe`) and asks
before each step (`force_rest`). Single rank only (wall times differ between ranks; every rank must choose alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardConfig:
    margin: float = 0.02        # speculation must deliver at least (1 - margin) of resting's rate
    min_steps: int = 4          # steps of each arm in a bucket before it judges
    explore_every: int = 8      # one step in this many goes to the arm the guard would not take
    measure_rest_every: int = 2  # ... and one in this many rests while the resting arm has too few steps to judge
    max_explore_every: int = 64  # the widest gap between tries of a losing speculation (the gap doubles per try)
    decay: float = 0.98         # per step of the arm: an arm's rate follows its last ~50 steps
    min_rows: int = 4           # batches of fewer requests are left to the policy (below)

    def __post_init__(self):
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.min_steps < 1 or self.explore_every < 2 or self.min_rows < 1 or self.measure_rest_every < 2:
            raise ValueError(f"min_steps and min_rows must be >= 1, explore_every and measure_rest_every >= 2, got "
                             f"{self.min_steps}, {self.min_rows}, {self.explore_every}, {self.measure_rest_every}")
        if self.max_explore_every < self.explore_every:
            raise ValueError(f"max_explore_every must be >= explore_every ({self.explore_every}), got "
                             f"{self.max_explore_every}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


@dataclass
class _Arm:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    speculate: _Arm = field(default_factory=_Arm)
    rest: _Arm = field(default_factory=_Arm)
    asked: int = 0          # steps the guard was asked about
    forced: int = 0         # of them, rests it forced (exploring or judging)
    gap: int = 0            # steps between tries of a losing speculation (0: not judged losing yet)
    since: int = 0          # steps asked since the last try (or since it was judged losing)


def bucket_of(rows: int) -> int:
    """The batch-size bucket: 1, 2 (2-3), 4 (4-7), 8 (8-15), ... (the largest power of two <= rows)."""
    if rows < 1:
        raise ValueError(f"a step has at least one row, got {rows}")
    return 1 << (rows.bit_length() - 1)


@dataclass
class SpeculationGuard:
    config: GuardConfig = GuardConfig()
    buckets: dict = field(default_factory=dict)   # bucket -> _Bucket

    def _bucket(self, rows: int) -> _Bucket:
        return self.buckets.setdefault(bucket_of(rows), _Bucket())

    def observe(self, rows: int, rested: bool, tokens: int, seconds: float) -> None:
        """One step of `rows` requests that emitted `tokens` in `seconds` (a step that rested or speculated)."""
        if seconds <= 0 or tokens < 0:
            return
        b = self._bucket(rows)
        (b.rest if rested else b.speculate).add(tokens, seconds, self.config.decay)

    def judged(self, rows: int) -> bool | None:
        """Whether speculation delivers less than resting at this batch size (None: too few steps of an arm)."""
        b, c = self._bucket(rows), self.config
        if b.speculate.steps < c.min_steps or b.rest.steps < c.min_steps:
            return None
        return b.speculate.rate < (1.0 - c.margin) * b.rest.rate

    def force_rest(self, rows: int) -> bool:
        """Before a step the policy would speculate on: whether to rest it instead (counted as asked). Never below
        `min_rows` requests."""
        c = self.config
        if rows < c.min_rows:
            return False
        b = self._bucket(rows)
        b.asked += 1
        verdict = self.judged(rows)
        if verdict:   # speculation loses: rest, but let it try now and then, less often the longer it loses
            if not b.gap:
                b.gap, b.since = c.explore_every, 0
            b.since += 1
            force = b.since < b.gap
            if not force:   # this step tries: the next try waits twice as long
                b.gap, b.since = min(2 * b.gap, c.max_explore_every), 0
        else:
            b.gap = b.since = 0   # measure resting where the policy (nearly) never rests
            force = verdict is None and b.rest.steps < c.min_steps and b.asked % c.measure_rest_every == 0
        b.forced += force
        return force

    def summary(self) -> dict:
        return {str(k): {"speculate_tok_s": round(b.speculate.rate, 2), "speculate_steps": b.speculate.steps,
                         "rest_tok_s": round(b.rest.rate, 2), "rest_steps": b.rest.steps, "forced": b.forced,
                         "asked": b.asked, "try_every": b.gap or None} for k, b in sorted(self.buckets.items())}
