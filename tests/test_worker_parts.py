"""The worker's pure parts without a server: whether a server verifies raggedly (runtime.py), and a step's timing
into the guard (timing.py: a step's tokens are counted once SGLang reports them, a step without a report as one token
a row)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from helpers.testing import import_sglang_or_skip

import_sglang_or_skip()

from entmtp_sglang.sglang.runtime import ragged_verify_on  # noqa: E402
from entmtp_sglang.sglang.timing import StepTiming  # noqa: E402


@pytest.mark.parametrize("backend, setting, per_row, rest_tree, on", [
    ("entmtp_torch", True, True, True, True),
    ("entmtp_torch", False, True, True, False),     # ENTMTP_RAGGED=0
    ("entmtp_torch", True, False, True, False),     # ENTMTP_PER_ROW_TREES=0
    ("entmtp_torch", True, True, False, False),     # no chain:0 in the set
    ("flashinfer", True, True, True, False),        # a target backend without a ragged plan
])
def test_ragged_verify_needs_every_condition(backend, setting, per_row, rest_tree, on, caplog):
    caplog.set_level(logging.INFO, logger="entmtp_sglang.sglang")
    args = SimpleNamespace(attention_backend=backend, decode_attention_backend=None)
    assert ragged_verify_on(args, SimpleNamespace(per_row=per_row), setting, rest_tree) is on
    assert ("ragged verify on" if on else "ragged verify off") in caplog.text


class _Guard:
    def __init__(self):
        self.seen = []

    def observe(self, rows, resting, tokens, seconds):
        self.seen.append((rows, resting, tokens, seconds))


def test_a_step_reaches_the_guard_with_the_tokens_sglang_reported():
    timing = StepTiming.__new__(StepTiming)   # only the guard: no recorder, no cost fits
    timing.observer = timing.costs = timing.ragged_costs = None
    timing.guard, timing._guard_step = _Guard(), None
    step = SimpleNamespace(chosen=None, ragged=None, resting=False, drafts=True)
    timing.step_done(SimpleNamespace(reqs=[1, 2, 3]), step, 0.5)
    timing.observe_tokens(7)
    timing.step_done(SimpleNamespace(reqs=[1, 2]), SimpleNamespace(**{**vars(step), "resting": True}), 0.25)
    timing.observe_tokens(None)   # no report came: one token a row
    timing.observe_tokens(5)      # nothing pending: ignored
    # a step's decision (the policy, a catch-up pass) counts in what the guard judges it by
    timing.step_done(SimpleNamespace(reqs=[1, 2, 3, 4]), step, 0.5, choosing=0.25)
    timing.observe_tokens(6)
    assert timing.guard.seen == [(3, False, 7, 0.5), (2, True, 2, 0.25), (4, False, 6, 0.75)]


def test_resting_rows_take_spans_only_below_four_requests_unless_told():
    """ENTMTP_REST_SPANS: `auto` (default) below 4 requests, `1` at every batch size, `0` never. A resting step at or
    above the bound leaves the step's layout alone and never asks the span drafter."""
    from entmtp_sglang.sglang.verifying import REST_SPAN_ROWS, Verifier, rest_spans_below

    assert REST_SPAN_ROWS == 4
    assert (rest_spans_below("auto"), rest_spans_below("1"), rest_spans_below("0")) == (4, float("inf"), 0)
    assert (rest_spans_below(True), rest_spans_below(False)) == (float("inf"), 0)
    with pytest.raises(ValueError, match="0, 1 or auto"):
        rest_spans_below("sometimes")

    class Asked(Exception):
        pass

    class Forced:   # the span drafter: asked means the step takes spans
        def extend(self, *a, **k):
            raise Asked

    def ask(setting, rows):
        v = Verifier(Forced(), None, None, None, setting)
        reqs = [SimpleNamespace(grammar=None) for _ in range(rows)]
        batch = SimpleNamespace(reqs=reqs, enable_overlap=False, spec_info=None)
        step = SimpleNamespace(resting=True, ragged=None, num_nodes=1, num_steps=0)
        try:
            return v.spans(batch, step, reqs, False, False, lambda r: 100, lambda r: False) is step and "no"
        except Asked:
            return "asked"

    assert [ask("auto", n) for n in (1, 3, 4, 16)] == ["asked", "asked", "no", "no"]
    assert [ask("1", n) for n in (1, 16)] == ["asked", "asked"]
    assert [ask("0", n) for n in (1, 3)] == ["no", "no"]
