"""ENTMTP's settings inside SGLang: which tree set, and the selector's knobs. Frozen, validated on construction.

The tree set comes from, in order: the `ENTMTP_TREE_SET` environment variable, SGLang's
`--speculative-adaptive-config FILE` when FILE is an EntMTP tree set (JSON with
`"format": "entmtp-tree-set"`), or the shipped default for the bundled model's EAGLE drafter
(`entmtp_sglang/trees/entmtp-tiny-eagle-mixed.json`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..tree.treeset import FORMAT, TreeSet, TreeSetError, load_tree_set, shipped_tree_set

ENV_TREE_SET = "ENTMTP_TREE_SET"
DEFAULT_DRAFTER = "eagle"
DEFAULT_TASK = "mixed"


def resolve_tree_set_path(adaptive_config: str | None) -> Path:
    env = os.environ.get(ENV_TREE_SET)
    if env:
        return Path(env)
    if adaptive_config:
        p = Path(adaptive_config)
        try:
            is_tree_set = json.loads(p.read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            is_tree_set = False
        if is_tree_set:
            return p
    return shipped_tree_set(DEFAULT_DRAFTER, DEFAULT_TASK)


@dataclass(frozen=True)
class EntMtpConfig:
    tree_set_path: Path
    model_name: str                 # the served model's directory name; the tree set must match it
    hysteresis: float = 0.05
    max_nodes: int | None = None
    log_interval_s: float = 30.0

    def __post_init__(self):
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must lie in [0, 1), got {self.hysteresis}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.log_interval_s <= 0:
            raise ValueError(f"log_interval_s must be positive, got {self.log_interval_s}")

    @classmethod
    def from_server_args(cls, server_args) -> "EntMtpConfig":
        path = resolve_tree_set_path(getattr(server_args, "speculative_adaptive_config", None))
        model = Path(str(server_args.model_path).rstrip("/")).name
        return cls(tree_set_path=path, model_name=model)

    def load_tree_set(self) -> TreeSet:
        """Load and validate; the error names the file and the problem (wrong model, bad node, ...)."""
        try:
            return load_tree_set(self.tree_set_path, model=self.model_name, drafter=DEFAULT_DRAFTER)
        except TreeSetError as e:
            raise TreeSetError(f"ENTMTP cannot start: {e}. Pass a tree set calibrated for this model with "
                               f"{ENV_TREE_SET}=FILE or --speculative-adaptive-config FILE "
                               f"(entmtp calibrate --drafter eagle --model DIR)") from None
