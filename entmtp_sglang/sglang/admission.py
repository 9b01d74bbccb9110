"""Requests an ENTMTP server must refuse with HTTP 400 instead of crashing, and server-info it must fill.

SGLang 0.5.23 turns a ValueError raised in `TokenizerManager._validate_one_request` (main process) into HTTP 400
and keeps serving; a request that reaches the scheduler with an empty prompt or a token id outside the
vocabulary crashes every server process. Hooks (registered by plugin.py, active only when the server runs
ENTMTP, so other algorithms are untouched):

* `validate_before`  (tokenizer manager): an empty prompt, token ids outside the vocabulary, and a
                     `custom_params` that is not a flat JSON object or pins a tree the server's set lacks;
* `input_length_around` (scheduler, the backstop for requests that bypass the tokenizer manager, e.g. several
                     tokenizer workers): the same prompt checks; a message aborts the request with 400;
* `average_accept_around` (`/get_server_info`'s `avg_spec_accept_length`): SGLang rolls its counters up only
                     every 40 decode batches; include the interval not yet rolled up, so a lightly loaded
                     server reports a number rather than None;
* `reserved_tokens_around` (tokenizer manager's context check): SGLang counts `max(topk * num_steps,
                     num_draft_tokens)` extra input tokens for an EAGLE-like algorithm; ENTMTP counts none, so a
                     request is admitted exactly when plain SGLang admits it, and a refusal names the user's own
                     numbers (issue 35);
* `row_headroom_around` (`get_req_to_token_extra_context_len`, the req_to_token row's length past the context):
                     what SGLang's decode step allocates past a request's committed tokens lives in the row's
                     headroom, not in the user's context (`entmtp_row_headroom`).

Room for drafts is the worker's business: each step's tree is capped by the least room before the context limit
of any request in the batch (`EntMtpWorker._room`, the controller's room cap), down to resting (a plain decode
step) when no tree fits, so a request near the limit ends as plain decoding ends it.
"""

from __future__ import annotations

from .config import PIN_KEY, EntMtpConfig
from .patches import AVERAGE_ACCEPT, INPUT_LENGTH, RESERVED, ROW_HEADROOM, VALIDATE, hooked

_SCALAR = (type(None), bool, int, float, str)


def is_entmtp() -> bool:
    from sglang.srt.runtime_context import get_spec

    return str(getattr(get_spec(), "speculative_algorithm", "") or "").upper() == "ENTMTP"


def prompt_error(input_ids, vocab_size: int, in_session: bool = False) -> str | None:
    """Why a prompt cannot be served (None: it can): empty, or a token id outside [0, vocab_size)."""
    ids = list(input_ids)
    if not ids:
        return None if in_session else "the prompt is empty (0 tokens); send at least one token of input"
    for t in (min(ids), max(ids)):
        if not 0 <= int(t) < vocab_size:
            return f"input_ids contains token id {int(t)}, outside the model's vocabulary [0, {vocab_size})"
    return None


def custom_params_error(custom_params, tree_names) -> str | None:
    """Why `sampling_params.custom_params` cannot be served: not a JSON object of scalars, lists or flat
    objects, or a pinned tree (`entmtp_tree`) that is not a name in `tree_names` (a callable, so the set is
    loaded only when a request pins)."""
    if custom_params is None:
        return None
    flat = lambda v: isinstance(v, _SCALAR) or (  # noqa: E731
        isinstance(v, list) and all(isinstance(x, _SCALAR) for x in v)) or (
        isinstance(v, dict) and all(isinstance(x, _SCALAR) for x in v.values()))
    if not isinstance(custom_params, dict) or not all(isinstance(k, str) and flat(v)
                                                     for k, v in custom_params.items()):
        return (f"sampling_params.custom_params must be a JSON object of scalars, lists or flat objects, got "
                f"{type(custom_params).__name__} {str(custom_params)[:80]!r}")
    name = custom_params.get(PIN_KEY)
    if name is None:
        return None
    names = tree_names()
    if not isinstance(name, str) or name not in names:
        return f"custom_params.{PIN_KEY}={name!r} is not a tree of this server's tree set: {', '.join(names)}"
    return None


def _tree_names(tokenizer_manager) -> tuple[str, ...]:
    names = getattr(tokenizer_manager, "_entmtp_tree_names", None)
    if names is None:
        ts = EntMtpConfig.from_server_args(tokenizer_manager.server_args).load_tree_set()
        names = tokenizer_manager._entmtp_tree_names = tuple(t.tree.name for t in ts.trees)
    return names


def validate_before(self, obj, input_ids=None):
    """BEFORE hook of TokenizerManager._validate_one_request: ValueError -> HTTP 400."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if not isinstance(obj, GenerateReqInput) or not is_entmtp():
        return None
    session = obj.session_params
    in_session = bool(session.get("id")) if isinstance(session, dict) else session is not None
    if input_ids is not None and getattr(obj, "input_embeds", None) is None:
        msg = prompt_error(input_ids, self.model_config.vocab_size, in_session)
        if msg:
            raise ValueError(msg)
    params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
    msg = custom_params_error(params.get("custom_params"), lambda: _tree_names(self))
    if msg:
        raise ValueError(msg)
    return None


def input_length_around(original, req, max_req_input_len, allow_auto_truncate=False):
    """AROUND hook of the scheduler's validate_input_length: a message aborts the request with 400."""
    msg = original(req, max_req_input_len, allow_auto_truncate)
    if msg is None and is_entmtp():
        msg = prompt_error(req.origin_input_ids, req.vocab_size,
                           in_session=getattr(req, "session_id", None) is not None)
    return msg


def average_accept_around(original, self):
    """AROUND hook of the internal-state `_average_accept_length`: the rolled-up totals plus the interval
    not yet rolled up (SGLang rolls up every `decode_log_interval` batches)."""
    if not is_entmtp():
        return original(self)
    m = self.scheduler.metrics_reporter
    count = m.spec_total_num_forward_ct + m.spec_num_forward_ct
    return (m.spec_total_num_accept_tokens + m.spec_num_accept_tokens) / count if count else None


def entmtp_row_headroom() -> int:
    """How far past the context a req_to_token row must reach for ENTMTP: SGLang's decode step
    (`eagle_prepare_for_decode`) extends a request's row to its committed length + `get_alloc_reserve_per_decode()`
    (twice the largest step's draft footprint, max(topk * depth, nodes) of the largest tree, rounded up to a
    page). A committed length stays below the context (the scheduler caps every request at context - 2 tokens),
    so a row that long holds every step's allocation, whatever the tree set. SGLang widens the row this way
    itself for pages > 1; with pages of 1 it leaves 4 + num_draft_tokens, which a wide set outgrows (SmolLM2's:
    topk 5 x depth 2, twice over, is 20 > 10), and charging the difference to every request's input was what
    refused requests plain SGLang serves near the context limit (issue 35)."""
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_page_size, get_alloc_reserve_per_decode

    return get_alloc_reserve_per_decode() + get_alloc_page_size() - 1


def reserved_tokens_around(original):
    """AROUND hook of compute_num_reserved_tokens: ENTMTP reserves no input tokens (the row headroom holds what
    a decode step allocates, and trees shrink to the room left), so admission and its messages are plain's."""
    return 0 if is_entmtp() else original()


def row_headroom_around(original):
    """AROUND hook of get_req_to_token_extra_context_len: never less than ENTMTP's decode allocation needs."""
    extra = original()
    return max(extra, entmtp_row_headroom()) if is_entmtp() else extra


def register_hooks(check_signature) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(VALIDATE, RESERVED, ROW_HEADROOM, INPUT_LENGTH, AVERAGE_ACCEPT).items():
        check_signature(dotted, params)
    HookRegistry.register(VALIDATE, validate_before, HookType.BEFORE)
    HookRegistry.register(INPUT_LENGTH, input_length_around, HookType.AROUND)
    HookRegistry.register(AVERAGE_ACCEPT, average_accept_around, HookType.AROUND)
    HookRegistry.register(RESERVED, reserved_tokens_around, HookType.AROUND)
    HookRegistry.register(ROW_HEADROOM, row_headroom_around, HookType.AROUND)
