"""Drafting a step's trees inside SGLang: what replaces `EagleDraftWorker.draft_forward` (the draft part).

Reads the step's decision (step.py `StepDecision`: the shape tree's plan and indices, each row's tree) and expands
each row's tree level by level on device tensors (tree_index.py `draft_rows` / `draft_tree`); returns the candidate
encoding SGLang's EAGLE verify takes (parent_list, selected, tokens). A request under a grammar drafts, at its root
and at every node, the top-k among the tokens its grammar allows after the node's path in its own tree
(grammar_draft.py); its grammar-masked signal is taken from the root logits the request's entry keeps
(`grammar_signals`). Calibration records, when on, read each level on the host.

No SGLang import beyond the adapter's own names (sglang_api.py).
"""

from __future__ import annotations

import logging

from . import grammar_draft
from .requests import RequestTable
from .sglang_api import ForwardContext, forward_context, per_step_draft_out_cache_loc
from .step import StepDecision
from .tree_index import draft_rows, draft_tree

logger = logging.getLogger("entmtp_sglang.sglang")


class TreeDrafter:
    """The draft part. `draft_worker`: SGLang's EagleDraftWorker; `requests`: the per-request table (root logits,
    signals); `vocab_size`: the target's; `topk`: SGLang's; `signal`: the tree set's signal kind."""

    def __init__(self, draft_worker, requests: RequestTable, vocab_size: int, topk: int, signal: str):
        self.dw, self.requests, self.vocab_size = draft_worker, requests, vocab_size
        self.topk, self.signal = topk, signal
        self.grammars: dict[int, object] = {}   # batch row -> its live grammar, this step (`grammar_signals`)

    @property
    def hot_token_id(self):
        """Target id of each draft token when the draft has its own vocabulary (an EAGLE-3 draft's d2t, or
        --speculative-token-map), else None. SGLang sets it when the scheduler allocates the draft's memory pool."""
        return getattr(self.dw, "hot_token_id", None)

    def grammar_signals(self, reqs, enabled: bool) -> None:
        """Constrained requests (`enabled`: grammar drafting on and the batch not overlapped): the grammar-masked
        signal of the stored root logits, now that the grammar has taken the last verified tokens; and the rows whose
        drafting consults the grammar this step."""
        self.grammars = {}
        if not enabled:
            return
        for i, r in enumerate(reqs):
            g = grammar_draft.live_grammar(r)
            st = self.requests.get(r)
            logits = st.root_logits if st is not None else None
            if g is None or logits is None:
                continue
            try:
                masked = grammar_draft.grammar_signal(logits, g, self._vocab(g, logits), self.signal,
                                                      with_probs=True, hot=self.hot_token_id)
            except Exception:
                logger.exception("ENTMTP: grammar-masked %s failed for %s; using the unmasked one", self.signal, r.rid)
                continue
            if masked is not None:
                st.signal, st.probs = masked
            self.grammars[i] = g

    def draft(self, forward_batch, step: StepDecision, reqs, observer):
        """Replaces EagleDraftWorker.draft_forward: returns (parent_list, top_scores_index, tokens, None) for `step`'s
        trees. `reqs`: the step's requests (their grammars, when drafting consults them); `observer`: the calibration
        recorder or None."""
        dw = self.dw
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
        grammars = self.grammars if len(reqs) == bs else {}
        if grammars:
            root_top = root_top.clone()
            for row, g in grammars.items():
                st = self.requests.get(reqs[row])
                logits = st.root_logits if st is not None else None
                top = None if logits is None else self._topk(logits, g, ())
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
            if observer is not None:
                observer.expanded(plan.columns[level], logits, hot)
            if grammars and level + 1 < steps:
                self._children(step, top, logits, level, tokens, row_plans, grammars)

        eager = observer is not None or bool(grammars)
        if rows is not None:   # each row its own tree
            tokens = draft_rows(rows, root_top, spec_info.hidden_states, forward_level, hot,
                                on_level if eager else None)
            return rows.parent_list, rows.selected, tokens.gather(1, rows.selected_nodes), None
        tokens = draft_tree(index, root_top, spec_info.hidden_states, forward_level, hot, on_level if eager else None)
        if observer is not None:
            observer.drafted({n: tokens[:, n] for n in range(1, plan.num_nodes)})
        return (index.parent_list.expand(bs, -1).contiguous(), index.selected.expand(bs, -1).contiguous(),
                tokens[:, index.selected_nodes], None)

    def _vocab(self, grammar, logits) -> int:
        """The target vocabulary the grammar's masks cover."""
        return int(getattr(grammar, "vocab_size", 0) or self.vocab_size or logits.shape[-1])

    def _topk(self, logits, grammar, path):
        try:
            return grammar_draft.grammar_topk(logits, grammar, path, self.topk, self._vocab(grammar, logits),
                                              hot=self.hot_token_id)
        except Exception:   # drafting must never fail a request: keep the unmasked drafts
            logger.exception("ENTMTP: grammar-aware drafting failed; unmasked drafts this node")
            return None

    def _children(self, step: StepDecision, top, logits, level, token, plans, grammars) -> None:
        """Replace, for constrained rows, each drafted node's children by the top-k its grammar allows, following
        each row's own tree (`plans[row]`)."""
        host = token.tolist()                      # (bs, num_nodes): the nodes drafted so far
        for row, g in grammars.items():
            plan = plans[row]
            parents = plan.tree.parents
            col = plan.columns[level] if level < len(plan.columns) else ()
            real = step.row_real[row] if step.row_real else plan.num_nodes
            for c, n in enumerate(col):
                if n >= real:   # padding (ragged.pad_tree): never verified
                    continue
                path, a = [], n
                while a != 0:
                    path.append(host[row][a])
                    a = parents[a]
                masked = self._topk(logits[row, c], g, path[::-1])
                if masked is not None:
                    top[row, c] = masked.to(top)
