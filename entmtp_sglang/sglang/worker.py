"""The ENTMTP worker: SGLang's EAGLEWorkerV2 drafting, per decode step, each request its own tree of a tree set.

SGLang verifies one `draft_token_num` per batch (a strided `bs x N` layout), so the rows of one step share a
shape: N nodes each, and the draft levels of the deepest row's tree. Within it every request drafts its own tree.
A decode step is a pipeline over one frozen record of its decision (step.py `StepDecision`): the rules that rest a
step (`rest_rule`: penalties, positions owed to the drafter, caught up by `_catch_up`), the policy's choice
(`choose_trees`) laid out on the server's tree indices (`lay_out`), applied once (`_apply`: runtime state, the draft
backend's rows, telemetry); the drafter (`_draft_forward_tree`), verification (`verify`, `_ragged_forward`) and the
step's timing read that record and nothing else of the choice (forced spans replace it with their wider layout).

Per step:
1. signal: each request's draft signal (the tree set's: entropy, or top-1 margin; policy/signals.py) of
   its next root distribution, computed from the logits the draft-extend pass already produced (no extra
   forward). For a request under a grammar (`json_schema`, `regex`, `ebnf`) it is taken over the tokens
   the grammar allows next (grammar_draft.py);
2. `TreeController.choose_rows` (policy/controller.py, over policy/budget.py's `allocate_shared`: the same
   policy object as the reference engine's, with per-request acceptance feedback, hysteresis, pins and room)
   picks, per request, the tree of the step's node count expecting the most tokens for it, and the node count
   and depth for the most expected tokens per second of the whole step; chain:0 for every request means this
   step decodes without speculation. `ENTMTP_PER_ROW_TREES=0` (or recording, `ENTMTP_RECORD`) goes back to
   one tree for the batch (`TreeController.choose`). The shape's node count becomes this step's
   `speculative_num_draft_tokens`, its depth `speculative_num_steps` (shapes.py: one runtime state each);
3. the draft expands each row's tree level by level on per-row indices gathered by tree id on device
   (tree_index.py `ShapeIndex`/`draft_rows`); each drafted node attends exactly to its ancestors, via
   `entmtp_torch`'s per-row draft slots. A constrained request's drafts are the top-k among the tokens its
   grammar allows after the node's path in its own tree. The draft hands SGLang the same candidate encoding
   EAGLE uses, one `parent_list`/`selected` per row, so verification, acceptance, KV compaction and grammar
   walking are SGLang's own code.

With ragged verify (ragged.py; on unless `ENTMTP_RAGGED=0`, with the `entmtp_torch` target backend, logged at
start-up) rows of one step verify their own node counts, down to a resting row (chain:0: its root alone) inside a
speculating step: `TreeController.choose_ragged` (`budget.allocate_ragged`) prices a step by the tokens it verifies,
each row's tree is padded into the step's shape, the padding unlinked from SGLang's verify lists (`verify`), and the
target's verify forward runs the real tokens only (`_ragged_forward`). A resting row's drafter runs SGLang's draft
extend with the rest, so it needs no catch-up; a penalised request rests as such a row (SGLang applies penalties to
each row's root as plain decoding does, one token per step); a step where every row rests keeps the resting path.

With ragged verify, forced spans (forced_draft.py; on unless `ENTMTP_FORCED_SPANS=0`, logged at start-up): after the
draft, `verify` hangs into a constrained row's tree the text its grammar decides (`_forced_spans`), in extra columns
of the step's verify (N' wide for the verify and the draft extend, back to N after the step); the policy's feedback
counts at most the drafted depth.

Decisions depend only on logits and accepted counts, which are identical on every tensor-parallel rank,
and on the batch size, so every rank picks the same trees (online calibration, below, refits step costs from
timed steps only in a single-rank server: wall times differ between ranks).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ..calibrate.online import OnlineCalibration
from ..calibrate.ragged_cost import (
    MIN_POINTS,
    PRIOR_MIN_POINTS,
    OnlineRaggedCost,
    resting_seconds,
    set_ragged_prior,
)
from ..policy.controller import RequestInput, TreeController
from ..policy.guard import SpeculationGuard
from ..policy.signals import draft_signal, least_predictable, top_probs
from ..tree.acceptance import AcceptancePredictor
from . import grammar_draft, observe, visibility
from .config import ENV_PROFILE, ENV_TREE_TRACE, EntMtpConfig, pin_of
from .cpu import linear as cpu_linear
from .cpu.attention import NAME as ATTENTION_NAME
from .cpu.attention import RAGGED_ATTR, MultiStepDraftBackend, TorchTreeAttnBackend
from .forced_draft import ForcedDraft, ForcedStep, token_threshold
from .patches import patch_instance
from .ragged import scatter_rows
from .recording import StepObserver
from .sglang_api import (
    EAGLEWorkerV2,
    ForwardContext,
    ForwardMode,
    SpecRuntimeState,
    draft_contexts,
    forward_context,
    get_context,
    get_parallel,
    per_step_draft_out_cache_loc,
)
from .shapes import Shape, ShapeStates
from .step import REST, StepDecision, choose_trees, lay_out, ragged_shapes, rest_rule, shape_trees, step_mode
from .telemetry import StepTelemetry, trace_path
from .tree_index import ShapeIndex, TreeIndex, draft_rows, draft_tree
from .tree_plan import plan_tree

logger = logging.getLogger("entmtp_sglang.sglang")


class _Rest(Exception):
    """This step decodes without speculation and without the drafter, by rule (not an error)."""


ENV_RAGGED = "ENTMTP_RAGGED"   # "0": every row of a speculating step verifies the step's N nodes (no resting rows)
ENV_REST_SPANS = "ENTMTP_REST_SPANS"   # "0": a resting step verifies its roots alone (no forced or lookup spans)
MAX_PENDING = 16   # rested positions a request may owe the drafter before a catch-up runs regardless (at least the
                   # longest rest plus one: penalised batches rest to their end)
COST_REFIT_EVERY = 32   # decode steps between refits of the step costs timed in this server


def needs_plain_decoding(reqs) -> bool:
    """Whether some request of the batch must decode one token per step to match plain decoding.

    SGLang applies frequency, presence and repetition penalties and min_new_tokens "relaxed" under
    speculation: one penalty row for every node of a tree, and one counted token per step, so a penalised
    greedy request's output differs from the non-speculative server's. Decoded one token per step from its
    first decode step it is exact: with ragged verify as a resting row of a speculating step, else (SGLang verifies
    one node count per batch) the whole batch decodes plainly."""
    for r in reqs:
        if penalised(r):
            return True
        sp = getattr(r, "sampling_params", None)
        if sp is not None and (getattr(sp, "min_new_tokens", 0) or 0) > len(getattr(r, "output_ids", ()) or ()):
            return True
    return False


def penalised(req) -> bool:
    """Whether the request carries a frequency, presence or repetition penalty: it decodes plainly to its end, so
    its drafter is never needed again (min_new_tokens, by contrast, ends)."""
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return False
    return ((getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0
            or (getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0
            or (getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0)


class EntMtpWorker(EAGLEWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.config = EntMtpConfig.from_server_args(server_args)
        self.tree_set = self.config.load_tree_set()
        # Each tree is laid out with its own depth as SGLang's num_steps: the accept buffers are
        # num_steps + 1 wide and must not exceed the tree's node count.
        self.plans = [plan_tree(t.tree, self.topk, t.tree.max_depth) for t in self.tree_set.trees]
        # every index tensor a tree's draft needs, built once per tree on the server's device
        self.indices = [TreeIndex.build(p, target_worker.model_runner.device) for p in self.plans]
        # each request its own tree (ENTMTP_PER_ROW_TREES, default on): per shape of the set (D levels, N nodes),
        # every tree of N nodes and depth <= D laid out on D draft steps and stacked, gathered by tree id per row
        trees = [t.tree for t in self.tree_set.trees]
        self._rest_tree = next((i for i, t in enumerate(trees) if t.num_nodes == 1), None)
        self.ragged = self._ragged_verify(server_args, target_worker)
        self.shape_index = (ShapeIndex.for_trees(trees, self.topk, target_worker.model_runner.device,
                                                 ragged=self.ragged) if self.config.per_row else {})
        # ragged: the shapes a step may run in, smallest first: (levels D, nodes N) -> (D, the trees a row may take)
        self._shapes = ragged_shapes(self.shape_index) if self.ragged else {}
        self._shape_tree = shape_trees(trees)
        # forced spans (forced_draft.py; ENTMTP_FORCED_SPANS): the grammar's text below constrained rows' leaves
        self.forced = ForcedDraft.for_worker(server_args.tokenizer_path or server_args.model_path,
                                             target_worker.model_config.vocab_size, self.ragged, self.topk)
        self._forced_step: ForcedStep | None = None     # this step's spans, until SGLang reports its acceptance
        self._forced_width: int | None = None           # the width the step's forced spans widened (restored after)
        self._rest_spans_on = os.environ.get(ENV_REST_SPANS, "1").strip() != "0"
        self.signal = self.tree_set.signal         # draft_entropy or draft_margin (config checks)
        self.controller = TreeController.for_tree_set(self.tree_set, self.config.policy != "entmtp-bins",
                                                      hysteresis=self.config.hysteresis,
                                                      max_nodes=self.config.max_nodes, max_rest=self.config.max_rest)
        self.signals: dict[str, float] = {}        # rid -> latest draft signal value
        self.probs: dict[str, tuple] = {}          # rid -> latest depth-1 top-k draft probabilities
        # this step's decision (step.py): what every part of a decode step reads; before the first, the last tree's
        self._step = StepDecision(self.plans[-1], self.indices[-1], None, False, self.plans[-1].tree.name, ())
        self._index_by_name = {t.tree.name: i for i, t in enumerate(self.tree_set.trees)}
        self._warned: set = set()
        self._last_extend = None
        self._step_reqs: list = []
        self._root_logits: dict[str, torch.Tensor] = {}   # rid -> draft root logits, constrained requests
        # calibration through SGLang: records of verified steps (ENTMTP_RECORD) and, with no tree set for
        # this model, online refits of the generic set's predictor and costs (recording.py)
        # step times differ between tensor-parallel ranks, and every rank must choose the same tree: with more
        # than one rank the online refit keeps the set's costs and learns acceptance only (identical logits)
        self.observer = StepObserver.for_worker(self.config, self.tree_set,
                                                timed=int(getattr(server_args, "tp_size", 1) or 1) == 1)
        if self.observer is not None:
            observe.enable()
        # step costs timed in this server (single rank: wall times differ between ranks, every rank must choose
        # the same tree), unless the observer already refits them with the predictor
        online = self.observer is not None and self.observer.online is not None
        single = int(getattr(server_args, "tp_size", 1) or 1) == 1
        self.costs = (OnlineCalibration(self.tree_set, refit_every=COST_REFIT_EVERY)
                      if self.config.online_costs and single and not online else None)
        # the cost of a ragged step (tokens verified, draft levels, rows) fitted on this server's own ragged and
        # resting steps; the policy prices ragged steps by it once fitted (the set's per-tree costs until then)
        prior = set_ragged_prior(self.tree_set)
        self.ragged_costs = (OnlineRaggedCost(prior=prior, refit_every=COST_REFIT_EVERY,
                                              min_points=PRIOR_MIN_POINTS if prior is not None else MIN_POINTS)
                             if self.config.online_costs and single else None)
        # speculation judged by what it delivered (policy/guard.py): a batch size where this server's speculating
        # steps emitted fewer tokens per second than its resting ones rests (the step-cost model can be wrong)
        self.guard = (SpeculationGuard() if self.config.guard and single and self.observer is None else None)
        self._guard_step: tuple | None = None   # (rows, resting, seconds) of the step whose tokens are not counted yet
        self._grammars: dict[int, object] = {}            # batch row -> grammar object, this step
        self.telemetry = StepTelemetry(trace_path(os.environ.get(ENV_TREE_TRACE),
                                                  getattr(get_parallel(), "tp_rank", 0)),
                                       self.config.log_interval_s, self.signal)
        dw = self._draft_worker
        if dw is not None:
            # the drafter's torch linear layers (EAGLE's fc) on the CPU engine's packed path, as SGLang's own layers
            cpu_linear.pack_torch_linears(dw.draft_runner.model)
            # every patch of an SGLang object goes through patches.INSTANCE_PATCHES (its parameters checked)
            patch_instance(dw, "draft_forward", self._draft_forward_tree)

            def capture(forward_batch, *args, **kwargs):
                out = forward(forward_batch, *args, **kwargs)
                if not forward_batch.forward_mode.is_decode():   # draft extend, not a draft step
                    self._last_extend = out.logits_output
                return out

            forward = patch_instance(dw.draft_runner, "draft_runner_forward", capture)
            # resting: a step that rests skips the draft model's extend pass; the positions it verified are
            # owed to the drafter (`_pending`) and caught up in one extend pass when speculation resumes
            self._extend_for_decode = patch_instance(dw, "draft_extend_for_decode", self._draft_extend_or_rest)
            self._target_forward = patch_instance(self.target_worker.model_runner, "target_forward",
                                                  self._target_forward_or_decode)
        self._max_pending = max(MAX_PENDING, self.config.max_rest + 1)
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # rid -> [(token, hidden)]
        self.profiler = _profiler(self)
        self.shape_states: ShapeStates[SpecRuntimeState] | None = None   # built in init_cuda_graphs
        self._state: SpecRuntimeState | None = None

    def _ragged_verify(self, server_args, target_worker) -> bool:
        """Whether rows of a speculating step verify their own node counts (resting rows among them): on unless
        ENTMTP_RAGGED=0, with per-request trees, a tree set holding chain:0 and the `entmtp_torch` target backend
        (the one with a ragged verify plan); logged at start-up either way."""
        # (the target's backend objects are built later; init_cuda_graphs checks each runtime state's)
        backend = (getattr(server_args, "decode_attention_backend", None)
                   or getattr(server_args, "attention_backend", None))
        reason = ("ENTMTP_RAGGED=0" if os.environ.get(ENV_RAGGED, "1").strip() == "0"
                  else "ENTMTP_PER_ROW_TREES=0" if not self.config.per_row
                  else "the tree set has no chain:0" if self._rest_tree is None
                  else f"the target attention backend is {backend}, not {ATTENTION_NAME}"
                  if backend != ATTENTION_NAME else None)
        if reason is None:
            logger.info("ENTMTP: ragged verify on: each request verifies its own node count, down to a resting "
                        "row (its root alone) inside a speculating step; the target runs only the real tokens")
            return True
        logger.info("ENTMTP: ragged verify off (%s): every row of a speculating step verifies the step's node "
                    "count", reason)
        return False

    # -- one runtime state per tree shape (shapes.py) ------------------------------------------------
    def init_cuda_graphs(self):
        """SGLang builds the start-up state (backends, and graphs where its flags capture them); then one state per
        tree shape of the set, with upstream's `build_adaptive_runtime_state`."""
        super().init_cuda_graphs()
        dw = self._draft_worker
        if dw is None:
            return
        runner = self._target_worker.model_runner
        start = SpecRuntimeState(
            speculative_num_steps=self.speculative_num_steps,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            draft_attn_backend=dw.draft_attn_backend, cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=runner.attn_backend, target_graph_runner=runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend)
        with draft_contexts(dw):
            self.shape_states = ShapeStates.build(
                self.plans, lambda s: self.build_adaptive_runtime_state(s.num_steps, s.num_draft_tokens),
                built={Shape(start.speculative_num_steps, start.speculative_num_draft_tokens): start})
        self._state = start
        if self.ragged and not all(isinstance(s.target_attn_backend, TorchTreeAttnBackend)
                                   for s in self.shape_states.states.values()):
            logger.info("ENTMTP: ragged verify off: a runtime state's target backend is not entmtp_torch")
            self.ragged, self._shapes = False, {}
            if self.forced is not None:
                logger.info("ENTMTP: forced spans off (ragged verify is off)")
                self.forced = None
            self.shape_index = ShapeIndex.for_trees([t.tree for t in self.tree_set.trees], self.topk,
                                                    runner.device) if self.config.per_row else {}
        logger.info("ENTMTP: %d runtime states for the %d trees of the set (%s)", len(self.shape_states),
                    len(self.plans), ", ".join(f"{s.num_steps} levels x {s.num_draft_tokens} tokens"
                                               for s in sorted(self.shape_states.states)))

    def _switch(self, state: SpecRuntimeState) -> None:
        """Make `state` the worker's: what upstream's `apply_runtime_state` does, without its early return when the
        step count is unchanged (trees of one depth differ in width) and without its log line per switch."""
        if state is self._state:
            return
        dw, runner = self._draft_worker, self._target_worker.model_runner
        self.speculative_num_steps = dw.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = state.speculative_num_draft_tokens
        dw.draft_attn_backend = dw.draft_runner.draft_attn_backend = state.draft_attn_backend
        dw.cuda_graph_runner = state.cuda_graph_runner
        dw.draft_extend_attn_backend = state.draft_extend_attn_backend
        if state.draft_extend_attn_backend is not None:
            dw.draft_runner.attn_backend = state.draft_extend_attn_backend
        dw.cuda_graph_runner_for_draft_extend = state.cuda_graph_runner_for_draft_extend
        runner.attn_backend = state.target_attn_backend
        runner.decode_cuda_graph_runner = state.target_graph_runner
        get_context().override("entmtp.tree", speculative_num_steps=state.speculative_num_steps,
                               speculative_num_draft_tokens=state.speculative_num_draft_tokens)
        self._state = state

    @property
    def hot_token_id(self) -> torch.Tensor | None:
        """Target id of each draft token when the draft has its own vocabulary (an EAGLE-3 draft's d2t, or
        --speculative-token-map), else None. SGLang sets it when the scheduler allocates the draft's memory
        pool, after __init__."""
        return getattr(self._draft_worker, "hot_token_id", None)

    @property
    def grammar_drafting(self) -> bool:
        """Whether constrained requests get grammar-masked signals and drafts (over a draft vocabulary too: the
        target-vocabulary mask is read at each draft token's target id). (The grammar objects are read, and
        rolled back, on this thread; under the overlap scheduler the scheduler may be advancing them
        concurrently, so grammar-aware drafting also skips overlapped batches.)"""
        return self.config.grammar_drafting

    # -- per step -----------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        prof = self.profiler if decode and not batch.forward_mode.is_idle() else None
        if prof is not None:
            prof.begin_step()
        if decode and not batch.forward_mode.is_idle() and self._draft_worker is not None:
            if prof is not None:
                with prof.timed("choose"):
                    self._choose(batch)
            else:
                self._choose(batch)
        self._last_extend = None
        self._guard_observe(None)   # a step whose accepted counts never came: one token a row
        start = time.perf_counter()
        try:
            out = super().forward_batch_generation(batch, *args, **kwargs)
        finally:
            if self._forced_width is not None:   # the verify and draft extend ran N' wide: back to the state's N
                self._set_verify_width(self._forced_width)
                self._forced_width = None
        if decode and not batch.forward_mode.is_idle():
            seconds = time.perf_counter() - start
            if self.observer is not None:
                self._observe(batch, seconds)
            try:
                if self.costs is not None and self._step.chosen is not None and self._step.ragged is None:
                    self._time_step(len(batch.reqs), seconds)   # (a ragged step is not its shape tree's full step)
                if self.ragged_costs is not None:
                    self._time_ragged(len(batch.reqs), seconds)
                if self.guard is not None:   # observed once the scheduler reports what it accepted
                    self._guard_step = (len(batch.reqs), self._step.resting, seconds)
            except Exception:   # timing must never fail a request: the server keeps the costs it has
                logger.exception("ENTMTP: timing a step failed; online step costs stop")
                self.costs = self.ragged_costs = None
        self._record_signals(batch)
        if prof is not None:
            prof.end_step(tree=REST if self._step.resting else self._step.name, bs=len(batch.reqs))
        return out

    def _observe(self, batch, seconds: float) -> None:
        obs = self.observer
        try:
            step = self._step
            ragged = (step.ragged.total_tokens, step.num_steps) if step.ragged is not None and step.drafts else None
            obs.step(batch.reqs, step.plan, step.chosen, seconds, observe.take(), ragged)
            if obs.online is not None and obs.online.due():
                ts = obs.online.refit()
                self.tree_set = self.controller.tree_set = ts
                self.controller.predictor = AcceptancePredictor.from_json(ts.predictor)
                logger.info("ENTMTP online calibration (refit %d, %d steps): %s", obs.online.refits,
                            obs.online.steps, obs.online.summary())
        except Exception:   # observing must never fail a request
            logger.exception("ENTMTP: recording a verified step failed; recording stops")
            self.observer = None

    def _time_step(self, rows: int, seconds: float) -> None:
        costs = self.costs
        costs.observe_time(self._step.chosen, rows, seconds)
        if costs.due():
            self.tree_set = self.controller.tree_set = costs.refit_costs()
            logger.info("ENTMTP step costs timed in this server (%d steps): %s", costs.steps, costs.summary())

    def _time_ragged(self, rows: int, seconds: float) -> None:
        """A speculating step (the tokens it verified and its draft levels: a ragged step's rows their own node
        counts, a step where every row took the shape's tree N a row) or a resting step (one token a row, no
        levels; one whose rows took spans is left out) into the online ragged cost, which prices every step the
        policy compares (ragged or not); at each refit the policy takes the new fit
        (`TreeController.set_ragged_cost`)."""
        step = self._step
        if step.resting and step.ragged is not None:   # a resting step whose rows took spans: timed as the plain
            # step it would have been, its span tokens taken off at the fit's per-token price (`resting_seconds`),
            # and counted in any case, so that a fit from a slow stretch is forgotten while the policy rests (a mixed
            # batch's resting steps nearly all take spans: uncounted, a stale fit priced every step of a server's
            # life; untimed, the plain regime stayed the set's prior, 2026-12-06)
            self.ragged_costs.observe(rows, 0, rows, resting_seconds(seconds, step.ragged.total_tokens - rows,
                                                                     self.ragged_costs.cost))
        elif step.drafts:
            tokens = step.ragged.total_tokens if step.ragged is not None else rows * step.num_nodes
            self.ragged_costs.observe(tokens, step.num_steps, rows, seconds)
        else:   # a resting or plain step: one token a row
            self.ragged_costs.observe(rows, 0, rows, seconds)
        rc = self.ragged_costs
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

    def _choose(self, batch) -> None:
        """The step's decision (step.py), made once: the rules that make a step rest (penalties, positions owed
        to the drafter), then the policy's choice over each request's signal, laid out on the server's indices;
        then applied (`_apply`)."""
        reqs = batch.reqs
        choice, rest, h = None, False, float("nan")
        recording = self.observer is not None
        mode = step_mode(self.ragged, bool(self.shape_index), recording,
                         [self._pin(r) for r in reqs] if recording else ())
        try:
            # penalties: one token per step keeps them exact; ragged, such a request rests as a row of the step
            forced = [needs_plain_decoding([r]) for r in reqs]
            owed = max((len(self._pending.get(r.rid, ())) for r in reqs), default=0)
            rule = rest_rule(forced, owed, mode, self._max_pending, lambda: self.controller.rests(["batch"]))
            if rule.catch_up:
                self._catch_up(batch)
            if rule.rest:
                raise _Rest
            self._grammar_signals(batch, reqs)
            unknown = least_predictable(self.signal)
            probe = self.observer.probe_tree(self.telemetry.steps) if self.observer is not None else None
            rest_name = self.plans[self._rest_tree].tree.name if self._rest_tree is not None else None
            inputs = [RequestInput(r.rid, self.signals.get(r.rid, unknown), self.probs.get(r.rid, ()), self._room(r),
                                   rest_name if rest else self._pin(r) or probe) for r, rest in zip(reqs, forced)]
            known = [x.signal for x in inputs if x.signal != unknown]
            h = sum(known) / len(known) if known else unknown
            choice = choose_trees(self.controller, inputs, mode, self._shapes, self._shape_tree, self._rest_tree,
                                  self.plans)
        except _Rest:
            rest = True
        except Exception:   # the policy must never fail a request: decode plainly this step
            logger.exception("ENTMTP: tree choice failed; this step decodes without speculation")
            self._pending.clear()
            choice = None
        step = lay_out(choice, len(reqs), self.plans, self.indices, self.shape_index, self._index_by_name,
                       resting=rest, device=batch.seq_lens.device)
        if (self.guard is not None and not step.resting and choice is not None
                and not any(self._pin(r) for r in reqs) and self.guard.force_rest(len(reqs))):
            for r in reqs:   # the chosen trees do not run: no acceptance feedback for them
                self.controller.record(r.rid, None)
            step = lay_out(None, len(reqs), self.plans, self.indices, self.shape_index, self._index_by_name,
                           resting=True, device=batch.seq_lens.device)
        self._apply(batch, step, h)

    def _apply(self, batch, step: StepDecision, h: float) -> None:
        """Make `step` this step's: telemetry (histogram, meta_info, trace), the runtime state of its shape, and the
        draft backend's per-row ancestor slots."""
        reqs = batch.reqs
        self._step = step
        self._step_reqs = list(reqs)
        n, steps = step.num_nodes, step.num_steps
        dw = self._draft_worker
        states = self.shape_states
        state = states.state_of(step.chosen) if step.plan is not None and states is not None else None
        if state is not None:
            self._switch(state)
        elif (self.speculative_num_draft_tokens, self.speculative_num_steps) != (n, steps):
            # resting: one token verified, no draft levels; the backends stay those of the last state
            self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = n
            self.speculative_num_steps = dw.speculative_num_steps = steps
            get_context().override("entmtp.tree", speculative_num_draft_tokens=n, speculative_num_steps=steps)
            self._state = None
        state = self._state
        self.telemetry.record(reqs, step, None if state is None else (state.speculative_num_steps,
                                                                      state.speculative_num_draft_tokens), h)
        if step.plan is not None and steps > 1:
            backend = dw.draft_attn_backend
            if not isinstance(backend, MultiStepDraftBackend):
                raise RuntimeError("ENTMTP drafts fixed trees with the entmtp_torch attention backend; start "
                                   "the server with --attention-backend entmtp_torch (CPU) or "
                                   "--speculative-draft-attention-backend entmtp_torch (GPU) (draft backend: "
                                   f"{type(backend).__name__})")
            rows = step.rows if step.rows is not None else step.index
            backend.set_draft_rows(list(rows.row_offsets), list(rows.row_valid))

    # -- resting ------------------------------------------------------------------------------------
    def _draft_extend_or_rest(self, batch, batch_result, **kwargs):
        """Replaces EagleDraftWorker._draft_extend_for_decode: on a resting step the draft model does not run;
        each request owes it the positions just verified and accepted (its root, and the accepted part of its span
        when the step had one: the token the target chose after each and the target's hidden state there), caught
        up by `_catch_up`."""
        if not self._step.resting:
            return self._extend_for_decode(batch, batch_result, **kwargs)
        tokens = batch_result.next_token_ids
        hidden = batch_result.logits_output.hidden_states
        bs = len(batch.reqs)
        width = tokens.shape[0] // bs if tokens is not None and bs else 0
        lens = batch_result.accept_lens
        if (width and hidden is not None and tokens.shape[0] == bs * width == hidden.shape[0]
                and (width == 1 or lens is not None)):
            # a graph's output buffers are reused next step; a chain's accepted tokens lead its row (verify)
            tokens, hidden = tokens.view(bs, width).clone(), hidden.view(bs, width, -1).clone()
            counts = [1] * bs if width == 1 else [max(1, min(int(n), width)) for n in lens.tolist()]
            for i, r in enumerate(batch.reqs):
                if self._never_drafts(r):   # nothing to catch up
                    self._pending.pop(r.rid, None)
                else:
                    self._pending.setdefault(r.rid, []).extend((tokens[i, j], hidden[i, j]) for j in range(counts[i]))
        else:   # an unexpected layout: nothing to catch up from, so the drafter starts cold (still lossless)
            for r in batch.reqs:
                self._pending.pop(r.rid, None)
        self._stub_skipped_draft_extend(batch, batch_result)

    @property
    def _rest_spans(self) -> bool:
        """Whether a resting step's rows take spans (the grammar's text, their repeats) below their roots: on unless
        ENTMTP_REST_SPANS=0, and never while recording a calibration (a resting step is timed as one token a row)."""
        return self.observer is None and self._rest_spans_on

    def verify(self, batch, *args, **kwargs):
        """SGLang's verify, the step's forced spans hung into its input first. A resting step verifies as a chain
        (topk 1): its root, and below it the row's span when it has one (`rest_spans`), so the accepted path is
        already where SGLang's tree compaction would move it, and the KV, token and hidden-state compaction is
        skipped."""
        resting = self._step.resting
        self._forced_step = None
        if (self.forced is not None and len(self._step_reqs) == len(batch.reqs)
                and (self._rest_spans if resting else self.speculative_num_steps > 0)):
            self._forced_spans(batch)
        rs = self._step.ragged
        if rs is not None:   # padding nodes unlinked: SGLang's acceptance and grammar walks never visit them
            spec = batch.spec_info
            if tuple(spec.retrieve_next_token.shape) != tuple(rs.real.shape):
                raise RuntimeError(f"ENTMTP: ragged verify for rows of {tuple(rs.real.shape)} nodes, SGLang's "
                                   f"verify has {tuple(spec.retrieve_next_token.shape)}")
            spec.retrieve_next_token = rs.next_token.to(spec.retrieve_next_token.dtype)
            spec.retrieve_next_sibling = rs.next_sibling.to(spec.retrieve_next_sibling.dtype)
        if resting:
            topk, self.topk = self.topk, 1
            try:
                out = super().verify(batch, *args, **kwargs)
            finally:
                self.topk = topk
        else:
            out = super().verify(batch, *args, **kwargs)
        if self._forced_step is not None:
            counted = self.forced.verified(self._forced_step, batch.reqs, getattr(out, "accept_index", None))
            for r, (fv, fa, lv, la) in zip(batch.reqs, counted):
                if fv or not lv:
                    visibility.note(r, visibility.FORCED, [fv, fa])
                if lv:
                    visibility.note(r, visibility.LOOKUP, [lv, la])
        return out

    def _forced_threshold(self, rows: int) -> float:
        """A verified token's price in emitted tokens this step (forced_draft.token_threshold): the step cost the
        policy prices ragged steps by (`TreeController.ragged_step_cost`: this server's own fit once it has one),
        one more token against the whole step, which emits `rows` times the running mean of tokens per row."""
        step = self._step
        total = step.ragged.total_tokens if step.ragged is not None else rows * step.num_nodes
        try:
            cost = self.controller.ragged_step_cost(rows)
            seconds = cost(total, step.num_steps, rows)
            # a resting step is priced as the plain decode, which has no per-token term; its spans are verified
            # tokens all the same, priced by the line's (else they ran at full length on every row: 8.8-token
            # lookup spans at 19% acceptance on the resting steps of 16 requests)
            per_token = (cost(total + 1, step.num_steps, rows) - seconds if step.num_steps > 0
                         else cost(total + 1, 1, rows) - cost(total, 1, rows))
        except Exception:   # no cost to price by: spans at their full length
            return 0.0
        return token_threshold(per_token, seconds, rows, self.forced.tokens_per_row)

    def _forced_spans(self, batch) -> None:
        """Forced spans (forced_draft.py) into this step's verify input: each constrained row that may take tokens
        beyond one per step gets the grammar's text below its leaves; the step then verifies raggedly, N' wide."""
        reqs = batch.reqs
        grammars = {}   # row -> its live grammar, or None for a row without one (its spans: its own repeats)
        if not getattr(batch, "enable_overlap", True):
            for i, r in enumerate(reqs):
                if self._never_drafts(r) or needs_plain_decoding([r]):
                    continue
                if getattr(r, "grammar", None) is None:
                    if self.observer is None:   # (a calibration records the drafter's own acceptance on free rows)
                        grammars[i] = None
                elif (g := grammar_draft.live_grammar(r)) is not None:
                    grammars[i] = g
        step = self.forced.extend(batch.spec_info, self._step.ragged, reqs, grammars, [self._room(r) for r in reqs],
                                  self._forced_threshold(len(reqs)) if grammars else 0.0)
        if step is not None:
            self._forced_step, self._forced_width = step, step.base_width
            self._step = self._step.with_ragged(step.ragged)
            self._set_verify_width(step.layout.num_nodes)

    def _set_verify_width(self, n: int) -> None:
        """Tokens verified per row (SGLang's `speculative_num_draft_tokens`, read by its verify and draft extend)."""
        dw = self._draft_worker
        self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = n
        get_context().override("entmtp.tree", speculative_num_draft_tokens=n,
                               speculative_num_steps=self.speculative_num_steps)

    def _target_forward_or_decode(self, forward_batch, *args, **kwargs):
        """On a resting step the target's one-token verify runs as the plain decode forward it is (SGLang's
        decode attention and output path, not the tree-verify ones), then the batch reads as a verify again
        for SGLang's acceptance code. Every other forward is SGLang's own."""
        spec = forward_batch.spec_info
        resting = self._step.resting
        if self._step.ragged is not None and forward_batch.forward_mode.is_target_verify():   # (a resting step's
            # layout is ragged only when its rows took spans)
            return self._ragged_forward(forward_batch, *args, **kwargs)
        if not (resting and forward_batch.forward_mode.is_target_verify()
                and int(getattr(spec, "draft_token_num", 0) or 0) == 1):
            return self._target_forward(forward_batch, *args, **kwargs)
        bs = forward_batch.seq_lens.shape[0]
        saved = (forward_batch.forward_mode, forward_batch.seq_lens, forward_batch.seq_lens_cpu,
                 forward_batch.seq_lens_sum)
        forward_batch.forward_mode = ForwardMode.DECODE
        forward_batch.seq_lens = forward_batch.seq_lens + 1          # decode lengths count the new token
        if forward_batch.seq_lens_cpu is not None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens_cpu + 1
        if forward_batch.seq_lens_sum is not None:
            forward_batch.seq_lens_sum = forward_batch.seq_lens_sum + bs
        try:
            return self._target_forward(forward_batch, *args, **kwargs)
        finally:
            (forward_batch.forward_mode, forward_batch.seq_lens, forward_batch.seq_lens_cpu,
             forward_batch.seq_lens_sum) = saved

    def _ragged_forward(self, forward_batch, *args, **kwargs):
        """The target's verify forward over the rows' real tokens only (ragged.py): input ids, positions and cache
        locations packed, `entmtp_torch` planning the packed queries, then logits and hidden states scattered
        back to SGLang's `bs x N` layout (padding rows 0, never accepted: unlinked in `verify`)."""
        rs = self._step.ragged
        total = rs.real.numel()
        if forward_batch.input_ids.shape[0] != total:
            raise RuntimeError(f"ENTMTP: ragged verify of {total} slots, the verify batch has "
                               f"{forward_batch.input_ids.shape[0]} tokens")
        saved = (forward_batch.input_ids, forward_batch.positions, forward_batch.out_cache_loc)
        idx = rs.index
        forward_batch.input_ids, forward_batch.positions, forward_batch.out_cache_loc = (t[idx] for t in saved)
        spec = forward_batch.spec_info   # (SGLang may copy the forward batch; its spec_info travels by reference)
        setattr(spec, RAGGED_ATTR, rs)
        try:
            out = self._target_forward(forward_batch, *args, **kwargs)
        finally:
            forward_batch.input_ids, forward_batch.positions, forward_batch.out_cache_loc = saved
            setattr(spec, RAGGED_ATTR, None)
        lo = out.logits_output
        lo.next_token_logits = scatter_rows(lo.next_token_logits, idx, total)
        if lo.hidden_states is not None:
            lo.hidden_states = scatter_rows(lo.hidden_states, idx, total)
        return out

    def _catch_up(self, batch) -> None:
        """One draft-extend pass over every position the batch's requests rested through: writes their draft
        KV and leaves the next root's top-k, hidden state and signal in `batch.spec_info`, as the draft extend
        of a speculative step would. Request i owes k_i positions ending just before its current length; the
        pass is R = max k_i wide, and a shorter row's padding writes to SGLang's dummy KV slot 0, past the
        row's real positions (causal attention keeps them out of the real ones)."""
        dw = self._draft_worker
        reqs = batch.reqs
        owed = [self._pending.pop(r.rid, []) for r in reqs]
        width = max(len(o) for o in owed)
        bs, dev = len(reqs), batch.seq_lens.device
        hidden0 = next(o for o in owed if o)[0][1]
        tokens = torch.zeros(bs, width, dtype=torch.int64, device=dev)
        hidden = hidden0.new_zeros((bs, width, hidden0.shape[-1]))
        k = torch.tensor([len(o) for o in owed], dtype=torch.long)
        for i, o in enumerate(owed):
            if o:
                tokens[i, : len(o)] = torch.stack([t for t, _ in o]).to(tokens)
                hidden[i, : len(o)] = torch.stack([h for _, h in o])
        k_dev = k.to(dev)
        start = batch.seq_lens.long() - k_dev                    # the first owed position of each request
        pos = start[:, None] + torch.arange(width, device=dev)[None, :]
        r2t = self.req_to_token_pool.req_to_token
        slots = r2t[batch.req_pool_indices.long()[:, None], pos.clamp(max=r2t.shape[1] - 1)]
        real = torch.arange(width, device=dev)[None, :] < k_dev[:, None]
        out_cache_loc = torch.where(real, slots.long(), 0).flatten()    # SGLang's slot indices are int64

        di = batch.spec_info
        cold = [i for i, o in enumerate(owed) if not o]          # joined since: their root state stays
        kept = [(di.topk_p, di.topk_index, di.hidden_states)] if cold else []
        saved_signals = {reqs[i].rid: (self.signals.get(reqs[i].rid), self.probs.get(reqs[i].rid)) for i in cold}
        fields = ("forward_mode", "spec_info", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "input_ids",
                  "out_cache_loc", "prefix_lens", "extend_lens", "extend_num_tokens")
        saved = {f: getattr(batch, f, None) for f in fields}
        ndt = dw.speculative_num_draft_tokens
        try:
            batch.seq_lens = start.to(batch.seq_lens.dtype)
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = batch.seq_lens_cpu - k.to(batch.seq_lens_cpu.dtype)
                batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
            batch.out_cache_loc = out_cache_loc
            dw.speculative_num_draft_tokens = width
            result = _CatchUp(accept_lens=k_dev.clamp(min=1).to(torch.int32), next_token_ids=tokens.flatten(),
                              logits_output=_Hidden(hidden.flatten(0, 1)), next_draft_input=di,
                              new_seq_lens=batch.seq_lens)
            self._extend_for_decode(batch, result)
        finally:
            dw.speculative_num_draft_tokens = ndt
            for f, v in saved.items():
                setattr(batch, f, v)
        self._record_signals(batch)
        if cold:
            idx = torch.tensor(cold, dtype=torch.long, device=dev)
            (p, t, h), = kept
            di.topk_p[idx], di.topk_index[idx] = p[idx], t[idx]
            if h is not None and di.hidden_states is not None:
                di.hidden_states[idx] = h[idx]
            for rid, (sig, probs) in saved_signals.items():
                if sig is not None:
                    self.signals[rid], self.probs[rid] = sig, probs

    def _pin(self, req) -> str | None:
        """The tree this request pins, if the set holds it (an unknown name is logged once and ignored)."""
        name = pin_of(getattr(getattr(req, "sampling_params", None), "custom_params", None))
        if name is not None and name not in self._index_by_name:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("ENTMTP: requests pin tree %r, which is not in the tree set (%s); ignored", name,
                               ", ".join(self._index_by_name))
            return None
        return name

    def _never_drafts(self, req) -> bool:
        """A request that asks for no drafts for the rest of its life: a penalised one (it decodes plainly to its
        end) or one pinning a tree without drafts (chain:0). Its rested positions are not kept, so it never pays a
        catch-up pass. Should it draft anyway (one tree for the batch, `ENTMTP_PER_ROW_TREES=0`, and other pins), its
        row drafts from a cold draft cache: fewer drafts accepted on that row, the same output."""
        if penalised(req):
            return True
        name = self._pin(req)
        return name is not None and self.plans[self._index_by_name[name]].num_steps == 0

    def _grammar_signals(self, batch, reqs) -> None:
        """Constrained requests: grammar-masked signal of the stored root logits, now that the grammar has
        taken the last verified tokens; and the rows whose drafting consults the grammar this step."""
        self._grammars = {}
        if not self.grammar_drafting or getattr(batch, "enable_overlap", True):
            return
        for i, r in enumerate(reqs):
            g = grammar_draft.live_grammar(r)
            logits = self._root_logits.get(r.rid)
            if g is None or logits is None:
                continue
            try:
                masked = grammar_draft.grammar_signal(logits, g, self._grammar_vocab(g, logits), self.signal,
                                                      with_probs=True, hot=self.hot_token_id)
            except Exception:
                logger.exception("ENTMTP: grammar-masked %s failed for %s; using the unmasked one",
                                 self.signal, r.rid)
                continue
            if masked is not None:
                self.signals[r.rid], self.probs[r.rid] = masked
            self._grammars[i] = g

    def _guard_observe(self, tokens: int | None) -> None:
        """The last timed step into the guard, with the tokens it emitted (None: unknown, one a row)."""
        pending, self._guard_step = self._guard_step, None
        if pending is not None and self.guard is not None:
            rows, resting, seconds = pending
            self.guard.observe(rows, resting, rows if tokens is None else tokens, seconds)

    def _room(self, req) -> int:
        """KV positions left before the context limit: every node of a tree takes one while verifying."""
        ctx = self.target_worker.model_config.context_len
        return max(ctx - len(req.origin_input_ids) - len(req.output_ids), 1)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        reqs, self._step_reqs = self._step_reqs, []
        forced, self._forced_step = self._forced_step, None
        if len(reqs) == len(num_correct_drafts_per_req):
            counts = [int(n) for n in num_correct_drafts_per_req]
            self._guard_observe(sum(counts) + len(counts))   # the drafts accepted and each row's own token
            fed = ForcedDraft.policy_counts(forced, counts) if forced is not None else counts
            if self.forced is not None and self._step.drafts:
                self.forced.observe(counts)
            for r, n, m in zip(reqs, counts, fed):
                visibility.note(r, visibility.ACCEPTED, n)
                self.controller.record(r.rid, m)   # acceptance feedback: realized vs expected (drafted depth)

    def _record_signals(self, batch) -> None:
        out = self._last_extend
        self._last_extend = None
        if out is None or out.next_token_logits is None:
            return
        logits = out.next_token_logits
        if logits.shape[0] != len(batch.reqs):
            return
        h = draft_signal(self.signal, logits.float())
        top = top_probs(logits).tolist()
        if self.observer is not None:
            self.observer.roots(batch.reqs, logits, self.hot_token_id)
        for i, (r, v) in enumerate(zip(batch.reqs, h.tolist())):
            self.signals[r.rid] = v
            self.probs[r.rid] = tuple(top[i])
            if self.grammar_drafting and grammar_draft.live_grammar(r) is not None:
                self._root_logits[r.rid] = logits[i].detach().float().clone()
            else:
                self._root_logits.pop(r.rid, None)
        if len(self.signals) > 4 * max(64, len(batch.reqs)):
            live = {r.rid for r in batch.reqs}
            self.signals = {k: v for k, v in self.signals.items() if k in live}
            self.probs = {k: v for k, v in self.probs.items() if k in live}
            self._root_logits = {k: v for k, v in self._root_logits.items() if k in live}
            self.controller.keep_only(live)

    # -- drafting a fixed tree ----------------------------------------------------------------------
    def _draft_forward_tree(self, forward_batch):
        """Replaces EagleDraftWorker.draft_forward: returns (parent_list, top_scores_index, tokens, None).
        The levels run on device tensors indexed by the tree's `TreeIndex` (tree_index.py); grammar masks and
        calibration records, when on, read the host between levels."""
        dw = self._draft_worker
        step = self._step
        plan, index = step.plan, step.index
        spec_info = forward_batch.spec_info
        if forward_batch.forward_mode.is_idle():
            return dw._draft_forward_idle(forward_batch, spec_info)
        rows = step.rows
        if rows is not None and rows.parent_list.shape[0] != spec_info.topk_index.shape[0]:
            raise RuntimeError(f"ENTMTP: per-row trees for {rows.parent_list.shape[0]} rows, the draft has "
                               f"{spec_info.topk_index.shape[0]}")
        topk, steps = self.topk, plan.num_steps
        root_top = spec_info.topk_index                        # (bs, topk) root children by rank
        hot = self.hot_token_id
        if hot is not None:
            root_top = hot[root_top]
        bs = root_top.shape[0]
        grammars = self._grammars if len(self._step_reqs) == bs else {}
        if grammars:
            root_top = root_top.clone()
            for row, g in grammars.items():
                logits = self._root_logits.get(self._step_reqs[row].rid)
                top = None if logits is None else self._grammar_topk(logits, g, ())
                if top is not None:
                    root_top[row] = top.to(root_top)
        out_cache_loc = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, bs, topk, steps)

        def forward_level(level, input_ids, hidden):
            forward_batch.input_ids = input_ids
            spec_info.hidden_states = hidden
            forward_batch.out_cache_loc = out_cache_loc[level]
            with forward_context(ForwardContext(attn_backend=dw.draft_attn_backend.attn_backends[level]),
                                 forward_batch=forward_batch):
                out = dw.draft_runner.forward(forward_batch).logits_output
            forward_batch.positions.add_(1)
            return out.next_token_logits.view(bs, topk, -1), out.hidden_states.view(bs, topk, -1)

        row_plans = step.row_plans if rows is not None else [plan] * bs

        def on_level(level, top, logits, tokens):   # eager only: records and grammar masks read the host
            if self.observer is not None:
                self.observer.expanded(plan.columns[level], logits, hot)
            if grammars and level + 1 < steps:
                self._grammar_children(top, logits, level, tokens, row_plans, grammars)

        eager = self.observer is not None or bool(grammars)
        if rows is not None:   # each row its own tree
            tokens = draft_rows(rows, root_top, spec_info.hidden_states, forward_level, hot,
                                on_level if eager else None)
            return rows.parent_list, rows.selected, tokens.gather(1, rows.selected_nodes), None
        tokens = draft_tree(index, root_top, spec_info.hidden_states, forward_level, hot,
                            on_level if eager else None)
        if self.observer is not None:
            self.observer.drafted({n: tokens[:, n] for n in range(1, plan.num_nodes)})
        return (index.parent_list.expand(bs, -1).contiguous(), index.selected.expand(bs, -1).contiguous(),
                tokens[:, index.selected_nodes], None)

    def _grammar_vocab(self, grammar, logits) -> int:
        """The target vocabulary the grammar's masks cover."""
        return int(getattr(grammar, "vocab_size", 0) or self.target_worker.model_config.vocab_size
                   or logits.shape[-1])

    def _grammar_topk(self, logits, grammar, path):
        try:
            return grammar_draft.grammar_topk(logits, grammar, path, self.topk, self._grammar_vocab(grammar, logits),
                                              hot=self.hot_token_id)
        except Exception:   # drafting must never fail a request: keep the unmasked drafts
            logger.exception("ENTMTP: grammar-aware drafting failed; unmasked drafts this node")
            return None

    def _grammar_children(self, top, logits, level, token, plans, grammars) -> None:
        """Replace, for constrained rows, each drafted node's children by the top-k its grammar allows, following
        each row's own tree (`plans[row]`)."""
        host = token.tolist()                      # (bs, num_nodes): the nodes drafted so far
        for row, g in grammars.items():
            plan = plans[row]
            parents = plan.tree.parents
            col = plan.columns[level] if level < len(plan.columns) else ()
            real = self._step.row_real[row] if self._step.row_real else plan.num_nodes
            for c, n in enumerate(col):
                if n >= real:   # padding (ragged.pad_tree): never verified
                    continue
                path, a = [], n
                while a != 0:
                    path.append(host[row][a])
                    a = parents[a]
                masked = self._grammar_topk(logits[row, c], g, path[::-1])
                if masked is not None:
                    top[row, c] = masked.to(top)


class _Hidden:
    """The part of a verify's logits output a draft extend reads."""

    def __init__(self, hidden_states: torch.Tensor):
        self.hidden_states = hidden_states


class _CatchUp:
    """What `EagleDraftWorker._draft_extend_for_decode` reads of a verify result, for the catch-up pass."""

    prepared_draft_extend_inputs = None

    def __init__(self, accept_lens, next_token_ids, logits_output, next_draft_input, new_seq_lens):
        self.accept_lens, self.next_token_ids = accept_lens, next_token_ids
        self.logits_output, self.next_draft_input, self.new_seq_lens = logits_output, next_draft_input, new_seq_lens


def _profiler(worker):
    """ENTMTP_PROFILE=FILE: time the step's stages (profile.py); None when unset."""
    path = os.environ.get(ENV_PROFILE, "").strip()
    if not path or worker._draft_worker is None:
        return None
    from .profile import StepProfiler

    prof = StepProfiler(path)
    dw = worker._draft_worker
    prof.wrap(dw, "draft", "draft")
    prof.wrap(worker, "verify", "verify")
    prof.wrap(dw, "_draft_extend_for_decode", "draft_extend")   # SGLang's call (or the rest's stub)
    prof.wrap(worker, "_catch_up", "catch_up")                   # inside `choose`
    prof.wrap(worker, "_record_signals", "record")
    prof.wrap(dw.draft_runner, "forward", "draft_forward")
    prof.wrap(worker.target_worker.model_runner, "forward", "target_forward")
    return prof
