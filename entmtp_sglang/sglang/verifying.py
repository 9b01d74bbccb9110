"""Verifying a step inside SGLang: the spans hung into its verify input, and the target's forward over it.

Before SGLang's verify (`spans`): each row that may take tokens beyond one per step (a constrained row: the text its
grammar decides; a free row: its own repeats) gets them below its leaves (forced_draft.py), widening the step's
verify to N' columns (back to N after the step, `restore`). The target's forward (`forward`) then runs
- a ragged step's real tokens only (ragged.py: packed, planned by `entmtp_torch`, scattered back to `bs x N`);
- a resting step's one-token verify as the plain decode forward it is (SGLang's decode attention and output path),
  the batch reading as a verify again for SGLang's acceptance code;
- anything else as SGLang's own.
After the verify, `count` notes per request what its spans verified and accepted (meta_info, visibility.py).
"""

from __future__ import annotations

from . import grammar_draft, visibility
from .cpu.attention import RAGGED_ATTR
from .forced_draft import ForcedDraft, ForcedStep, token_threshold
from .ragged import scatter_rows
from .resting import needs_plain_decoding
from .runtime import RuntimeShapes
from .sglang_api import ForwardMode
from .step import StepDecision

# ENTMTP_REST_SPANS=auto: a resting step's rows take spans in a step of fewer requests than this. At one to three
# requests a step reads the weights once whatever the tokens verified (a span token is nearly free); from four on a
# CPU verifies a token at a real cost, and the spans of resting steps cost more than they returned (the product
# benchmark's mixed batch at 8 requests, 2026-12-07: ENTMTP 0.79x plain with the package with them, 1.00x without;
# prose at 4 requests 0.88x against 0.98x; bench/results/speculation_gap/)
REST_SPAN_ROWS = 4


def rest_spans_below(setting: str | bool) -> float:
    """The batch sizes whose resting steps take spans, as the number of requests they stay below: `auto`
    (`REST_SPAN_ROWS`), `1`/True (every batch size), `0`/False (none)."""
    if setting in ("auto",):
        return REST_SPAN_ROWS
    if setting in ("1", True):
        return float("inf")
    if setting in ("0", False):
        return 0
    raise ValueError(f"ENTMTP_REST_SPANS takes 0, 1 or auto, got {setting!r}")


class Verifier:
    """The verify part. `forced`: the forced-span drafter or None; `target_forward`: SGLang's target model runner
    forward; `controller`: the policy (its step cost prices a span token); `shapes`: the runtime shapes (the verify
    width); `rest_spans`: at which batch sizes a resting step's rows take spans (ENTMTP_REST_SPANS: `auto`, `1`,
    `0`; `rest_spans_below`)."""

    def __init__(self, forced: ForcedDraft | None, target_forward, controller, shapes: RuntimeShapes,
                 rest_spans: str | bool):
        self.forced, self.target_forward, self.controller, self.shapes = forced, target_forward, controller, shapes
        # the batch sizes whose resting steps take spans: below this many requests (ENTMTP_REST_SPANS)
        self.rest_spans_below = rest_spans_below(rest_spans)
        self.step: ForcedStep | None = None     # this step's spans, until SGLang reports its acceptance
        self._width: int | None = None          # the width the step's spans widened (restored after the step)

    def spans(self, batch, step: StepDecision, step_reqs, speculating: bool, recording: bool,
              room, never_drafts) -> StepDecision:
        """Hang the step's spans into SGLang's verify input (`batch.spec_info`); returns the step's decision with the
        widened ragged layout (unchanged when no row takes a span). `speculating`: the step drafts; `room(req)`: KV
        positions left; `never_drafts(req)`: a request that takes no spans."""
        self.step = None
        if (self.forced is None or len(step_reqs) != len(batch.reqs)
                or not (self.rest_spans_below > len(step_reqs) and not recording if step.resting else speculating)):
            return step
        reqs = batch.reqs
        grammars = {}   # row -> its live grammar, or None for a row without one (its spans: its own repeats)
        if not getattr(batch, "enable_overlap", True):
            for i, r in enumerate(reqs):
                if never_drafts(r) or needs_plain_decoding([r]):
                    continue
                if getattr(r, "grammar", None) is None:
                    if not recording:   # (a calibration records the drafter's own acceptance on free rows)
                        grammars[i] = None
                elif (g := grammar_draft.live_grammar(r)) is not None:
                    grammars[i] = g
        forced = self.forced.extend(batch.spec_info, step.ragged, reqs, grammars, [room(r) for r in reqs],
                                    self._threshold(step, len(reqs)) if grammars else 0.0)
        if forced is None:
            return step
        self.step, self._width = forced, forced.base_width
        self.shapes.set_verify_width(forced.layout.num_nodes)
        return step.with_ragged(forced.ragged)

    def restore(self) -> None:
        """After the step: the verify and draft extend ran N' wide, back to the state's N."""
        if self._width is not None:
            self.shapes.set_verify_width(self._width)
            self._width = None

    def _threshold(self, step: StepDecision, rows: int) -> float:
        """A verified token's price in emitted tokens this step (forced_draft.token_threshold): the step cost the
        policy prices ragged steps by (`TreeController.ragged_step_cost`: this server's own fit once it has one),
        one more token against the whole step, which emits `rows` times the running mean of tokens per row."""
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

    def count(self, reqs, out) -> None:
        """What each request's spans verified and accepted this step, into its meta_info."""
        if self.step is None:
            return
        counted = self.forced.verified(self.step, reqs, getattr(out, "accept_index", None))
        for r, (fv, fa, lv, la) in zip(reqs, counted):
            if fv or not lv:
                visibility.note(r, visibility.FORCED, [fv, fa])
            if lv:
                visibility.note(r, visibility.LOOKUP, [lv, la])

    def take_step(self) -> ForcedStep | None:
        """This step's spans, once (SGLang reported the step's acceptance)."""
        step, self.step = self.step, None
        return step

    # -- the target's forward ------------------------------------------------------------------------
    def forward(self, step: StepDecision, forward_batch, *args, **kwargs):
        """Replaces the target model runner's forward for `step` (see the module's docstring)."""
        spec = forward_batch.spec_info
        if step.ragged is not None and forward_batch.forward_mode.is_target_verify():   # (a resting step's layout
            # is ragged only when its rows took spans)
            return self._ragged(step, forward_batch, *args, **kwargs)
        if not (step.resting and forward_batch.forward_mode.is_target_verify()
                and int(getattr(spec, "draft_token_num", 0) or 0) == 1):
            return self.target_forward(forward_batch, *args, **kwargs)
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
            return self.target_forward(forward_batch, *args, **kwargs)
        finally:
            (forward_batch.forward_mode, forward_batch.seq_lens, forward_batch.seq_lens_cpu,
             forward_batch.seq_lens_sum) = saved

    def _ragged(self, step: StepDecision, forward_batch, *args, **kwargs):
        """The target's verify forward over the rows' real tokens only (ragged.py): input ids, positions and cache
        locations packed, `entmtp_torch` planning the packed queries, then logits and hidden states scattered
        back to SGLang's `bs x N` layout (padding rows 0, never accepted: unlinked in the worker's verify)."""
        rs = step.ragged
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
            out = self.target_forward(forward_batch, *args, **kwargs)
        finally:
            forward_batch.input_ids, forward_batch.positions, forward_batch.out_cache_loc = saved
            setattr(spec, RAGGED_ATTR, None)
        lo = out.logits_output
        lo.next_token_logits = scatter_rows(lo.next_token_logits, idx, total)
        if lo.hidden_states is not None:
            lo.hidden_states = scatter_rows(lo.hidden_states, idx, total)
        return out
