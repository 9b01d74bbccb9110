"""Every SGLang function and method this package replaces or wraps, with the parameters it relies on, in two tables
checked against the installed SGLang (`check_signature`; a mismatch names what changed).

- `HOOKED`: every function the package wraps with SGLang's HookRegistry, whichever module hooks it (plugin.py,
  admission.py, observe.py, requests.py, cpu/sampling.py, cpu/linear.py, cpu/rowwise.py). Each module imports its
  names from here and checks its own entries (`hooked(...)`) right before it registers them; no other module keeps
  a table.
- `INSTANCE_PATCHES`: SGLang methods the ENTMTP worker replaces on one object (`EntMtpWorker.__init__`), installed
  only through `patch_instance`, which checks the method's parameters first: a patch not in the table cannot be
  installed.

Imports nothing of SGLang at module level (the worker and the plugin both import it).
"""

from __future__ import annotations

import inspect

# Functions wrapped with SGLang's HookRegistry, by the module that hooks them, with the parameters we rely on.
# plugin.py
DRAFT_BACKEND_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
OUTPUT_STREAMER = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
PENALTIES = "sglang.srt.sampling.penaltylib.orchestrator.BatchedPenalizerOrchestrator.apply"
# admission.py
VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
INPUT_LENGTH = "sglang.srt.managers.utils.validate_input_length"
AVERAGE_ACCEPT = ("sglang.srt.managers.scheduler_components.internal_state."
                  "SchedulerInternalStateController._average_accept_length")
RESERVED = "sglang.srt.managers.utils.compute_num_reserved_tokens"
ROW_HEADROOM = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"
# observe.py
SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
# cpu/sampling.py
USES_GREEDY = "sglang.srt.speculative.eagle_utils._verify_uses_greedy"
# cpu/linear.py
LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
# cpu/rowwise.py
RMSNORM = "sglang.srt.layers.layernorm.RMSNorm.forward_native"
SILU_AND_MUL = "sglang.srt.layers.activation.SiluAndMul.forward_native"
ROPE = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
# requests.py
RELEASE = "sglang.srt.mem_cache.common.release_kv_cache"
SPECULATIVE_STATE = ("sglang.srt.managers.scheduler_components.internal_state."
                     "SchedulerInternalStateController._add_speculative")
HOOKED = {
    # plugin.py: adds the `entmtp_torch` draft attention backend to the factory's name -> constructor maps
    DRAFT_BACKEND_FACTORY: ("self", "backend_name", "backend_map", "error_template", "stamps_children"),
    # plugin.py (visibility.py's hook): a streamer subclass that adds ENTMTP's per-request meta_info fields
    OUTPUT_STREAMER: ("self",),
    # plugin.py: plain decoding applies penalties in one order (repeat=1), as the other paths do
    PENALTIES: ("self", "logits", "repeat"),
    # admission.py: refuses (HTTP 400) empty prompts, out-of-vocabulary ids and bad custom_params in the tokenizer
    VALIDATE: ("self", "obj", "input_ids"),
    # admission.py: ENTMTP reserves no extra input tokens, so it admits exactly what plain SGLang admits
    RESERVED: (),
    # admission.py: the req_to_token row's headroom holds what ENTMTP's decode step allocates past the context
    ROW_HEADROOM: (),
    # admission.py: the scheduler's backstop for the prompt checks (requests that bypass the tokenizer manager)
    INPUT_LENGTH: ("req", "max_req_input_len", "allow_auto_truncate"),
    # admission.py: /get_server_info's avg_spec_accept_length includes the interval not yet rolled up
    AVERAGE_ACCEPT: ("self",),
    # observe.py: keeps the target's argmax per tree node and root entropy after verification (calibration)
    SAMPLE: ("verify_input", "batch", "logits_output"),
    # cpu/sampling.py: on CPU, ENTMTP verifies sampled requests by rejection sampling instead of greedily
    USES_GREEDY: ("is_all_greedy", "is_cpu", "is_hip", "is_xpu", "use_rejection_sampling"),
    # cpu/linear.py (CPU engine): float32 linear layers through the few-row kernel / oneDNN (batch-invariant)
    LINEAR_APPLY: ("self", "layer", "x", "bias"),
    # cpu/linear.py (CPU engine): the float32 output layer through the same path
    LM_HEAD: ("self", "hidden_states", "lm_head", "embedding_bias"),
    # cpu/rowwise.py (CPU engine, ops built): RMSNorm as one row-wise op
    RMSNORM: ("self", "x", "residual", "post_residual_addition", "quant_linear"),
    # cpu/rowwise.py (CPU engine, ops built): SiLU-and-mul as one row-wise op
    SILU_AND_MUL: ("self", "x"),
    # cpu/rowwise.py (CPU engine, ops built): the rotary embedding as one row-wise op
    ROPE: ("self", "positions", "query", "key", "offsets", "fused_set_kv_buffer_arg"),
    # requests.py: a request's KV given back (finished, aborted, retracted) drops its per-request state
    RELEASE: ("req", "tree_cache"),
    # requests.py: /server_info reports what the per-request tables hold (entmtp_requests)
    SPECULATIVE_STATE: ("self", "state"),
}

# SGLang methods the ENTMTP worker replaces on one object, with the parameters the replacement relies on:
# name -> (the SGLang method, its parameters). Checked when installed (`patch_instance`).
_DRAFT_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
INSTANCE_PATCHES = {
    # the draft worker's draft: each request's tree (EntMtpWorker._draft_forward_tree)
    "draft_forward": (f"{_DRAFT_WORKER}.draft_forward", ("self", "forward_batch")),
    # the draft model runner's forward, wrapped to keep the draft extend's logits (the next step's signal)
    "draft_runner_forward": (f"{_MODEL_RUNNER}.forward", ("self", "forward_batch")),
    # the draft worker's extend after verify, skipped on a resting step (EntMtpWorker._draft_extend_or_rest)
    "draft_extend_for_decode": (f"{_DRAFT_WORKER}._draft_extend_for_decode", ("self", "batch", "batch_result")),
    # the target model runner's forward: a resting step's verify runs as a decode (_target_forward_or_decode)
    "target_forward": (f"{_MODEL_RUNNER}.forward", ("self", "forward_batch")),
}


class HookSignatureError(RuntimeError):
    pass


class UnregisteredPatchError(LookupError):
    pass


def hooked(*dotted: str) -> dict[str, tuple[str, ...]]:
    """The `HOOKED` entries of `dotted`, in that order: what one hooking module checks before it registers them.
    A name not in the table is a KeyError (every hook is registered here)."""
    return {name: HOOKED[name] for name in dotted}


def check_signature(dotted: str, expected: tuple[str, ...]) -> None:
    """Fail with a message naming `dotted` if its parameters are not `expected` (SGLang changed)."""
    import pkgutil

    try:
        obj = pkgutil.resolve_name(dotted)
    except (ImportError, AttributeError) as e:
        raise HookSignatureError(f"entmtp: SGLang has no {dotted} ({e}); this entmtp-sglang supports "
                                 f"sglang 0.5.23") from e
    fn = inspect.unwrap(obj)
    got = tuple(inspect.signature(fn).parameters)
    if got[: len(expected)] != expected:
        raise HookSignatureError(f"entmtp: {dotted} has parameters {got}, expected {expected} "
                                 f"(written for sglang 0.5.23)")


def patch_instance(obj, name: str, replacement):
    """Replace the SGLang method `INSTANCE_PATCHES[name]` on `obj` alone by `replacement`, after checking the
    method's parameters; returns what `obj` had there (to call on). Only a patch in the table can be installed."""
    if name not in INSTANCE_PATCHES:
        raise UnregisteredPatchError(f"entmtp: no instance patch {name!r} in patches.INSTANCE_PATCHES "
                                     f"(registered: {', '.join(INSTANCE_PATCHES)})")
    dotted, params = INSTANCE_PATCHES[name]
    check_signature(dotted, params)
    attr = dotted.rpartition(".")[2]
    original = getattr(obj, attr)
    setattr(obj, attr, replacement)
    return original
