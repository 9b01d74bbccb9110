"""The runtime shape of a step: which of SGLang's runtime states (attention backends, graphs, `num_steps` and
`num_draft_tokens`) the worker runs a step in, switched once per step from the step's decision.

One `SpecRuntimeState` per tree shape of the set (shapes.py), built with upstream's `build_adaptive_runtime_state`;
`apply` makes a step's shape the worker's (a resting step verifies one token with no draft levels on the last
state's backends), `set_verify_width` widens a step's verify for forced spans and back. Whether rows of a step
verify their own node counts (ragged verify) is decided here too, at start-up (`ragged_verify_on`).
"""

from __future__ import annotations

import logging

from .cpu.attention import NAME as ATTENTION_NAME
from .cpu.attention import MultiStepDraftBackend, TorchTreeAttnBackend
from .sglang_api import SpecRuntimeState, draft_contexts, get_context
from .shapes import Shape, ShapeStates
from .step import StepDecision

logger = logging.getLogger("entmtp_sglang.sglang")


def ragged_verify_on(server_args, config, ragged_setting: bool, has_rest_tree: bool) -> bool:
    """Whether rows of a speculating step verify their own node counts (resting rows among them): on unless
    ENTMTP_RAGGED=0 (`ragged_setting` False), with per-request trees, a tree set holding chain:0 and the
    `entmtp_torch` target backend (the one with a ragged verify plan); logged at start-up either way."""
    # (the target's backend objects are built later; RuntimeShapes.build checks each runtime state's)
    backend = (getattr(server_args, "decode_attention_backend", None)
               or getattr(server_args, "attention_backend", None))
    reason = ("ENTMTP_RAGGED=0" if not ragged_setting
              else "ENTMTP_PER_ROW_TREES=0" if not config.per_row
              else "the tree set has no chain:0" if not has_rest_tree
              else f"the target attention backend is {backend}, not {ATTENTION_NAME}"
              if backend != ATTENTION_NAME else None)
    if reason is None:
        logger.info("ENTMTP: ragged verify on: each request verifies its own node count, down to a resting "
                    "row (its root alone) inside a speculating step; the target runs only the real tokens")
        return True
    logger.info("ENTMTP: ragged verify off (%s): every row of a speculating step verifies the step's node "
                "count", reason)
    return False


class RuntimeShapes:
    """The worker's runtime states, one per tree shape. `worker`: the EAGLEWorkerV2 whose (and whose draft worker's)
    `speculative_num_steps` / `speculative_num_draft_tokens` and backends SGLang reads."""

    def __init__(self, worker):
        self.worker = worker
        self.states: ShapeStates[SpecRuntimeState] | None = None   # built by `build` (init_cuda_graphs)
        self.current: SpecRuntimeState | None = None

    def build(self, plans) -> bool:
        """One state per tree shape, the start-up state among them; returns whether every state's target backend is
        `entmtp_torch` (ragged verify needs it)."""
        w = self.worker
        dw, runner = w._draft_worker, w._target_worker.model_runner
        start = SpecRuntimeState(
            speculative_num_steps=w.speculative_num_steps,
            speculative_num_draft_tokens=w.speculative_num_draft_tokens,
            draft_attn_backend=dw.draft_attn_backend, cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=runner.attn_backend, target_graph_runner=runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend)
        with draft_contexts(dw):
            self.states = ShapeStates.build(
                plans, lambda s: w.build_adaptive_runtime_state(s.num_steps, s.num_draft_tokens),
                built={Shape(start.speculative_num_steps, start.speculative_num_draft_tokens): start})
        self.current = start
        shapes = ", ".join(f"{s.num_steps} levels x {s.num_draft_tokens} tokens" for s in sorted(self.states.states))
        logger.info("ENTMTP: %d runtime states for the %d trees of the set (%s)", len(self.states), len(plans), shapes)
        return all(isinstance(s.target_attn_backend, TorchTreeAttnBackend) for s in self.states.states.values())

    def switch(self, state: SpecRuntimeState) -> None:
        """Make `state` the worker's: what upstream's `apply_runtime_state` does, without its early return when the
        step count is unchanged (trees of one depth differ in width) and without its log line per switch."""
        if state is self.current:
            return
        w = self.worker
        dw, runner = w._draft_worker, w._target_worker.model_runner
        w.speculative_num_steps = dw.speculative_num_steps = state.speculative_num_steps
        w.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = state.speculative_num_draft_tokens
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
        self.current = state

    def apply(self, step: StepDecision) -> tuple[int, int] | None:
        """Make `step`'s shape the worker's and hand the draft backend the rows' ancestor slots; returns the state's
        (levels, tokens), None while resting (one token verified, no draft levels, on the last state's backends)."""
        w = self.worker
        n, steps = step.num_nodes, step.num_steps
        dw = w._draft_worker
        state = self.states.state_of(step.chosen) if step.plan is not None and self.states is not None else None
        if state is not None:
            self.switch(state)
        elif (w.speculative_num_draft_tokens, w.speculative_num_steps) != (n, steps):
            w.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = n
            w.speculative_num_steps = dw.speculative_num_steps = steps
            get_context().override("entmtp.tree", speculative_num_draft_tokens=n, speculative_num_steps=steps)
            self.current = None
        if step.plan is not None and steps > 1:
            backend = dw.draft_attn_backend
            if not isinstance(backend, MultiStepDraftBackend):
                raise RuntimeError("ENTMTP drafts fixed trees with the entmtp_torch attention backend; start "
                                   "the server with --attention-backend entmtp_torch (CPU) or "
                                   "--speculative-draft-attention-backend entmtp_torch (GPU) (draft backend: "
                                   f"{type(backend).__name__})")
            rows = step.rows if step.rows is not None else step.index
            backend.set_draft_rows(list(rows.row_offsets), list(rows.row_valid))
        state = self.current
        return None if state is None else (state.speculative_num_steps, state.speculative_num_draft_tokens)

    def set_verify_width(self, n: int) -> None:
        """Tokens verified per row (SGLang's `speculative_num_draft_tokens`, read by its verify and draft extend)."""
        w = self.worker
        w.speculative_num_draft_tokens = w._draft_worker.speculative_num_draft_tokens = n
        get_context().override("entmtp.tree", speculative_num_draft_tokens=n,
                               speculative_num_steps=w.speculative_num_steps)
