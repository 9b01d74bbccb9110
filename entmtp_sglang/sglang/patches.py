"""Every SGLang function and method this package replaces or wraps, with the parameters it relies on, in two tables
checked against the installed SGLang (`check_signature`; a mismatch names what changed).

- `HOOKED`: functions the plugin wraps with SGLang's HookRegistry (plugin.py), checked at load. The modules that
  hook more (admission.py, observe.py, cpu/sampling.py, cpu/linear.py, cpu/rowwise.py) keep their own `HOOKED`
  beside their hooks and check them with the same function.
- `INSTANCE_PATCHES`: SGLang methods the ENTMTP worker replaces on one object (`EntMtpWorker.__init__`), installed
  only through `patch_instance`, which checks the method's parameters first: a patch not in the table cannot be
  installed.

Imports nothing of SGLang at module level (the worker and the plugin both import it).
"""

from __future__ import annotations

import inspect

# Functions wrapped with SGLang's HookRegistry by plugin.py, with the parameters we rely on. Checked at load.
DRAFT_BACKEND_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
OUTPUT_STREAMER = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
PENALTIES = "sglang.srt.sampling.penaltylib.orchestrator.BatchedPenalizerOrchestrator.apply"
HOOKED = {
    DRAFT_BACKEND_FACTORY: ("self", "backend_name", "backend_map", "error_template", "stamps_children"),
    OUTPUT_STREAMER: ("self",),
    PENALTIES: ("self", "logits", "repeat"),
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
