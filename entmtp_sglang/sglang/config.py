"""ENTMTP's settings inside SGLang: which tree set, and the selector's knobs. Frozen, validated on construction.

The tree set comes from, in order: the `ENTMTP_TREE_SET` environment variable, SGLang's
`--speculative-adaptive-config FILE` when FILE is an EntMTP tree set (JSON with
`"format": "entmtp-tree-set"`), or the shipped EAGLE set for the served model's directory name
(`entmtp_sglang/trees/<name>-eagle-mixed.json`: entmtp-tiny, smollm2-135m-instruct). `ENTMTP_GRAMMAR_DRAFT=0`
turns off the grammar-masked entropy and drafts of constrained requests (on by default; needs the overlap
scheduler off, as on CPU). `ENTMTP_POLICY` picks how trees are scored: `entmtp` (default: the set's per-node
acceptance predictor when it carries one, else its signal bins), `entmtp-bins` or `entmtp-predictor`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..tree.treeset import FORMAT, TreeSet, TreeSetError, load_tree_set, shipped_tree_set

ENV_TREE_SET = "ENTMTP_TREE_SET"
ENV_GRAMMAR_DRAFT = "ENTMTP_GRAMMAR_DRAFT"   # "0" turns grammar-aware drafting and entropy off
ENV_POLICY = "ENTMTP_POLICY"
ENV_TREE_TRACE = "ENTMTP_TREE_TRACE"   # a directory: each rank appends its tree per decode step (debugging)
PIN_KEY = "entmtp_tree"   # sampling_params.custom_params key pinning a tree of the set
SERVER_POLICIES = ("entmtp", "entmtp-bins", "entmtp-predictor")


def pin_of(custom_params) -> str | None:
    """The tree a request pins (`custom_params = {"entmtp_tree": NAME}`: in-situ cost measurement and
    debugging), or None. The controller honours a pin when every request of the batch pins the same tree."""
    name = custom_params.get(PIN_KEY) if isinstance(custom_params, dict) else None
    return None if name is None else str(name)


DEFAULT_DRAFTER = "eagle"
SGLANG_SIGNALS = ("draft_entropy", "draft_margin")  # signals the worker computes from the draft logits
DEFAULT_TASK = "mixed"


def resolve_tree_set_path(adaptive_config: str | None, model_name: str = "entmtp-tiny") -> Path:
    env = os.environ.get(ENV_TREE_SET)
    if env:
        return Path(env)
    if adaptive_config:
        p = Path(adaptive_config)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise TreeSetError(f"--speculative-adaptive-config {p}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise TreeSetError(f"--speculative-adaptive-config {p}: not valid JSON ({e})") from None
        if isinstance(data, dict) and data.get("format") == FORMAT:
            return p   # a JSON file that is not a tree set is SGLang's own adaptive config: the shipped set
    shipped = shipped_tree_set(DEFAULT_DRAFTER, DEFAULT_TASK, model_name)
    return shipped if shipped.exists() else shipped_tree_set(DEFAULT_DRAFTER, DEFAULT_TASK)


@dataclass(frozen=True)
class EntMtpConfig:
    tree_set_path: Path
    model_name: str                 # the served model's directory name; the tree set must match it
    hysteresis: float = 0.02        # as the reference engine's EntMTP policy
    max_nodes: int | None = None
    log_interval_s: float = 30.0
    grammar_drafting: bool = True   # constrained requests: grammar-masked entropy and drafts
    policy: str = "entmtp"          # SERVER_POLICIES

    def __post_init__(self):
        if self.policy not in SERVER_POLICIES:
            raise ValueError(f"{ENV_POLICY} must be one of {', '.join(SERVER_POLICIES)}, got {self.policy!r}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must lie in [0, 1), got {self.hysteresis}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.log_interval_s <= 0:
            raise ValueError(f"log_interval_s must be positive, got {self.log_interval_s}")

    @classmethod
    def from_server_args(cls, server_args) -> "EntMtpConfig":
        model = Path(str(server_args.model_path).rstrip("/")).name
        path = resolve_tree_set_path(getattr(server_args, "speculative_adaptive_config", None), model)
        flag = os.environ.get(ENV_GRAMMAR_DRAFT, "1").strip().lower()
        if flag not in ("0", "1", "false", "true", "off", "on"):
            raise ValueError(f"{ENV_GRAMMAR_DRAFT} must be 0 or 1, got {flag!r}")
        return cls(tree_set_path=path, model_name=model, grammar_drafting=flag in ("1", "true", "on"),
                   policy=os.environ.get(ENV_POLICY, "entmtp").strip().lower() or "entmtp")

    def load_tree_set(self) -> TreeSet:
        """Load and validate; the error names the file and the problem (wrong model, bad node, ...)."""
        try:
            ts = load_tree_set(self.tree_set_path, model=self.model_name, drafter=DEFAULT_DRAFTER)
            if self.policy == "entmtp-predictor" and ts.predictor is None:
                raise TreeSetError(f"{self.tree_set_path} carries no acceptance predictor, which "
                                   f"{ENV_POLICY}=entmtp-predictor needs (entmtp calibrate ... --records-only "
                                   "fits one)")
            if ts.signal not in SGLANG_SIGNALS:
                raise TreeSetError(f"{self.tree_set_path}: signal {ts.signal!r}: inside SGLang ENTMTP bins on "
                                   f"the draft's own logits, one of {SGLANG_SIGNALS}")
            return ts
        except TreeSetError as e:
            raise TreeSetError(f"ENTMTP cannot start: {e}. Pass a tree set calibrated for this model with "
                               f"{ENV_TREE_SET}=FILE or --speculative-adaptive-config FILE "
                               f"(entmtp calibrate --drafter eagle --model DIR)") from None
