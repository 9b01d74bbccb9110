"""What a decode step's decision shows: per request in `meta_info` (visibility.py), per row in the server log's
tree histogram, and per step in the tree trace (`ENTMTP_TREE_TRACE=DIR`). A part of the worker's step pipeline
(worker.py) with explicit inputs: the step's requests, its `StepDecision` (step.py) and the runtime state it runs
in; it decides nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from . import visibility
from .step import StepDecision

logger = logging.getLogger("entmtp_sglang.sglang")


class StepTelemetry:
    """Counts decode steps and each request's tree per step (`histogram`, rest and plain counted per row too),
    notes each request's tree in its `meta_info`, writes the trace line, and logs the histogram every
    `log_interval_s` seconds."""

    def __init__(self, trace_path: Path | None, log_interval_s: float, signal: str):
        self.trace_path = trace_path
        self.log_interval_s = log_interval_s
        self.signal = signal
        self.histogram: collections.Counter = collections.Counter()
        self.steps = 0
        self.last_log = time.monotonic()

    def record(self, reqs: Sequence, step: StepDecision, state: tuple[int, int] | None, mean_signal: float) -> None:
        """One decode step: `state` is the runtime state it runs in ([draft levels, tokens per row of SGLang's
        layout]; None when resting), `mean_signal` the batch's mean draft signal (for the log line)."""
        self.histogram.update(step.names)
        self.steps += 1
        for r, name in zip(reqs, step.names):
            visibility.note(r, visibility.TREES, name)
        if self.trace_path is not None:
            self._trace(reqs, step, state)
        if time.monotonic() - self.last_log > self.log_interval_s:
            self.last_log = time.monotonic()
            logger.info("ENTMTP trees chosen per request over %d steps: %s (last batch mean %s %.2f)", self.steps,
                        ", ".join(f"{k}={v}" for k, v in self.histogram.most_common()), self.signal, mean_signal)

    def _trace(self, reqs, step: StepDecision, state) -> None:
        """One JSON line per decode step in this rank's file, so ranks can be compared: the runtime state (`state`),
        the tree that set the step (`tree`), each request's own tree (`trees`, in `rids` order) and, with ragged
        verify, the tokens each row verifies (`nodes`; a resting row 1)."""
        line = {"step": self.steps, "tree": step.name, "state": None if state is None else list(state),
                "rids": [r.rid for r in reqs], "trees": list(step.names)}
        if step.row_real:
            line["nodes"] = list(step.row_real)
        with open(self.trace_path, "a") as f:
            f.write(json.dumps(line) + "\n")


def trace_path(trace_dir: str | None, tp_rank: int = 0) -> Path | None:
    """This process's tree trace file under `trace_dir` (None: no trace), named by tensor-parallel rank and pid
    (data-parallel replicas are separate processes with tp rank 0)."""
    if not trace_dir:
        return None
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    return Path(trace_dir) / f"trees-tp{tp_rank}-pid{os.getpid()}.jsonl"
