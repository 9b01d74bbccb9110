"""The ENTMTP worker: SGLang's EAGLEWorkerV2 drafting, per decode step, each request its own tree of a tree set.

The worker only wires parts in SGLang's order; each part has explicit inputs and reads one frozen record of the step's
decision (step.py `StepDecision`):

    SGLang's entry point        part (module)                       what it does
    forward_batch_generation    choose (this file, step.py)         the rules that rest a step, the policy's trees
                                RuntimeShapes.apply (runtime.py)    the step's shape: runtime state, draft rows
                                Resting.catch_up (resting.py)       one draft extend over positions owed by a rest
      draft_forward             TreeDrafter.draft (tree_draft.py)   each row's tree, level by level (grammar masks)
      verify                    Verifier.spans (verifying.py)       forced and lookup spans below the leaves
      target forward            Verifier.forward (verifying.py)     ragged rows / a resting step as a plain decode
      draft extend              Resting.owe (resting.py)            skipped while resting: positions owed instead
                                StepTiming.step_done (timing.py)    step costs, the guard, calibration records
    on_verify_complete_cpu      policy feedback, StepTiming         accepted drafts per request

Per-request state (signals, root logits, owed positions, span statistics) lives in one `RequestTable` (requests.py),
made when a request first reaches the worker and dropped when SGLang releases the request's KV (finish, abort,
retraction); the policy's and the recorder's per-request state are dropped with it.

Per step:
1. signal: each request's draft signal (the tree set's: entropy, or top-1 margin; policy/signals.py) of its next
   root distribution, computed from the logits the draft-extend pass already produced (no extra forward); for a
   request under a grammar, over the tokens the grammar allows next (grammar_draft.py);
2. `TreeController` (policy/controller.py) picks, per request, a tree expecting the most tokens for it and the
   step's shape for the most expected tokens per second (ragged: each row its own node count, down to a resting
   row; `ENTMTP_PER_ROW_TREES=0` or recording: one tree for the batch); chain:0 for every row rests the step;
3. the draft expands each row's tree on per-row indices gathered by tree id on device (tree_index.py); the draft
   hands SGLang the candidate encoding EAGLE uses, so verification, acceptance, KV compaction and grammar walking
   are SGLang's own code.

Decisions depend only on logits and accepted counts, identical on every tensor-parallel rank, and on the batch size,
so every rank picks the same trees (step costs are timed only in a single-rank server).
"""

from __future__ import annotations

import contextlib
import logging
import time

from ..policy.controller import RequestInput, TreeController
from ..policy.signals import draft_signal, least_predictable, top_probs
from ..settings import settings
from . import grammar_draft, visibility
from .config import EntMtpConfig, pin_of
from .cpu import linear as cpu_linear
from .forced_draft import ForcedDraft
from .patches import patch_instance
from .requests import RequestTable
from .resting import MAX_OWED, Resting, needs_plain_decoding, penalised
from .runtime import RuntimeShapes, ragged_verify_on
from .sglang_api import EAGLEWorkerV2, get_parallel
from .step import REST, StepDecision, choose_trees, lay_out, ragged_shapes, rest_rule, shape_trees, step_mode
from .telemetry import StepTelemetry, trace_path
from .timing import StepTiming
from .tree_draft import TreeDrafter
from .tree_index import ShapeIndex, TreeIndex
from .tree_plan import plan_tree
from .verifying import Verifier

logger = logging.getLogger("entmtp_sglang.sglang")

__all__ = ["EntMtpWorker", "needs_plain_decoding", "penalised"]



BATCH = "batch"   # the policy's group key for a choice made for the whole batch (TreeController's default group)


class _Rest(Exception):
    """This step decodes without speculation and without the drafter, by rule (not an error)."""


class EntMtpWorker(EAGLEWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.config = EntMtpConfig.from_server_args(server_args)
        tree_set = self.config.load_tree_set()
        device = target_worker.model_runner.device
        # Each tree is laid out with its own depth as SGLang's num_steps: the accept buffers are num_steps + 1 wide
        # and must not exceed the tree's node count; every index tensor a tree's draft needs, built once per tree.
        self.plans = [plan_tree(t.tree, self.topk, t.tree.max_depth) for t in tree_set.trees]
        self.indices = [TreeIndex.build(p, device) for p in self.plans]
        trees = [t.tree for t in tree_set.trees]
        self._rest_tree = next((i for i, t in enumerate(trees) if t.num_nodes == 1), None)
        self._index_by_name = {t.tree.name: i for i, t in enumerate(tree_set.trees)}
        self._warned: set = set()
        switches = settings()
        self.ragged = ragged_verify_on(server_args, self.config, switches.ragged, self._rest_tree is not None)
        # each request its own tree (ENTMTP_PER_ROW_TREES, default on): per shape of the set, every tree of N nodes
        # and depth <= D laid out on D draft steps and stacked, gathered by tree id per row; ragged: the shapes a step
        # may run in, smallest first
        self.shape_index = (ShapeIndex.for_trees(trees, self.topk, device, ragged=self.ragged)
                            if self.config.per_row else {})
        self._shapes = ragged_shapes(self.shape_index) if self.ragged else {}
        self._shape_tree = shape_trees(trees)
        self.signal = tree_set.signal         # draft_entropy or draft_margin (config checks)
        self.controller = TreeController.for_tree_set(tree_set, self.config.policy != "entmtp-bins",
                                                      hysteresis=self.config.hysteresis,
                                                      max_nodes=self.config.max_nodes, max_rest=self.config.max_rest)
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.timing = StepTiming(self.config, tree_set, self.controller, tp_size)
        # per-request state: one table, dropped when SGLang releases the request (requests.py)
        self.requests = RequestTable(on_drop=self.controller.forget)
        if self.timing.observer is not None:
            self.requests.listen(self.timing.observer.forget)
        self.requests.counted["policy_requests"] = lambda: len(self.controller.keys() - {BATCH})
        # this step's decision (step.py): what every part of a decode step reads; before the first, the last tree's
        self._step = StepDecision(self.plans[-1], self.indices[-1], None, False, self.plans[-1].tree.name, ())
        self._step_reqs: list = []
        self._last_extend = None
        trace = trace_path(switches.tree_trace_dir, getattr(get_parallel(), "tp_rank", 0))
        self.telemetry = StepTelemetry(trace, self.config.log_interval_s, self.signal)
        self.shapes = RuntimeShapes(self)
        self.resting = Resting(self.requests, self._never_drafts, max(MAX_OWED, self.config.max_rest + 1))
        dw = self._draft_worker
        self.drafter = (TreeDrafter(dw, self.requests, target_worker.model_config.vocab_size, self.topk, self.signal)
                        if dw is not None else None)
        # forced spans (forced_draft.py; ENTMTP_FORCED_SPANS): the grammar's text below constrained rows' leaves
        forced = ForcedDraft.for_worker(server_args.tokenizer_path or server_args.model_path,
                                        target_worker.model_config.vocab_size, self.ragged, self.topk, self.requests)
        self.verifier = Verifier(forced, None, self.controller, self.shapes, switches.rest_spans)
        if dw is not None:
            # the drafter's torch linear layers (EAGLE's fc) on the CPU engine's packed path, as SGLang's own layers
            cpu_linear.pack_torch_linears(dw.draft_runner.model)
            # every patch of an SGLang object goes through patches.INSTANCE_PATCHES (its parameters checked)
            patch_instance(dw, "draft_forward", lambda fb: self.drafter.draft(fb, self._step, self._step_reqs,
                                                                               self.timing.observer))

            def capture(forward_batch, *args, **kwargs):
                out = forward(forward_batch, *args, **kwargs)
                if not forward_batch.forward_mode.is_decode():   # draft extend, not a draft step
                    self._last_extend = out.logits_output
                return out

            forward = patch_instance(dw.draft_runner, "draft_runner_forward", capture)
            # a resting step skips the draft model's extend pass: the positions it verified are owed to the drafter
            self._extend_for_decode = patch_instance(dw, "draft_extend_for_decode", self._draft_extend_or_rest)
            self.verifier.target_forward = patch_instance(
                self.target_worker.model_runner, "target_forward",
                lambda fb, *a, **k: self.verifier.forward(self._step, fb, *a, **k))
        self.profiler = _profiler(self, switches.profile_path)

    @property
    def tree_set(self):
        """The tree set the policy chooses from (refitted online by `StepTiming` where it calibrates)."""
        return self.controller.tree_set

    @property
    def forced(self) -> ForcedDraft | None:
        return self.verifier.forced

    def init_cuda_graphs(self):
        """SGLang builds the start-up state (backends, and graphs where its flags capture them); then one state per
        tree shape of the set (runtime.py)."""
        super().init_cuda_graphs()
        if self._draft_worker is None:
            return
        if not self.shapes.build(self.plans) and self.ragged:
            logger.info("ENTMTP: ragged verify off: a runtime state's target backend is not entmtp_torch")
            self.ragged, self._shapes = False, {}
            if self.verifier.forced is not None:
                logger.info("ENTMTP: forced spans off (ragged verify is off)")
                self.verifier.forced = None
            self.shape_index = (ShapeIndex.for_trees([t.tree for t in self.tree_set.trees], self.topk,
                                                     self._target_worker.model_runner.device)
                                if self.config.per_row else {})

    def clear_cache_pool(self):
        """SGLang's flush_cache: with the radix cache, what earlier requests wrote (ENTMTP_CROSS_SPANS)."""
        clear = getattr(super(), "clear_cache_pool", None)
        if clear is not None:
            clear()
        if self.verifier.forced is not None:
            self.verifier.forced.clear_shared()

    @property
    def hot_token_id(self):
        """Target id of each draft token when the draft has its own vocabulary, else None (tree_draft.py)."""
        return getattr(self._draft_worker, "hot_token_id", None)

    @property
    def grammar_drafting(self) -> bool:
        """Whether constrained requests get grammar-masked signals and drafts (the grammar objects are read, and
        rolled back, on this thread; under the overlap scheduler the scheduler may be advancing them concurrently,
        so grammar-aware drafting also skips overlapped batches)."""
        return self.config.grammar_drafting

    # -- per step -----------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch) and not batch.forward_mode.is_idle()
        prof = self.profiler if decode else None
        if prof is not None:
            prof.begin_step()
        choosing = 0.0
        if decode and self._draft_worker is not None:
            began = time.perf_counter()
            with prof.timed("choose") if prof is not None else contextlib.nullcontext():
                self._choose(batch)
            choosing = time.perf_counter() - began
        self._last_extend = None
        self.timing.observe_tokens(None)   # a step whose accepted counts never came: one token a row
        start = time.perf_counter()
        try:
            out = super().forward_batch_generation(batch, *args, **kwargs)
        finally:
            self.verifier.restore()
        if decode:
            self.timing.step_done(batch, self._step, time.perf_counter() - start, choosing)
        self._record_signals(batch)
        if prof is not None:
            prof.end_step(tree=REST if self._step.resting else self._step.name, bs=len(batch.reqs))
        return out

    def _choose(self, batch) -> None:
        """The step's decision (step.py), made once: the rules that make a step rest (penalties, positions owed
        to the drafter), then the policy's choice over each request's signal, laid out on the server's indices;
        then applied (the runtime shape, telemetry)."""
        reqs = batch.reqs
        states = [self.requests.of(r) for r in reqs]
        choice, rest, h = None, False, float("nan")
        observer = self.timing.observer
        recording = observer is not None
        pins = [self._pin(r) for r in reqs]   # each request's pinned tree, if any (read once a step)
        mode = step_mode(self.ragged, bool(self.shape_index), recording, pins if recording else ())
        try:
            # penalties: one token per step keeps them exact; ragged, such a request rests as a row of the step
            forced = [needs_plain_decoding([r]) for r in reqs]
            rule = rest_rule(forced, self.resting.owed(reqs), mode, self.resting.max_owed,
                             lambda: self.controller.rests([BATCH]))
            if rule.catch_up:
                self.resting.catch_up(batch, self._draft_worker, self._extend_for_decode,
                                      self.req_to_token_pool.req_to_token, self._record_signals)
            if rule.rest:
                raise _Rest
            # the guard first (timing.py, policy/guard.py): where speculation delivered less than resting at this
            # batch size it rests the step before the policy spends its time on a choice that would not run
            if not any(pins) and self.timing.force_rest(len(reqs)):
                raise _Rest
            self.drafter.grammar_signals(reqs, self.grammar_drafting and not getattr(batch, "enable_overlap", True))
            unknown = least_predictable(self.signal)
            probe = observer.probe_tree(self.telemetry.steps) if recording else None
            rest_name = self.plans[self._rest_tree].tree.name if self._rest_tree is not None else None
            inputs = [RequestInput(r.rid, unknown if st.signal is None else st.signal, st.probs, self._room(r),
                                   rest_name if rests else pin or probe)
                      for r, st, rests, pin in zip(reqs, states, forced, pins)]
            known = [x.signal for x in inputs if x.signal != unknown]
            h = sum(known) / len(known) if known else unknown
            choice = choose_trees(self.controller, inputs, mode, self._shapes, self._shape_tree, self._rest_tree,
                                  self.plans)
        except _Rest:
            rest = True
        except Exception:   # the policy must never fail a request: decode plainly this step
            logger.exception("ENTMTP: tree choice failed; this step decodes without speculation")
            self.requests.clear_owed()
            choice = None
        step = lay_out(choice, len(reqs), self.plans, self.indices, self.shape_index, self._index_by_name,
                       resting=rest, device=batch.seq_lens.device)
        self._step, self._step_reqs = step, list(reqs)
        self.telemetry.record(reqs, step, self.shapes.apply(step), h)

    def _draft_extend_or_rest(self, batch, batch_result, **kwargs):
        """Replaces EagleDraftWorker._draft_extend_for_decode: on a resting step the draft model does not run and the
        requests owe it the positions just verified (resting.py)."""
        if not self._step.resting:
            return self._extend_for_decode(batch, batch_result, **kwargs)
        self.resting.owe(batch, batch_result)
        self._stub_skipped_draft_extend(batch, batch_result)

    def verify(self, batch, *args, **kwargs):
        """SGLang's verify, the step's spans hung into its input first (verifying.py). A resting step verifies as a
        chain (topk 1): its root, and below it the row's span when it has one, so the accepted path is already where
        SGLang's tree compaction would move it, and the KV, token and hidden-state compaction is skipped."""
        step = self._step = self.verifier.spans(batch, self._step, self._step_reqs, self.speculative_num_steps > 0,
                                                self.timing.observer is not None, self._room, self._never_drafts)
        rs = step.ragged
        if rs is not None:   # padding nodes unlinked: SGLang's acceptance and grammar walks never visit them
            spec = batch.spec_info
            if tuple(spec.retrieve_next_token.shape) != tuple(rs.real.shape):
                raise RuntimeError(f"ENTMTP: ragged verify for rows of {tuple(rs.real.shape)} nodes, SGLang's "
                                   f"verify has {tuple(spec.retrieve_next_token.shape)}")
            spec.retrieve_next_token = rs.next_token.to(spec.retrieve_next_token.dtype)
            spec.retrieve_next_sibling = rs.next_sibling.to(spec.retrieve_next_sibling.dtype)
        topk = self.topk
        if step.resting:
            self.topk = 1
        try:
            out = super().verify(batch, *args, **kwargs)
        finally:
            self.topk = topk
        self.verifier.count(batch.reqs, out)
        return out

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        reqs, self._step_reqs = self._step_reqs, []
        forced = self.verifier.take_step()
        if len(reqs) != len(num_correct_drafts_per_req):
            return
        counts = [int(n) for n in num_correct_drafts_per_req]
        self.timing.observe_tokens(sum(counts) + len(counts))   # the drafts accepted and each row's own token
        fed = ForcedDraft.policy_counts(forced, counts) if forced is not None else counts
        if self.verifier.forced is not None and self._step.drafts:
            self.verifier.forced.observe(counts)
        for r, n, m in zip(reqs, counts, fed):
            visibility.note(r, visibility.ACCEPTED, n)
            self.controller.record(r.rid, m)   # acceptance feedback: realized vs expected (drafted depth)

    def _record_signals(self, batch) -> None:
        """Each request's next root signal (and, for a constrained one, its root logits) from the draft extend."""
        out, self._last_extend = self._last_extend, None
        if out is None or out.next_token_logits is None or out.next_token_logits.shape[0] != len(batch.reqs):
            return
        logits = out.next_token_logits
        h = draft_signal(self.signal, logits.float()).tolist()
        top = top_probs(logits).tolist()
        if self.timing.observer is not None:
            self.timing.observer.roots(batch.reqs, logits, self.hot_token_id)
        for i, r in enumerate(batch.reqs):
            st = self.requests.of(r)
            st.signal, st.probs = h[i], tuple(top[i])
            constrained = self.grammar_drafting and grammar_draft.live_grammar(r) is not None
            st.root_logits = logits[i].detach().float().clone() if constrained else None

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

    def _room(self, req) -> int:
        """KV positions left before the context limit: every node of a tree takes one while verifying."""
        ctx = self.target_worker.model_config.context_len
        return max(ctx - len(req.origin_input_ids) - len(req.output_ids), 1)


def _profiler(worker, path):
    """ENTMTP_PROFILE=FILE: time the step's stages (profile.py); None when unset."""
    if path is None or worker._draft_worker is None:
        return None
    from .profile import StepProfiler

    prof = StepProfiler(path)
    dw = worker._draft_worker
    prof.wrap(dw, "draft", "draft")
    prof.wrap(worker, "verify", "verify")
    prof.wrap(dw, "_draft_extend_for_decode", "draft_extend")   # SGLang's call (or the rest's stub)
    prof.wrap(worker.resting, "catch_up", "catch_up")           # inside `choose`
    prof.wrap(worker, "_record_signals", "record")
    prof.wrap(dw.draft_runner, "forward", "draft_forward")
    prof.wrap(worker.target_worker.model_runner, "forward", "target_forward")
    return prof
