"""The ENTMTP worker: SGLang's EAGLEWorkerV2 drafting one tree of a tree set per decode step.

Per step (per batch: SGLang verifies one `draft_token_num` per batch, so every request of a batch gets the
same tree):
1. signal: each request's draft signal (the tree set's: entropy, or top-1 margin; policy/signals.py) of
   its next root distribution, computed from the logits the draft-extend pass already produced (no extra
   forward). For a request under a grammar (`json_schema`, `regex`, `ebnf`) it is taken over the tokens
   the grammar allows next (grammar_draft.py);
2. `TreeController.choose` (policy/controller.py: the same policy object as the reference engine's, with
   its acceptance feedback, hysteresis, pins and room cap) picks one tree for the batch from every
   request's signal bin or, when the set carries an acceptance predictor, its depth-1 draft
   probabilities; chain:0 in the set means this step decodes without speculation. The tree's node count
   becomes this step's `speculative_num_draft_tokens`;
3. the draft expands that tree level by level (each drafted node attends exactly to its ancestors, via
   `entmtp_torch`'s per-row draft slots); a constrained request's drafts are the top-k among the tokens its
   grammar allows after the node's path. The draft hands SGLang the same candidate encoding EAGLE uses, so
   verification, acceptance, KV compaction and grammar walking are SGLang's own code.

Decisions depend only on logits and accepted counts, which are identical on every tensor-parallel rank,
and on the batch size, so every rank picks the same tree (online calibration, below, refits step costs from
timed steps only in a single-rank server: wall times differ between ranks).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path

import torch

from ..policy.controller import RequestInput, TreeController
from ..policy.signals import draft_signal, least_predictable, top_probs
from ..tree.acceptance import AcceptancePredictor
from . import grammar_draft, observe, visibility
from .attention import MultiStepDraftBackend
from .config import ENV_TREE_TRACE, EntMtpConfig, pin_of
from .recording import StepObserver
from .sglang_api import (
    EAGLEWorkerV2,
    ForwardContext,
    forward_context,
    get_context,
    get_parallel,
    per_step_draft_out_cache_loc,
)
from .tree_plan import plan_tree

logger = logging.getLogger("entmtp_sglang.sglang")


class _PlainStep(Exception):
    """This step decodes without speculation, by rule (not an error)."""


def needs_plain_decoding(reqs) -> bool:
    """Whether some request of the batch must decode one token per step to match plain decoding.

    SGLang applies frequency, presence and repetition penalties and min_new_tokens "relaxed" under
    speculation: one penalty row for every node of a tree, and one counted token per step, so a penalised
    greedy request's output differs from the non-speculative server's. Decoded one token per step from its
    first decode step it is exact; SGLang verifies one tree per batch, so the whole batch decodes plainly."""
    for r in reqs:
        sp = getattr(r, "sampling_params", None)
        if sp is None:
            continue
        if (getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0 or (getattr(sp, "presence_penalty", 0.0)
                                                                    or 0.0) != 0.0:
            return True
        if (getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0:
            return True
        if (getattr(sp, "min_new_tokens", 0) or 0) > len(getattr(r, "output_ids", ()) or ()):
            return True
    return False


class EntMtpWorker(EAGLEWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.config = EntMtpConfig.from_server_args(server_args)
        self.tree_set = self.config.load_tree_set()
        # Each tree is laid out with its own depth as SGLang's num_steps: the accept buffers are
        # num_steps + 1 wide and must not exceed the tree's node count.
        self.plans = [plan_tree(t.tree, self.topk, t.tree.max_depth) for t in self.tree_set.trees]
        self.signal = self.tree_set.signal         # draft_entropy or draft_margin (config checks)
        self.controller = TreeController.for_tree_set(self.tree_set, self.config.policy != "entmtp-bins",
                                                      hysteresis=self.config.hysteresis,
                                                      max_nodes=self.config.max_nodes)
        self.signals: dict[str, float] = {}        # rid -> latest draft signal value
        self.probs: dict[str, tuple] = {}          # rid -> latest depth-1 top-k draft probabilities
        self.histogram = collections.Counter()
        self.steps = 0
        self.last_log = time.monotonic()
        self._plan = self.plans[-1]
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
        self._chosen: int | None = None
        self._grammars: dict[int, object] = {}            # batch row -> grammar object, this step
        self._trace_path = _trace_path(os.environ.get(ENV_TREE_TRACE))
        dw = self._draft_worker
        if dw is not None:
            dw.draft_forward = self._draft_forward_tree
            forward = dw.draft_runner.forward

            def capture(forward_batch, *args, **kwargs):
                out = forward(forward_batch, *args, **kwargs)
                if not forward_batch.forward_mode.is_decode():   # draft extend, not a draft step
                    self._last_extend = out.logits_output
                return out

            dw.draft_runner.forward = capture

    @property
    def hot_token_id(self) -> torch.Tensor | None:
        """Target id of each draft token when the draft has its own vocabulary (an EAGLE-3 draft's d2t, or
        --speculative-token-map), else None. SGLang sets it when the scheduler allocates the draft's memory
        pool, after __init__."""
        return getattr(self._draft_worker, "hot_token_id", None)

    @property
    def grammar_drafting(self) -> bool:
        """Whether constrained requests get grammar-masked signals and drafts. Grammar masks are over the
        target's vocabulary, so a draft with its own vocabulary drafts unmasked. (The grammar objects are read,
        and rolled back, on this thread; under the overlap scheduler the scheduler may be advancing them
        concurrently, so grammar-aware drafting also skips overlapped batches.)"""
        return self.config.grammar_drafting and self.hot_token_id is None

    # -- per step -----------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        if decode and not batch.forward_mode.is_idle() and self._draft_worker is not None:
            self._choose(batch)
        self._last_extend = None
        start = time.perf_counter()
        out = super().forward_batch_generation(batch, *args, **kwargs)
        if decode and self.observer is not None and not batch.forward_mode.is_idle():
            self._observe(batch, time.perf_counter() - start)
        self._record_signals(batch)
        return out

    def _observe(self, batch, seconds: float) -> None:
        obs = self.observer
        try:
            obs.step(batch.reqs, self._plan, self._chosen, seconds, observe.take())
            if obs.online is not None and obs.online.due():
                ts = obs.online.refit()
                self.tree_set = self.controller.tree_set = ts
                self.controller.predictor = AcceptancePredictor.from_json(ts.predictor)
                logger.info("ENTMTP online calibration (refit %d, %d steps): %s", obs.online.refits,
                            obs.online.steps, obs.online.summary())
        except Exception:   # observing must never fail a request
            logger.exception("ENTMTP: recording a verified step failed; recording stops")
            self.observer = None

    def _choose(self, batch) -> None:
        reqs = batch.reqs
        plan, h = None, float("nan")
        try:
            if needs_plain_decoding(reqs):   # penalties: one token per step keeps them exact
                raise _PlainStep
            self._grammar_signals(batch, reqs)
            unknown = least_predictable(self.signal)
            probe = self.observer.probe_tree(self.steps) if self.observer is not None else None
            inputs = [RequestInput(r.rid, self.signals.get(r.rid, unknown), self.probs.get(r.rid, ()), self._room(r),
                                   self._pin(r) or probe) for r in reqs]
            known = [x.signal for x in inputs if x.signal != unknown]
            h = sum(known) / len(known) if known else unknown
            idx = self.controller.choose(inputs, len(reqs))
            if idx is not None:
                plan = self.plans[idx]
        except _PlainStep:
            pass
        except Exception:   # the policy must never fail a request: decode plainly this step
            logger.exception("ENTMTP: tree choice failed; this step decodes without speculation")
        self._plan = plan
        self._chosen = self._index_by_name.get(plan.tree.name if plan is not None else "chain:0")
        name = plan.tree.name if plan is not None else "plain"
        n, steps = (plan.num_nodes, plan.num_steps) if plan is not None else (1, 0)
        self.histogram[name] += 1
        self.steps += 1
        self._trace(reqs, name)
        self._step_reqs = list(reqs)
        for r in reqs:
            visibility.note(r, visibility.TREES, name)
        dw = self._draft_worker
        if (self.speculative_num_draft_tokens, self.speculative_num_steps) != (n, steps):
            self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = n
            self.speculative_num_steps = dw.speculative_num_steps = steps
            get_context().override("entmtp.tree", speculative_num_draft_tokens=n, speculative_num_steps=steps)
        if plan is not None and steps > 1:
            backend = dw.draft_attn_backend
            if not isinstance(backend, MultiStepDraftBackend):
                raise RuntimeError("ENTMTP drafts fixed trees with the entmtp_torch attention backend; start "
                                   "the server with --attention-backend entmtp_torch (CPU) or "
                                   "--speculative-draft-attention-backend entmtp_torch (GPU) (draft backend: "
                                   f"{type(backend).__name__})")
            backend.set_draft_rows(*_row_tensors(plan))
        if time.monotonic() - self.last_log > self.config.log_interval_s:
            self.last_log = time.monotonic()
            logger.info("ENTMTP trees chosen over %d steps: %s (last batch mean %s %.2f)", self.steps,
                        ", ".join(f"{k}={v}" for k, v in self.histogram.most_common()), self.signal, h)

    def _trace(self, reqs, name: str) -> None:
        """ENTMTP_TREE_TRACE=DIR: one JSON line per decode step in this rank's file, so ranks can be compared."""
        if self._trace_path is not None:
            with open(self._trace_path, "a") as f:
                f.write(json.dumps({"step": self.steps, "tree": name, "rids": [r.rid for r in reqs]}) + "\n")

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
                masked = grammar_draft.grammar_signal(logits, g, getattr(g, "vocab_size", logits.shape[-1]),
                                                      self.signal, with_probs=True)
            except Exception:
                logger.exception("ENTMTP: grammar-masked %s failed for %s; using the unmasked one",
                                 self.signal, r.rid)
                continue
            if masked is not None:
                self.signals[r.rid], self.probs[r.rid] = masked
            self._grammars[i] = g

    def _room(self, req) -> int:
        """KV positions left before the context limit: every node of a tree takes one while verifying."""
        ctx = self.target_worker.model_config.context_len
        return max(ctx - len(req.origin_input_ids) - len(req.output_ids), 1)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        reqs, self._step_reqs = self._step_reqs, []
        if len(reqs) == len(num_correct_drafts_per_req):
            for r, n in zip(reqs, num_correct_drafts_per_req):
                visibility.note(r, visibility.ACCEPTED, int(n))
                self.controller.record(r.rid, int(n))   # acceptance feedback: realized vs expected

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
        """Replaces EagleDraftWorker.draft_forward: returns (parent_list, top_scores_index, tokens, None)."""
        dw = self._draft_worker
        plan = self._plan
        spec_info = forward_batch.spec_info
        if forward_batch.forward_mode.is_idle():
            return dw._draft_forward_idle(forward_batch, spec_info)
        topk, steps = self.topk, plan.num_steps
        topk_index = spec_info.topk_index                       # (bs, topk) root children by rank
        hot = self.hot_token_id
        if hot is not None:
            topk_index = hot[topk_index]
        bs = topk_index.shape[0]
        dev = topk_index.device
        token: dict[int, torch.Tensor] = {}
        hidden_out: dict[int, torch.Tensor] = {0: spec_info.hidden_states}
        parents = plan.tree.parents
        grammars = self._grammars if len(self._step_reqs) == bs else {}
        if grammars:
            topk_index = topk_index.clone()
            for row, g in grammars.items():
                logits = self._root_logits.get(self._step_reqs[row].rid)
                top = None if logits is None else self._grammar_topk(logits, g, ())
                if top is not None:
                    topk_index[row] = top.to(topk_index)
        for i in range(1, plan.num_nodes):
            if plan.depth[i] == 1:
                token[i] = topk_index[:, plan.rank[i]]
        out_cache_loc = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, bs, topk, steps)
        for step, col in enumerate(plan.columns):
            if not col:
                break
            rows = list(col) + [col[0]] * (topk - len(col))
            forward_batch.input_ids = torch.stack([token[n] for n in rows], 1).flatten()
            spec_info.hidden_states = torch.stack([hidden_out[parents[n]] for n in rows], 1).flatten(0, 1)
            forward_batch.out_cache_loc = out_cache_loc[step]
            with forward_context(ForwardContext(attn_backend=dw.draft_attn_backend.attn_backends[step]),
                                 forward_batch=forward_batch):
                logits_output = dw.draft_runner.forward(forward_batch).logits_output
            forward_batch.positions.add_(1)
            logits = logits_output.next_token_logits.view(bs, topk, -1)
            hid = logits_output.hidden_states.view(bs, topk, -1)
            top = torch.topk(logits, topk, dim=-1).indices      # (bs, topk rows, topk ranks)
            if self.observer is not None:
                self.observer.expanded(col, logits, hot)
            if hot is not None:
                top = hot[top]
            if grammars and step + 1 < steps:
                self._grammar_children(top, logits, col, token, plan, grammars)
            for c, n in enumerate(col):
                hidden_out[n] = hid[:, c]
            for i in range(1, plan.num_nodes):
                if plan.depth[i] == step + 2:
                    c = col.index(parents[i])
                    token[i] = top[:, c, plan.rank[i]]
        parent_list = torch.tensor(plan.parent_list, dtype=torch.long, device=dev).expand(bs, -1).contiguous()
        selected = torch.tensor(plan.selected, dtype=torch.long, device=dev).expand(bs, -1).contiguous()
        draft_tokens = torch.stack([token[i] for i in plan.selected_nodes], 1)
        if self.observer is not None:
            self.observer.drafted(token)
        return parent_list, selected, draft_tokens, None

    def _grammar_topk(self, logits, grammar, path):
        try:
            return grammar_draft.grammar_topk(logits, grammar, path, self.topk,
                                              getattr(grammar, "vocab_size", logits.shape[-1]))
        except Exception:   # drafting must never fail a request: keep the unmasked drafts
            logger.exception("ENTMTP: grammar-aware drafting failed; unmasked drafts this node")
            return None

    def _grammar_children(self, top, logits, col, token, plan, grammars) -> None:
        """Replace, for constrained rows, each drafted node's children by the top-k its grammar allows."""
        parents = plan.tree.parents
        host = {n: t.tolist() for n, t in token.items()}
        for row, g in grammars.items():
            for c, n in enumerate(col):
                path, a = [], n
                while a != 0:
                    path.append(host[a][row])
                    a = parents[a]
                masked = self._grammar_topk(logits[row, c], g, path[::-1])
                if masked is not None:
                    top[row, c] = masked.to(top)


def _trace_path(trace_dir: str | None) -> Path | None:
    """This process's tree trace file under `trace_dir` (None: no trace), named by tensor-parallel rank and pid
    (data-parallel replicas are separate processes with tp rank 0)."""
    if not trace_dir:
        return None
    tp_rank = getattr(get_parallel(), "tp_rank", 0)
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    return Path(trace_dir) / f"trees-tp{tp_rank}-pid{os.getpid()}.jsonl"


def _row_tensors(plan):
    offs, valid = [], []
    for rows in plan.ancestor_offsets:
        a = max(len(r) for r in rows)
        o = torch.zeros(len(rows), a, dtype=torch.long)
        v = torch.zeros(len(rows), a, dtype=torch.bool)
        for c, r in enumerate(rows):
            o[c, : len(r)] = torch.tensor(r, dtype=torch.long)
            v[c, : len(r)] = True
        offs.append(o)
        valid.append(v)
    return offs, valid
