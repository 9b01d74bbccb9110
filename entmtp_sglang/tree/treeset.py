"""Tree sets: a small, task-specific set of Pareto-optimal trees, stored as versioned JSON in `trees/`.

    {
      "format": "entmtp-tree-set", "version": 1,
      "model": "entmtp-tiny", "drafter": "medusa", "task": "code", "hardware": "...",
      "signal": "draft_entropy",                 # which signal the bins refer to (policy/signals.py)
      "bin_edges": [0.8, 1.6, 2.5],              # inner edges: len(bins) = len(bin_edges) + 1
      "trees": [{"name": "...", "parents": [-1, 0, ...],
                 "expected_accepted": [..one per bin..],
                 "cost_seconds": {"1": 0.004, "8": 0.009, "32": 0.02}}],
      "provenance": {"prompts": ..., "positions": ..., "commit": ..., "created": ...},
      "predictor": {...}                         # optional: the per-node acceptance predictor
    }                                            # (tree/acceptance.py), fitted on the same records

Loading validates everything and names the offending tree, node or field.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..drafting import drafter_names
from .acceptance import AcceptancePredictor
from .topology import Tree, TreeError

FORMAT = "entmtp-tree-set"
VERSION = 1
SIGNALS = ("draft_entropy", "draft_margin", "target_window", "target_ema")  # defined in policy/signals.py
DRAFTERS = drafter_names()  # the registered drafter kinds (entmtp_sglang.drafting)


class TreeSetError(ValueError):
    """A tree-set file that cannot be used; the message names the file and the bad field."""


@dataclass(frozen=True)
class TreeEntry:
    tree: Tree
    expected_accepted: tuple[float, ...]
    cost_seconds: dict[int, float]

    def cost(self, batch_size: int) -> float:
        """Measured step time at the measured batch size nearest to batch_size (log scale)."""
        return self.cost_seconds[nearest_batch(self.cost_seconds, batch_size)]

    def tokens_per_second(self, bin_index: int, batch_size: int) -> float:
        return (self.expected_accepted[bin_index] + 1.0) / self.cost(batch_size)


def nearest_batch(sizes, batch_size: int) -> int:
    """The measured batch size nearest to batch_size on a log scale."""
    return min(sizes, key=lambda b: abs(math.log(b) - math.log(max(1, batch_size))))


@dataclass(frozen=True)
class TreeSet:
    model: str
    drafter: str
    task: str
    signal: str
    bin_edges: tuple[float, ...]
    trees: tuple[TreeEntry, ...]
    hardware: str = ""
    provenance: dict = field(default_factory=dict, compare=False)
    predictor: dict | None = field(default=None, compare=False)  # AcceptancePredictor.to_json()

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise TreeSetError(f"drafter {self.drafter!r} is not one of {DRAFTERS}")
        if self.signal not in SIGNALS:
            raise TreeSetError(f"signal {self.signal!r} is not one of {SIGNALS}")
        if list(self.bin_edges) != sorted(self.bin_edges):
            raise TreeSetError(f"bin_edges must increase: {list(self.bin_edges)}")
        if not self.trees:
            raise TreeSetError("a tree set needs at least one tree")
        for i, t in enumerate(self.trees):
            if len(t.expected_accepted) != self.num_bins:
                raise TreeSetError(f"trees[{i}] ({t.tree.name}): expected_accepted has "
                                   f"{len(t.expected_accepted)} values for {self.num_bins} signal bins")
            if any(not (0 <= a <= t.tree.max_depth + 1e-9) for a in t.expected_accepted):
                raise TreeSetError(f"trees[{i}] ({t.tree.name}): expected_accepted must lie in "
                                   f"[0, {t.tree.max_depth}] (the tree's depth)")
            if not t.cost_seconds or any(c <= 0 for c in t.cost_seconds.values()):
                raise TreeSetError(f"trees[{i}] ({t.tree.name}): cost_seconds must be positive")

    @property
    def num_bins(self) -> int:
        return len(self.bin_edges) + 1

    @property
    def max_nodes(self) -> int:
        return max(t.tree.num_nodes for t in self.trees)

    @property
    def max_depth(self) -> int:
        return max(t.tree.max_depth for t in self.trees)

    def per_depth(self, batch_size: int) -> float:
        """Seconds of one drafting level at the measured batch size nearest to batch_size, from the step-cost
        model in the set's provenance (0 when it records none)."""
        model = self.provenance.get("step_cost_model") if isinstance(self.provenance, dict) else None
        if not isinstance(model, dict) or not model:
            return 0.0
        sizes = {int(b): m for b, m in model.items()}
        return max(0.0, float(sizes[nearest_batch(sizes, batch_size)].get("per_depth", 0.0)))

    def bin_of(self, value: float) -> int:
        """The bin of a value of this set's signal (entropy in nats, or a margin)."""
        return bisect.bisect_right(self.bin_edges, value)

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "drafter": self.drafter,
            "task": self.task, "hardware": self.hardware, "signal": self.signal,
            "bin_edges": list(self.bin_edges),
            "trees": [{"name": t.tree.name, "parents": list(t.tree.parents),
                       "expected_accepted": [round(a, 4) for a in t.expected_accepted],
                       "cost_seconds": {str(b): round(c, 6) for b, c in sorted(t.cost_seconds.items())}}
                      for t in self.trees],
            "provenance": self.provenance,
            **({"predictor": self.predictor} if self.predictor is not None else {}),
        }

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _need(obj: dict, key: str, kind, where: str):
    if key not in obj:
        raise TreeSetError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise TreeSetError(f"{where}: field {key!r} should be {getattr(kind, '__name__', kind)}, "
                           f"got {type(value).__name__}")
    return value


def _plain_entry(entries: list[TreeEntry], num_bins: int, provenance: dict) -> TreeEntry:
    """chain:0 (no speculation) for a set file that lacks it: every set can back off to plain decoding.

    Its cost comes from the set's recorded step-cost model (its measured chain:0 step, `plain`, or else base +
    one node), else it is taken as the cheapest tree's (so it wins only where drafting is expected to gain
    nothing)."""
    costs: dict[int, float] = {}
    model = provenance.get("step_cost_model") if isinstance(provenance, dict) else None
    if isinstance(model, dict):
        try:
            costs = {int(b): float(m.get("plain") or float(m["base"]) + float(m["per_node"]))
                     for b, m in model.items()}
        except (KeyError, TypeError, ValueError):
            costs = {}
    if not costs or any(c <= 0 for c in costs.values()):
        sizes = set().union(*(e.cost_seconds for e in entries))
        costs = {b: min(e.cost(b) for e in entries) for b in sizes}
    return TreeEntry(Tree.chain(0), (0.0,) * num_bins, costs)


def _predictor(data: dict, where: str) -> dict | None:
    """The optional per-node acceptance predictor, validated by parsing it (tree/acceptance.py)."""
    if data.get("predictor") is None:
        return None
    try:
        AcceptancePredictor.from_json(data["predictor"])
    except (ValueError, TypeError, AttributeError) as e:
        raise TreeSetError(f"field 'predictor': {e}") from None
    return data["predictor"]


def from_json(data: dict, where: str = "tree set") -> TreeSet:
    if not isinstance(data, dict):
        raise TreeSetError(f"{where}: the top level must be a JSON object")
    if data.get("format") != FORMAT:
        raise TreeSetError(f"{where}: field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != VERSION:
        raise TreeSetError(f"{where}: unsupported version {data.get('version')!r} (this build reads {VERSION})")
    entries = []
    for i, t in enumerate(_need(data, "trees", list, where)):
        tw = f"{where}: trees[{i}]"
        if not isinstance(t, dict):
            raise TreeSetError(f"{tw} must be an object")
        parents = _need(t, "parents", list, tw)
        try:
            tree = Tree(tuple(parents), name=str(t.get("name", "")))
        except (TreeError, TypeError, ValueError) as e:
            raise TreeSetError(f"{tw}.parents: {e}") from None
        acc = _need(t, "expected_accepted", list, tw)
        costs = _need(t, "cost_seconds", dict, tw)
        try:
            cost = {int(k): float(v) for k, v in costs.items()}
            acc_t = tuple(float(a) for a in acc)
        except (TypeError, ValueError) as e:
            raise TreeSetError(f"{tw}: non-numeric value ({e})") from None
        entries.append(TreeEntry(tree, acc_t, cost))
    try:
        edges = tuple(float(e) for e in _need(data, "bin_edges", list, where))
        if entries and not any(e.tree.parents == (-1,) for e in entries):
            entries.insert(0, _plain_entry(entries, len(edges) + 1, data.get("provenance", {})))
        return TreeSet(
            model=_need(data, "model", str, where), drafter=_need(data, "drafter", str, where),
            task=_need(data, "task", str, where), signal=_need(data, "signal", str, where),
            bin_edges=edges, trees=tuple(entries), hardware=str(data.get("hardware", "")),
            provenance=dict(data.get("provenance", {})), predictor=_predictor(data, where))
    except TreeSetError as e:
        raise TreeSetError(f"{where}: {e}") from None


def load_tree_set(path: str | Path, model: str | None = None, drafter: str | None = None,
                  max_depth: int | None = None) -> TreeSet:
    """Read and validate a tree-set file; optionally check it was calibrated for this model/drafter."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TreeSetError(f"tree-set file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise TreeSetError(f"{path}: not valid JSON ({e})") from None
    ts = from_json(data, str(path))
    if model is not None and ts.model != model:
        raise TreeSetError(f"{path} was calibrated for model {ts.model!r}, not {model!r}")
    if drafter is not None and ts.drafter != drafter:
        raise TreeSetError(f"{path} was calibrated for the {ts.drafter} drafter, not {drafter}")
    if max_depth is not None:
        for i, t in enumerate(ts.trees):
            if t.tree.max_depth > max_depth:
                raise TreeSetError(f"{path}: trees[{i}] ({t.tree.name}) reaches depth {t.tree.max_depth}, "
                                   f"beyond the drafter's {max_depth} draft positions")
    return ts


ENGINES = ("reference", "sglang")


def shipped_tree_set(drafter: str, task: str, model: str = "entmtp-tiny", engine: str = "reference") -> Path:
    """Path of the tree set shipped in the package for (model, drafter, task); `model` is the model
    directory's name (entmtp-tiny, smollm2-135m-instruct). `engine="sglang"`: the set calibrated through SGLang
    (`entmtp calibrate --engine sglang`; `...-sglang.json`), whose trees and step costs are SGLang's; the path
    may not exist (not every model has one)."""
    from importlib import resources

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    suffix = "" if engine == "reference" else f"-{engine}"
    return Path(str(resources.files("entmtp_sglang.trees") / f"{model}-{drafter}-{task}{suffix}.json"))
