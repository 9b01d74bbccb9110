"""Per-request ENTMTP metadata in SGLang's `meta_info`: the tree drafted at each step and the drafts accepted.

SGLang lets a plugin add per-request response fields by choosing a `SchedulerOutputStreamer` subclass
(`Scheduler.get_output_streamer_class`, hooked by the plugin). The worker appends to per-request lists
as it goes; each output chunk drains them, and SGLang's tokenizer manager concatenates the chunks into
`meta_info["entmtp_trees"]` (one tree name per decode step), `meta_info["entmtp_accepted"]` (accepted
drafts per step, bonus token excluded, forced tokens included) and `meta_info["entmtp_forced"]` (per verified
step with forced spans: [forced tokens verified, of them accepted]) and `meta_info["entmtp_lookup"]` (per verified
step with lookup spans: [guessed repeats verified, of them accepted]). Servers running other algorithms are left
untouched.
"""

from __future__ import annotations

TREES = "entmtp_trees"
ACCEPTED = "entmtp_accepted"
FORCED = "entmtp_forced"   # per step with forced spans: [forced tokens verified, of them accepted] (forced_draft.py)
LOOKUP = "entmtp_lookup"   # per step with lookup spans: [guessed repeats verified, of them accepted] (forced_draft.py)
_PENDING = {TREES: "_entmtp_pending_trees", ACCEPTED: "_entmtp_pending_accepted", FORCED: "_entmtp_pending_forced",
            LOOKUP: "_entmtp_pending_lookup"}


def note(req, key: str, value) -> None:
    attr = _PENDING[key]
    pending = getattr(req, attr, None)
    if pending is None:
        pending = []
        setattr(req, attr, pending)
    pending.append(value)


def drain(req, key: str) -> list:
    attr = _PENDING[key]
    pending = getattr(req, attr, None) or []
    setattr(req, attr, [])
    return pending


_CACHE: dict[type, type] = {}


def streamer_class(base: type) -> type:
    """A subclass of SGLang's output streamer that adds the two fields for ENTMTP servers."""
    if base in _CACHE:
        return _CACHE[base]

    class EntMtpOutputStreamer(base):
        has_additional_customized_info = True

        def should_build_additional_customized_info(self) -> bool:
            return getattr(self.spec_algorithm, "name", None) == "ENTMTP"

        def build_additional_customized_info(self, reqs):
            return {key: [drain(r, key) for r in reqs] for key in (TREES, ACCEPTED, FORCED, LOOKUP)}

    _CACHE[base] = EntMtpOutputStreamer
    return EntMtpOutputStreamer


def output_streamer_hook(result, *args, **kwargs):
    """HookRegistry AFTER hook on Scheduler.get_output_streamer_class."""
    return streamer_class(result)
