"""What a tree set records about how it was made (`TreeSet.provenance`), built here only: a calibrated set's
(`calibrated`), and any later change to a set (`amended`: the paper's rule, an online refit, costs measured in
SGLang, a recording set)."""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import time
from pathlib import Path

import torch

from ..tree.treeset import TreeSet


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware() -> str:
    return f"{platform.machine()} {platform.processor() or 'cpu'}, torch threads {torch.get_num_threads()}"


def calibrated(prompts: int, positions: int, max_new_tokens: int, max_rank: int, correlations: dict,
               bin_sizes: list[int], models: dict, cost_source: dict | None) -> dict:
    """A calibrated set's provenance: its records, the signals' correlations with acceptance, the step-cost
    models per batch size (`calibrate/costs.StepCostModel`) and where they came from, the commit and the time."""
    return {"prompts": prompts, "positions": positions, "split": "calib",
            "max_new_tokens": max_new_tokens, "max_rank": max_rank,
            "signal_correlations": correlations, "bin_sizes": bin_sizes,
            "step_cost_model": {str(b): m.to_json() for b, m in models.items()},
            "step_cost_source": cost_source or "in situ",
            "commit": git_commit(), "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def amended(tree_set: TreeSet, fields: dict, **changes) -> TreeSet:
    """`tree_set` with `fields` added to its provenance (and any other field replaced by `changes`)."""
    return dataclasses.replace(tree_set, provenance={**tree_set.provenance, **fields}, **changes)
