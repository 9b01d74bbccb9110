"""Measured verification-cost tables (`bench/gpu_costs.py` writes them; `entmtp calibrate --cost-table`
reads them), so the same acceptance records give the tree set another machine, a GPU, would want.

A table holds device times of the pieces of one engine step, for Llama-shaped models with random weights
(costs depend on shapes, not weights), after `context_tokens` committed tokens per request::

    {"format": "entmtp-cost-table", "version": 1, "device": "NVIDIA H200", "versions": {...},
     "timer": "cuda_events", "context_tokens": 1024, ...,
     "models": {"entmtp-tiny": {"shape": {LlamaShape fields}, "dtype": "float16"}, ...},
     "rows": [{"model": "entmtp-tiny", "what": "target_forward", "attention": "flashinfer",
               "batch": 8, "nodes": 16, "median_ms": 0.91, ...},            # one target pass over the tree
              {"model": "entmtp-tiny", "what": "drafter_level", "drafter": "eagle", "attention": "flashinfer",
               "batch": 8, "width": 4, "median_ms": 0.12, ...}, ...]}      # one drafter call on one level

One engine step with a tree of n nodes and depth D costs, by the table (piecewise linear between the
measured sizes)::

    target_forward(n) + sum(drafter_level(w) for w in level_widths(tree))

where the drafter runs once on the root (`begin`) and once per level 1 .. D-1 on the nodes there that have
children (`expand`). Calibration times its cost grid this way instead of with a stopwatch and fits the same
`StepCostModel` (base + per_node * n + per_depth * D) it would fit to in-situ timings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..drafting import drafter_names
from ..model.llama import LlamaShape
from ..tree import Tree
from .costs import cost_grid, fit_cost_models

FORMAT = "entmtp-cost-table"
VERSION = 1
TARGET = "target_forward"
DRAFTER_LEVEL = "drafter_level"
DRAFTERS = drafter_names()  # the registered drafter kinds (entmtp_sglang.drafting)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads")  # what fixes the cost; positions and rope do not


class CostTableError(ValueError):
    """A cost table that cannot be read or does not cover what calibration asks of it."""


@dataclass(frozen=True)
class CostRow:
    model: str
    what: str  # TARGET or DRAFTER_LEVEL
    batch: int
    size: int  # nodes (target) or width (drafter level)
    median_ms: float
    attention: str = ""
    drafter: str = ""  # DRAFTER_LEVEL rows only

    def __post_init__(self):
        if self.what not in (TARGET, DRAFTER_LEVEL):
            raise ValueError(f"'what' must be {TARGET!r} or {DRAFTER_LEVEL!r}, got {self.what!r}")
        if self.what == DRAFTER_LEVEL and self.drafter not in DRAFTERS:
            raise ValueError(f"a drafter_level row needs 'drafter' in {DRAFTERS}, got {self.drafter!r}")
        if self.batch < 1 or self.size < 1:
            raise ValueError(f"batch and size must be >= 1, got batch {self.batch}, size {self.size}")
        if not (math.isfinite(self.median_ms) and self.median_ms > 0):
            raise ValueError(f"median_ms must be a positive number, got {self.median_ms}")


@dataclass(frozen=True)
class TableModel:
    name: str
    shape: dict  # the LlamaShape fields of SHAPE_KEYS
    dtype: str

    def __post_init__(self):
        missing = [k for k in SHAPE_KEYS if not isinstance(self.shape.get(k), int)]
        if missing:
            raise ValueError(f"model {self.name!r}: shape lacks integer {missing}")

    def matches(self, shape: LlamaShape) -> bool:
        return all(self.shape[k] == getattr(shape, k) for k in SHAPE_KEYS)


@dataclass(frozen=True)
class CostTable:
    source: str  # the file it was read from
    device: str
    models: tuple[TableModel, ...]
    rows: tuple[CostRow, ...]
    context_tokens: int = 0

    def __post_init__(self):
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names repeat: {names}")
        for r in self.rows:
            if r.model not in names:
                raise ValueError(f"a row names model {r.model!r}, which 'models' does not list ({names})")
        seen = set()
        for r in self.rows:
            key = (r.model, r.what, r.attention, r.drafter, r.batch, r.size)
            if key in seen:
                raise ValueError(f"two rows measure the same thing: model {r.model}, {r.what} {r.drafter} "
                                 f"{r.attention} attention, batch {r.batch}, size {r.size}")
            seen.add(key)

    def model_for(self, shape: LlamaShape, name: str | None = None) -> TableModel:
        """The entry named `name`, else the one whose shape is `shape`'s."""
        if name is not None:
            for m in self.models:
                if m.name == name:
                    return m
            raise CostTableError(f"{self.source}: no model {name!r} (it has {[m.name for m in self.models]})")
        hits = [m for m in self.models if m.matches(shape)]
        if not hits:
            have = "; ".join(f"{m.name} {[m.shape[k] for k in SHAPE_KEYS]}" for m in self.models)
            raise CostTableError(
                f"{self.source}: no model has this model's shape {[getattr(shape, k) for k in SHAPE_KEYS]} "
                f"({', '.join(SHAPE_KEYS)}); it has {have}. Name one with --cost-model")
        return hits[0]

    def _curve(self, model: str, what: str, batch: int, attention: str | None, drafter: str = ""
               ) -> list[tuple[int, float]]:
        rows = [r for r in self.rows if (r.model, r.what, r.batch, r.drafter) == (model, what, batch, drafter)]
        if attention is not None:
            rows = [r for r in rows if r.attention == attention]
        label = f"{what} of {model}" + (f" ({drafter})" if drafter else "")
        label += f" with {attention} attention" if attention else ""
        if len({r.attention for r in rows}) > 1:
            raise CostTableError(f"{self.source}: {label} at batch {batch} is measured with several attention "
                                 f"backends ({sorted({r.attention for r in rows})}); choose one")
        if len(rows) < 2:
            raise CostTableError(f"{self.source}: {label} at batch {batch} has {len(rows)} measured size(s); "
                                 "at least 2 are needed")
        return sorted((r.size, r.median_ms / 1000.0) for r in rows)

    def attention_for(self, model: str) -> str:
        """The attention backend of the model's target rows: flashinfer where measured, else the one there is."""
        have = {r.attention for r in self.rows if r.model == model and r.what == TARGET}
        if not have:
            raise CostTableError(f"{self.source}: no {TARGET} rows for model {model!r}")
        return "flashinfer" if "flashinfer" in have else sorted(have)[0]

    def step_seconds(self, tree: Tree, model: str, drafter: str, batch: int, attention: str) -> float:
        """Seconds of one engine step with `tree` at `batch`, by the table (see the module docstring)."""
        target = _interpolate(self._curve(model, TARGET, batch, attention), tree.num_nodes,
                              f"{self.source}: {TARGET} of {model} at batch {batch}")
        level = self._curve(model, DRAFTER_LEVEL, batch, None, drafter)
        return target + sum(_interpolate(level, w, f"{self.source}: {drafter} level of {model} at batch {batch}")
                            for w in level_widths(tree))


def level_widths(tree: Tree) -> list[int]:
    """Rows of each drafter call for one request: the root (begin), then per depth 1 .. D-1 the nodes there
    that have children (expand)."""
    widths = [1]
    for d in range(1, tree.max_depth):
        widths.append(sum(1 for i in range(tree.num_nodes) if tree.depths[i] == d and tree.children[i]))
    return widths


def _interpolate(curve: list[tuple[int, float]], x: int, what: str) -> float:
    lo, hi = curve[0][0], curve[-1][0]
    if not lo <= x <= hi:
        raise CostTableError(f"{what}: size {x} is outside the measured range {lo}..{hi}")
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def load_cost_table(path: str | Path) -> CostTable:
    """Read and validate a cost table; any problem raises one CostTableError naming the file and the field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise CostTableError(f"cannot read cost table {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise CostTableError(f"{path} is not JSON: {e}") from None
    try:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"'format' must be {FORMAT!r} (a table written by bench/gpu_costs.py)")
        if raw.get("version") != VERSION:
            raise ValueError(f"'version' must be {VERSION}, got {raw.get('version')!r}")
        models = tuple(TableModel(name, dict(m["shape"]), str(m["dtype"])) for name, m in raw["models"].items())
        rows = tuple(_row(i, r) for i, r in enumerate(raw["rows"]))
        return CostTable(str(path), str(raw["device"]), models, rows, int(raw.get("context_tokens", 0)))
    except KeyError as e:
        raise CostTableError(f"{path}: missing field {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CostTableError(f"{path}: {e}") from None


def _row(i: int, r: dict) -> CostRow:
    try:
        what = str(r["what"])
        size = r["nodes"] if what == TARGET else r["width"]
        return CostRow(str(r["model"]), what, int(r["batch"]), int(size), float(r["median_ms"]),
                       str(r.get("attention", "")), str(r.get("drafter", "")))
    except KeyError as e:
        raise ValueError(f"row {i} lacks field {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"row {i}: {e}") from None


def step_cost_models_from_table(table: CostTable, shape: LlamaShape, drafter: str, batch_sizes, max_depth: int,
                                model: str | None = None, log=print):
    """`StepCostModel` per batch size fitted to the table's step times of the calibration cost grid (what
    `costs.step_cost_models` fits to in-situ timings). Returns (models, source) where source records
    which table, device, model entry and attention backend the costs came from."""
    entry = table.model_for(shape, model)
    attention = table.attention_for(entry.name)
    out = fit_cost_models(cost_grid(max_depth), batch_sizes,
                          lambda t, b: table.step_seconds(t, entry.name, drafter, b, attention),
                          f"cost table {Path(table.source).name}: {table.device}, {entry.name}, {attention} attention",
                          log)
    source = {"table": Path(table.source).name, "device": table.device, "model": entry.name,
              "dtype": entry.dtype, "attention": attention, "context_tokens": table.context_tokens}
    return out, source
