"""ENTMTP's settings inside SGLang: which tree set, and the selector's knobs. Frozen, validated on construction.

The tree set comes from, in order: the `ENTMTP_TREE_SET` environment variable, SGLang's
`--speculative-adaptive-config FILE` when FILE is an EntMTP tree set (JSON with
`"format": "entmtp-tree-set"`), or the shipped set for the served model's directory name and the draft's kind
(`eagle3` for an EAGLE-3 checkpoint, else `eagle`: sglang/eagle3.py): the one calibrated through SGLang where there
is one (`entmtp_sglang/trees/<name>-<kind>-mixed-sglang.json`: smollm2-135m-instruct's EAGLE; its trees and step
costs are SGLang's), else the reference engine's (`<name>-<kind>-mixed.json`: entmtp-tiny). An EAGLE-3 draft with
no set of its own is served with the model's EAGLE set (the same tree shapes; its acceptance was calibrated on the
EAGLE drafter, and the log says so). With none of these,
ENTMTP starts uncalibrated: a generic set (`tree/generic.py`, sized by `--speculative-num-steps` and
`--speculative-eagle-topk` when given) whose acceptance predictor and step costs are refitted online from
verified steps (`costs/online.py`). A set calibrated for another model is refused (the message says
which) unless `ENTMTP_FORCE_TREE_SET=1`. `ENTMTP_ONLINE_CALIBRATION=1` refits a calibrated set online too
(its own predictor and costs are the prior). `ENTMTP_RECORD=FILE` appends one JSON line per verified step
(what `entmtp calibrate --engine sglang` reads). By default a calibrated set's step costs are refitted from
the steps this server times (the set's costs are the prior; `ENTMTP_ONLINE_COSTS=0` keeps them).
`ENTMTP_MAX_REST` caps how long the drafter rests after backing off to chain:0 (1, 2, 4, ... steps, default 16;
0: never rest, run the drafter every step). `ENTMTP_GRAMMAR_DRAFT=0`
turns off the grammar-masked entropy and drafts of constrained requests (on by default; needs the overlap
scheduler off, as on CPU). `ENTMTP_PER_ROW_TREES=0` goes back to one tree for the whole batch (by default each
request drafts its own tree at a node count and depth the batch shares; policy/budget.py `allocate_shared`).
`ENTMTP_GUARD=0` turns off the guard that rests a batch size where this server's speculating steps emitted fewer
tokens per second than its resting ones (policy/guard.py; on by default, single rank, not while recording).
`ENTMTP_POLICY` picks how trees are scored: `entmtp` (default: the set's per-node
acceptance predictor when it carries one, else its signal bins), `entmtp-bins` or `entmtp-predictor`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..policy.registry import SERVER_POLICIES
from ..settings import MAX_REST_LIMIT, SGLANG_MAX_REST, settings
from ..tree.generic import generic_tree_set
from ..tree.treeset import FORMAT, TreeSet, TreeSetError, load_tree_set, shipped_tree_set
from .eagle3 import EAGLE, draft_kind

# the variables' names, for messages and child processes' environments; their values are parsed once, in settings.py
ENV_TREE_SET = "ENTMTP_TREE_SET"
ENV_GRAMMAR_DRAFT = "ENTMTP_GRAMMAR_DRAFT"   # "0" turns grammar-aware drafting and entropy off
ENV_POLICY = "ENTMTP_POLICY"
ENV_FORCE = "ENTMTP_FORCE_TREE_SET"     # "1": serve a tree set calibrated for another model
ENV_RECORD = "ENTMTP_RECORD"           # a file: one JSON line per verified step (calibration through SGLang)
ENV_ONLINE = "ENTMTP_ONLINE_CALIBRATION"  # "1": refit a calibrated set's predictor and costs as it serves
ENV_ONLINE_COSTS = "ENTMTP_ONLINE_COSTS"  # "0": keep a calibrated set's step costs (default: refit them as it serves)
ENV_PROFILE = "ENTMTP_PROFILE"         # a file: seconds per stage of every decode step (profile.py)
ENV_TREE_TRACE = "ENTMTP_TREE_TRACE"   # a directory: each rank appends its tree per decode step (debugging)
ENV_MAX_REST = "ENTMTP_MAX_REST"       # the longest run of steps without the drafter after backing off
ENV_PER_ROW = "ENTMTP_PER_ROW_TREES"   # "0": one tree for the whole batch (default: each request its own tree)
ENV_GUARD = "ENTMTP_GUARD"             # "0": no rests forced where speculation delivered less (policy/guard.py)
PIN_KEY = "entmtp_tree"   # sampling_params.custom_params key pinning a tree of the set


def pin_of(custom_params) -> str | None:
    """The tree a request pins (`custom_params = {"entmtp_tree": NAME}`: in-situ cost measurement and
    debugging), or None. The controller honours a pin when every request of the batch pins the same tree."""
    name = custom_params.get(PIN_KEY) if isinstance(custom_params, dict) else None
    return None if name is None else str(name)


# the longest rest (SGLANG_MAX_REST, 16 steps: why, in settings.py) and its bound (MAX_REST_LIMIT) come from settings
DEFAULT_DRAFTER = EAGLE   # the kind of a draft that is not EAGLE-3, and whose sets an EAGLE-3 draft falls back to
SGLANG_SIGNALS = ("draft_entropy", "draft_margin")  # signals the worker computes from the draft logits
DEFAULT_TASK = "mixed"


def resolve_tree_set_path(adaptive_config: str | None, model_name: str = "entmtp-tiny",
                          drafter: str = DEFAULT_DRAFTER) -> Path | None:
    """The tree-set file to serve; None when there is none for this model (start with the generic set)."""
    env = settings().tree_set_path
    if env is not None:
        return env
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
    for kind in dict.fromkeys((drafter, DEFAULT_DRAFTER)):   # the draft's own kind first
        for engine in ("sglang", "reference"):   # a set calibrated through SGLang prices SGLang's own steps
            shipped = shipped_tree_set(kind, DEFAULT_TASK, model_name, engine=engine)
            if shipped.exists():
                return shipped
    return None


def servable_drafters(drafter: str) -> tuple[str, ...]:
    """The drafter kinds whose tree sets may serve a draft of kind `drafter`: its own, and for EAGLE-3 also
    EAGLE's (both draft one tree level per pass with one decoder layer; only the calibration differs)."""
    return tuple(dict.fromkeys((drafter, DEFAULT_DRAFTER)))


@dataclass(frozen=True)
class EntMtpConfig:
    tree_set_path: Path | None      # None: no set for this model, start with the generic set
    model_name: str                 # the served model's directory name; the tree set must match it
    drafter: str = DEFAULT_DRAFTER  # the draft checkpoint's kind (sglang/eagle3.py): eagle or eagle3
    hysteresis: float = 0.02        # as the reference engine's EntMTP policy
    max_nodes: int | None = None
    log_interval_s: float = 30.0
    grammar_drafting: bool = True   # constrained requests: grammar-masked entropy and drafts
    policy: str = "entmtp"          # SERVER_POLICIES
    force: bool = False             # serve a set calibrated for another model
    record_path: Path | None = None # ENTMTP_RECORD
    online: bool = False            # ENTMTP_ONLINE_CALIBRATION (always on for the generic set)
    online_costs: bool = True       # ENTMTP_ONLINE_COSTS: step costs timed in this server, the set's as prior
    generic_depth: int = 4          # the generic set's depth and width (zero-setup start)
    generic_topk: int = 2
    max_rest: int = SGLANG_MAX_REST  # ENTMTP_MAX_REST: steps without the drafter after a back-off (1, 2, 4, ...)
    per_row: bool = True            # ENTMTP_PER_ROW_TREES: each request its own tree at a shape the batch shares
    guard: bool = True              # ENTMTP_GUARD: rest a batch size where speculating steps delivered less

    def __post_init__(self):
        if self.policy not in SERVER_POLICIES:
            raise ValueError(f"{ENV_POLICY} must be one of {', '.join(SERVER_POLICIES)}, got {self.policy!r}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must lie in [0, 1), got {self.hysteresis}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.log_interval_s <= 0:
            raise ValueError(f"log_interval_s must be positive, got {self.log_interval_s}")
        if not 0 <= self.max_rest <= MAX_REST_LIMIT:
            raise ValueError(f"{ENV_MAX_REST} must lie in 0..{MAX_REST_LIMIT}, got {self.max_rest}")
        if not 1 <= self.generic_depth <= 8 or not 1 <= self.generic_topk <= 8:
            raise ValueError(f"the generic tree set needs --speculative-num-steps in 1..8 and "
                             f"--speculative-eagle-topk in 1..8, got {self.generic_depth}, {self.generic_topk}")

    @classmethod
    def from_server_args(cls, server_args) -> "EntMtpConfig":
        model = Path(str(server_args.model_path).rstrip("/")).name
        drafter = draft_kind(getattr(server_args, "speculative_draft_model_path", None))
        path = resolve_tree_set_path(getattr(server_args, "speculative_adaptive_config", None), model, drafter)
        env = settings()
        steps, topk = getattr(server_args, "speculative_num_steps", None), getattr(server_args,
                                                                                   "speculative_eagle_topk", None)
        return cls(tree_set_path=path, model_name=model, drafter=drafter,
                   grammar_drafting=env.grammar_draft, policy=env.policy, force=env.force_tree_set,
                   record_path=env.record_path, online=env.online_calibration, online_costs=env.online_costs,
                   generic_depth=int(steps) if steps else 4, generic_topk=int(topk) if topk else 2,
                   max_rest=env.max_rest, per_row=env.per_row_trees, guard=env.guard)

    @property
    def uncalibrated(self) -> bool:
        return self.tree_set_path is None

    def load_tree_set(self) -> TreeSet:
        """Load and validate; the error names the file and the problem (wrong model, bad node, ...)."""
        if self.tree_set_path is None:
            return generic_tree_set(self.model_name, self.generic_depth, self.generic_topk, self.drafter)
        try:
            ts = load_tree_set(self.tree_set_path, model=None if self.force else self.model_name)
            if ts.drafter not in servable_drafters(self.drafter):
                raise TreeSetError(f"{self.tree_set_path} was calibrated for the {ts.drafter} drafter, not "
                                   f"{self.drafter} (the draft model's kind)")
            if self.policy == "entmtp-predictor" and ts.predictor is None:
                raise TreeSetError(f"{self.tree_set_path} carries no acceptance predictor, which "
                                   f"{ENV_POLICY}=entmtp-predictor needs (entmtp calibrate ... --records-only "
                                   "fits one)")
            if ts.signal not in SGLANG_SIGNALS:
                raise TreeSetError(f"{self.tree_set_path}: signal {ts.signal!r}: inside SGLang ENTMTP bins on "
                                   f"the draft's own logits, one of {SGLANG_SIGNALS}")
            return ts
        except TreeSetError as e:
            hint = f" ({ENV_FORCE}=1 serves it anyway)" if "calibrated for model" in str(e) else ""
            raise TreeSetError(f"ENTMTP cannot start: {e}{hint}. Pass a tree set calibrated for this model with "
                               f"{ENV_TREE_SET}=FILE or --speculative-adaptive-config FILE (make one with "
                               f"`entmtp calibrate --engine sglang --model-path DIR "
                               f"--speculative-draft-model-path DIR`), or pass none to start uncalibrated "
                               f"with a generic set") from None
