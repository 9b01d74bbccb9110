"""What a decode step took, into what prices the next ones: a listener the worker calls once per timed step.

Three consumers, each optional (single-rank servers only: wall times differ between tensor-parallel ranks, and every
rank must choose the same tree):
- the per-tree step costs of the tree set (`OnlineCalibration`), refitted every `COST_REFIT_EVERY` steps;
- the cost of a ragged step (tokens verified, draft levels, rows: `OnlineRaggedCost`), which prices every step the
  policy compares once fitted (`TreeController.set_ragged_cost`);
- the guard (`SpeculationGuard`): a batch size where speculating steps delivered fewer tokens per second than
  resting ones rests. A step's tokens are known only once SGLang reports its acceptance (`observe_tokens`).
And the calibration recorder (`StepObserver`, `ENTMTP_RECORD` or online recalibration), which refits the tree set.

A failure in any of them stops that consumer, never a request.
"""

from __future__ import annotations

import logging

from ..costs.online import OnlineCalibration
from ..costs.ragged_cost import MIN_POINTS, PRIOR_MIN_POINTS, OnlineRaggedCost, resting_seconds, set_ragged_prior
from ..policy.guard import SpeculationGuard
from ..tree.acceptance import AcceptancePredictor
from . import observe
from .recording import StepObserver
from .step import StepDecision

logger = logging.getLogger("entmtp_sglang.sglang")

COST_REFIT_EVERY = 32   # decode steps between refits of the step costs timed in this server


class StepTiming:
    """The worker's timing listener. `controller`: the policy's `TreeController` (its tree set and ragged cost are
    replaced at each refit)."""

    def __init__(self, config, tree_set, controller, tp_size: int):
        self.controller = controller
        single = tp_size == 1
        # calibration through SGLang: records of verified steps (ENTMTP_RECORD) and, with no tree set for this
        # model, online refits of the generic set's predictor and costs (recording.py); with more than one rank the
        # online refit keeps the set's costs and learns acceptance only (identical logits)
        self.observer = StepObserver.for_worker(config, tree_set, timed=single)
        if self.observer is not None:
            observe.enable()
        # per-tree step costs timed in this server, unless the observer already refits them with the predictor
        online = self.observer is not None and self.observer.online is not None
        self.costs = (OnlineCalibration(tree_set, refit_every=COST_REFIT_EVERY)
                      if config.online_costs and single and not online else None)
        # the cost of a ragged step fitted on this server's own ragged and resting steps; the policy prices ragged
        # steps by it once fitted (the set's per-tree costs until then)
        prior = set_ragged_prior(tree_set)
        self.ragged_costs = (OnlineRaggedCost(prior=prior, refit_every=COST_REFIT_EVERY,
                                              min_points=PRIOR_MIN_POINTS if prior is not None else MIN_POINTS)
                             if config.online_costs and single else None)
        # speculation judged by what it delivered (policy/guard.py)
        self.guard = SpeculationGuard() if config.guard and single and self.observer is None else None
        self._guard_step: tuple | None = None   # (rows, resting, seconds) of the step whose tokens are not counted yet

    def step_done(self, batch, step: StepDecision, seconds: float, choosing: float = 0.0) -> None:
        """A decode step ran in `seconds`: into the recorder, the step costs and the guard's pending step.
        `choosing`: the seconds its decision took before it (the policy, and the drafter's catch-up over positions
        a rest owed it, which a step that resumes speculating pays): the guard judges a step by all it cost, so
        that speculating is charged what resting saves; the step costs keep the step alone (what a tree costs)."""
        rows = len(batch.reqs)
        if self.observer is not None:
            self._record(batch, step, seconds)
        try:
            if self.costs is not None and step.chosen is not None and step.ragged is None:
                self._time_step(step, rows, seconds)   # (a ragged step is not its shape tree's full step)
            if self.ragged_costs is not None:
                self._time_ragged(step, rows, seconds)
            if self.guard is not None:   # observed once the scheduler reports what it accepted
                self._guard_step = (rows, step.resting, seconds + max(choosing, 0.0))
        except Exception:   # timing must never fail a request: the server keeps the costs it has
            logger.exception("ENTMTP: timing a step failed; online step costs stop")
            self.costs = self.ragged_costs = None

    def observe_tokens(self, tokens: int | None) -> None:
        """The last timed step into the guard, with the tokens it emitted (None: unknown, one a row)."""
        pending, self._guard_step = self._guard_step, None
        if pending is not None and self.guard is not None:
            rows, resting, seconds = pending
            self.guard.observe(rows, resting, rows if tokens is None else tokens, seconds)

    def force_rest(self, rows: int) -> bool:
        """Whether the guard rests a step of `rows` requests (speculation delivered less than resting there)."""
        return self.guard is not None and self.guard.force_rest(rows)

    def _record(self, batch, step: StepDecision, seconds: float) -> None:
        obs = self.observer
        try:
            ragged = (step.ragged.total_tokens, step.num_steps) if step.ragged is not None and step.drafts else None
            obs.step(batch.reqs, step.plan, step.chosen, seconds, observe.take(), ragged)
            if obs.online is not None and obs.online.due():
                ts = obs.online.refit()
                self.controller.tree_set = ts
                self.controller.predictor = AcceptancePredictor.from_json(ts.predictor)
                logger.info("ENTMTP online calibration (refit %d, %d steps): %s", obs.online.refits,
                            obs.online.steps, obs.online.summary())
        except Exception:   # observing must never fail a request
            logger.exception("ENTMTP: recording a verified step failed; recording stops")
            self.observer = None

    def _time_step(self, step: StepDecision, rows: int, seconds: float) -> None:
        costs = self.costs
        costs.observe_time(step.chosen, rows, seconds)
        if costs.due():
            self.controller.tree_set = costs.refit_costs()
            logger.info("ENTMTP step costs timed in this server (%d steps): %s", costs.steps, costs.summary())

    def _time_ragged(self, step: StepDecision, rows: int, seconds: float) -> None:
        """A speculating step (the tokens it verified and its draft levels: a ragged step's rows their own node
        counts, a step where every row took the shape's tree N a row) or a resting step (one token a row, no
        levels) into the online ragged cost, which prices every step the policy compares (ragged or not); at each
        refit the policy takes the new fit (`TreeController.set_ragged_cost`)."""
        rc = self.ragged_costs
        if step.resting and step.ragged is not None:   # a resting step whose rows took spans: timed as the plain
            # step it would have been, its span tokens taken off at the fit's per-token price (`resting_seconds`),
            # and counted in any case, so that a fit from a slow stretch is forgotten while the policy rests (a mixed
            # batch's resting steps nearly all take spans: uncounted, a stale fit priced every step of a server's
            # life; untimed, the plain regime stayed the set's prior, 2026-12-06)
            rc.observe(rows, 0, rows, resting_seconds(seconds, step.ragged.total_tokens - rows, rc.cost))
        elif step.drafts:
            tokens = step.ragged.total_tokens if step.ragged is not None else rows * step.num_nodes
            rc.observe(tokens, step.num_steps, rows, seconds)
        else:   # a resting or plain step: one token a row
            rc.observe(rows, 0, rows, seconds)
        if rc.due():
            had = rc.cost is not None
            cost = rc.refit()
            self.controller.set_ragged_cost(cost)
            if cost is not None:
                logger.info("ENTMTP ragged step cost timed in this server (%d steps): %s", rc.steps, cost.to_json())
            if self.guard is not None:
                logger.info("ENTMTP delivered tokens/s by batch size, speculating vs resting (rests forced): %s",
                            self.guard.summary())
            elif had:
                logger.info("ENTMTP ragged step cost: this server's timed points forgotten (none in the last %d "
                            "steps); priced by the tree set's line again", rc.stale_refits * rc.refit_every)
