"""The `sglang.srt.plugins` entry point: makes ENTMTP and the `entmtp_torch` attention backend known to SGLang.

SGLang calls `register()` with no arguments in every process it starts (CLI, `sglang.Engine`, each
scheduler), before it parses server arguments; `register()` is idempotent. SGLang swallows exceptions
raised by plugins (it only logs them), so every failure here is logged loudly with what to do.
"""

from __future__ import annotations

import logging
import sys

from .patches import DRAFT_BACKEND_FACTORY, OUTPUT_STREAMER, PENALTIES, check_signature, hooked

logger = logging.getLogger("entmtp_sglang.sglang")

_DONE = False


def _draft_backend_around(original, self, backend_name, backend_map, error_template, stamps_children=False):
    """Adds `entmtp_torch` to DraftBackendFactory's name -> constructor maps."""
    from .cpu.attention import NAME, MultiStepDraftBackend, TorchTreeAttnBackend

    runner = self.draft_model_runner
    if stamps_children:
        entry = lambda: (NAME, MultiStepDraftBackend(runner, self.topk, self.speculative_num_steps))  # noqa: E731
    else:
        entry = lambda: (NAME, TorchTreeAttnBackend(runner))  # noqa: E731
    backend_map = {**backend_map, NAME: entry}
    return original(self, backend_name, backend_map, error_template, stamps_children)


def _penalties_in_one_order(original, self, logits, repeat=None):
    """Plain decoding applies penalties in the order SGLang's other paths do: additive ones, then scaling.

    SGLang 0.5.23 builds the penalizers from a set of classes (`sampling_batch_info.py`,
    `SamplingBatchInfo.from_schedule_batch`: `penalizers={...}`; `orchestrator.py`: one dict entry per set
    member), so a non-overlapped plain decode step applies frequency, presence and repetition penalties in an
    order that changes from process to process, while the overlap scheduler (`update_penalties`) and
    speculative verification (`eagle_sample`, `apply(..., repeat=n)`) add the additive ones first and scale
    last. A repetition penalty does not commute with the additive ones, so two plain servers could disagree,
    and a resting ENTMTP step (plain decoding) could differ from a plain server. With `repeat=1` every path
    applies the same arithmetic. Installed in every SGLang process that loads the plugin, plain servers too."""
    return original(self, logits, 1 if repeat is None else repeat)


def _register_attention() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .cpu.attention import NAME, TorchTreeAttnBackend

    if NAME not in attention_registry.ATTENTION_BACKENDS:
        attention_registry.register_attention_backend(NAME)(lambda runner: TorchTreeAttnBackend(runner))
    if NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([NAME])
    if NAME not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices([NAME])
    from .visibility import output_streamer_hook

    for dotted, params in hooked(DRAFT_BACKEND_FACTORY, OUTPUT_STREAMER, PENALTIES).items():
        check_signature(dotted, params)
    HookRegistry.register(DRAFT_BACKEND_FACTORY, _draft_backend_around, HookType.AROUND)
    HookRegistry.register(OUTPUT_STREAMER, output_streamer_hook, HookType.AFTER)
    HookRegistry.register(PENALTIES, _penalties_in_one_order, HookType.AROUND)
    from . import admission, observe, requests
    from .cpu import linear, rowwise, sampling

    for module in (admission, observe, requests, sampling, linear, rowwise):
        module.register_hooks(check_signature)


def register() -> None:
    global _DONE
    if _DONE:
        return
    from .cpu.ops import install_if_missing

    install_if_missing()
    try:
        _register_attention()
        from .algorithm import print_startup_error, register_algorithm

        register_algorithm()
        sys.excepthook = print_startup_error
    except Exception:
        logger.exception("entmtp: registering ENTMTP with SGLang failed; --speculative-algorithm ENTMTP "
                         "and --attention-backend entmtp_torch will be unknown")
        raise
    _DONE = True
