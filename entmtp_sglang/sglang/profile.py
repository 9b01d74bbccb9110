"""Where a speculative step's time goes inside SGLang: `ENTMTP_PROFILE=FILE` appends one JSON line per decode step.

Each line holds the step's tree, batch size, seconds per stage (wall time on the scheduler thread; on a GPU
the stages are not synchronised, so only the total is exact there) and how many times each stage ran (`calls`: a
count, not a time, so a test can read which passes a step ran):

    {"tree": "chain:2", "bs": 1, "total": 0.081, "choose": 0.0004, "draft": 0.021, "draft_forward": 0.018,
     "verify": 0.045, "target_forward": 0.039, "draft_extend": 0.012, ..., "calls": {"draft_forward": 2, ...}}

`bench/sglang_step_profile.py` serves with it and turns the lines into the breakdown table. Stages nest
(`catch_up` is inside `choose`, `draft_forward` inside `draft`, `draft_extend` and `catch_up`,
`target_forward` inside `verify`); `other` is the step's total less its top-level stages.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

TOP_LEVEL = ("choose", "draft", "verify", "draft_extend", "record")


class StepProfiler:
    """Accumulates seconds per stage for the current step; `end_step` writes them out."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stages: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.start: float | None = None

    def begin_step(self) -> None:
        self.stages = defaultdict(float)
        self.calls = defaultdict(int)
        self.start = time.perf_counter()

    def wrap(self, owner, attr: str, stage: str) -> None:
        """Time every call of `owner.attr` as `stage` (an instance attribute shadows the method)."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.calls[stage] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.stages[stage] += time.perf_counter() - t0

        # not a patches.py entry: a pass-through timer on one worker's objects (ENTMTP_PROFILE only), calling `fn`
        setattr(owner, attr, timed)

    def timed(self, stage: str):
        profiler = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                profiler.stages[stage] += time.perf_counter() - self.t0

        return _Span()

    def end_step(self, **fields) -> None:
        if self.start is None:
            return
        total = time.perf_counter() - self.start
        self.start = None
        top = sum(v for k, v in self.stages.items() if k in TOP_LEVEL)
        row = {**fields, "total": round(total, 6), **{k: round(v, 6) for k, v in self.stages.items()},
               "other": round(max(total - top, 0.0), 6), "calls": dict(self.calls)}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
