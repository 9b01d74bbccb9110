"""One decode step's decision: made once by the policy, frozen, and read by every part of the step after it.

The worker (worker.py) runs a decode step as a pipeline: request state and the rules that make a step rest
(penalties, owed positions), then the policy's choice (`choose_trees`), laid out on the server's tree indices
(`lay_out`) as one `StepDecision`; the worker applies it (runtime state, the draft backend's rows), the drafter
reads its plan and per-row indices, verification its ragged layout, telemetry its names. Nothing of the step's
choice is kept anywhere else; a part that changes it (forced spans widen a step's ragged layout) replaces the
record (`with_ragged`).

Three ways to choose, by what the server can verify (`Mode`):
- ONE_TREE: one tree for the batch (`TreeController.choose`; per-row trees off, or recording a calibration);
- PER_ROW: a tree per request at one shared shape (`choose_rows`): every row verifies the shape's N nodes;
- RAGGED: a tree and node count per request inside a shape (`choose_ragged`), down to a resting row.

Pure functions of their inputs (no SGLang, no host reads of device tensors): tests drive them without a server.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch

from ..policy.controller import RequestInput, TreeController
from .ragged import RaggedVerify, packed_index
from .tree_index import RowIndex, ShapeIndex, TreeIndex
from .tree_plan import TreePlan

REST, PLAIN = "rest", "plain"   # a step's name when no tree runs: the drafter rests / the step decodes plainly


class Mode(enum.Enum):
    ONE_TREE = "one tree per batch"
    PER_ROW = "a tree per request at a shared shape"
    RAGGED = "a tree and node count per request"


def step_mode(ragged: bool, per_row: bool, recording: bool = False, pins: Sequence[str | None] = ()) -> Mode:
    """How a step's trees are chosen: each request its own node count (`ragged`: ragged verify is on), else its own
    tree at a shared shape (`per_row`), else one tree for the batch. While recording (calibration through SGLang)
    the observer records one tree per step, except for a batch whose requests pin different trees (`pins`: the
    calibration's mixed-pin batches, timed as the ragged steps they are)."""
    per_request = not recording or len(set(pins)) > 1
    if ragged and per_request:
        return Mode.RAGGED
    return Mode.PER_ROW if per_row and per_request else Mode.ONE_TREE


@dataclass(frozen=True)
class Choice:
    """The policy's choice for a step: the tree setting its shape (an index into the tree set; None: no tree) and,
    per row, each request's own tree (None: every row takes `tree`)."""

    tree: int | None
    rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepDecision:
    """What one decode step runs. `plan`/`index`: the tree that sets the step's shape (levels, nodes) and its device
    indices (None: no speculation this step); `chosen`: its index in the tree set (the step's timing goes there;
    None while decoding plainly); `resting`: the drafter does not run (chain:0, no room, or a rule); `name`: the
    step's name (a tree's, `REST` or `PLAIN`); `names`: each request's tree; with per-row trees, `rows` (the rows'
    draft indices gathered by tree id, on device) and `row_plans` (each row's tree laid out on the step's levels);
    with ragged verify, `row_real` (tokens each row verifies) and `ragged` (the packed layout) when some row verifies
    fewer than the step's N."""

    plan: TreePlan | None
    index: TreeIndex | None
    chosen: int | None
    resting: bool
    name: str
    names: tuple[str, ...]
    rows: RowIndex | None = None
    row_plans: tuple[TreePlan, ...] = ()
    row_real: tuple[int, ...] = ()
    ragged: RaggedVerify | None = None

    @property
    def num_nodes(self) -> int:
        """Tokens each row of SGLang's `bs x N` verify layout holds (1 when nothing is drafted)."""
        return self.plan.num_nodes if self.plan is not None else 1

    @property
    def num_steps(self) -> int:
        """Draft levels the step runs (0 when nothing is drafted)."""
        return self.plan.num_steps if self.plan is not None else 0

    @property
    def drafts(self) -> bool:
        return not self.resting and self.num_steps > 0

    def with_ragged(self, ragged: RaggedVerify | None) -> StepDecision:
        """The same step verifying `ragged`'s layout (forced spans widen it after the draft)."""
        return replace(self, ragged=ragged)


def ragged_shapes(shape_index: Mapping[tuple[int, int], ShapeIndex]) -> dict[tuple[int, int], tuple[int, frozenset]]:
    """The shapes a ragged step may run in, smallest first: (levels D, nodes N) -> (D, the trees a row may take)."""
    return {key: (key[0], frozenset(shape_index[key].trees))
            for key in sorted(shape_index, key=lambda k: (k[1], k[0]))}


def shape_trees(trees: Sequence) -> dict[tuple[int, int], int]:
    """(levels, nodes) -> the first tree of `trees` of that shape: the tree that sets a step's shape."""
    return {(t.max_depth, t.num_nodes): i for i, t in reversed(list(enumerate(trees)))}


@dataclass(frozen=True)
class Rule:
    """What a step does before the policy is asked: `catch_up` the drafter on the positions rested through first,
    `rest` (decode without the drafter: the policy is not asked)."""

    catch_up: bool
    rest: bool


def rest_rule(plain_rows: Sequence[bool], owed: int, mode: Mode, max_pending: int,
              backs_off: Callable[[], bool]) -> Rule:
    """The rules of a step, in order. `plain_rows`: the requests that must decode one token per step (penalties,
    min_new_tokens); with ragged verify such a request rests as a row of a speculating step, so only a batch of them
    all rests, else one of them rests the batch. `owed`: the most positions a request of the batch owes the drafter
    (rested through). While fewer than `max_pending` are owed, a step that must rest, or one the policy keeps
    resting after a back-off (`backs_off`, asked only then: it counts the step off the rest), rests without a
    catch-up; otherwise what is owed is caught up first, and a batch that must decode plainly then rests."""
    plain = all(plain_rows) if mode is Mode.RAGGED else any(plain_rows)
    if owed and owed < max_pending and (plain or backs_off()):
        return Rule(catch_up=False, rest=True)
    return Rule(catch_up=owed > 0, rest=plain)


def choose_trees(controller: TreeController, inputs: Sequence[RequestInput], mode: Mode,
                 shapes: Mapping[tuple[int, int], tuple[int, frozenset]] | None = None,
                 shape_tree: Mapping[tuple[int, int], int] | None = None, rest_tree: int | None = None,
                 plans: Sequence[TreePlan] = ()) -> Choice:
    """The policy's choice for a batch of `inputs` (one per request, in batch order). RAGGED needs `shapes` ((levels,
    nodes) -> (levels, the trees a row may take), smallest first), `shape_tree` ((levels, nodes) -> the tree setting
    that shape) and `rest_tree` (chain:0's index); PER_ROW needs `plans` (each tree's plan: the deepest row's sets
    the step's levels)."""
    n = len(inputs)
    if mode is Mode.RAGGED:
        key, ids = controller.choose_ragged(inputs, shapes, n)
        # every row at chain:0: the step is chain:0's (a resting step, named so), as without ragged verify
        tree = rest_tree if all(i == rest_tree for i in ids) else shape_tree[key]
        return Choice(tree, tuple(ids))
    if mode is Mode.PER_ROW:
        ids = controller.choose_rows(inputs, n)
        if ids is None:
            return Choice(None)
        return Choice(max(ids, key=lambda i: plans[i].num_steps), tuple(ids))
    return Choice(controller.choose(inputs, n))


def lay_out(choice: Choice | None, rows: int, plans: Sequence[TreePlan], indices: Sequence[TreeIndex],
            shape_index: Mapping[tuple[int, int], ShapeIndex], index_by_name: Mapping[str, int],
            resting: bool = False, device: torch.device | str = "cpu") -> StepDecision:
    """The choice laid out on the server's indices. `choice` None: the policy did not choose (a rule made the step
    rest, `resting`, or the choice failed: the step decodes plainly). A chosen tree without draft levels (chain:0,
    or no room) rests the drafter."""
    tree = None if choice is None else choice.tree
    plan, index = (plans[tree], indices[tree]) if tree is not None else (None, None)
    resting = resting or (choice is not None and (plan is None or plan.num_steps == 0))
    chosen = index_by_name.get(plan.tree.name if plan is not None else "chain:0")
    name = plan.tree.name if plan is not None else (REST if resting else PLAIN)
    names = (name,) * rows
    if choice is None or choice.rows is None or plan is None or plan.num_steps == 0:
        return StepDecision(plan, index, chosen, resting, name, names)
    shape = shape_index[(plan.num_steps, plan.num_nodes)]
    positions = [shape.position(i) for i in choice.rows]
    at = torch.tensor(positions, dtype=torch.long, device=device)
    row_plans = tuple(shape.plans[k] for k in positions)
    names = tuple(plans[i].tree.name for i in choice.rows)
    row_real: tuple[int, ...] = ()
    ragged = None
    if shape.links is not None:
        row_real = tuple(shape.real_nodes[k] for k in positions)
        if min(row_real) < plan.num_nodes:   # some row verifies fewer than N: the target runs the real tokens only
            real, first, sibling = (t.index_select(0, at) for t in shape.links)
            ragged = RaggedVerify(real, row_real, packed_index(real), first, sibling)
    return StepDecision(plan, index, chosen, resting, name, names, shape.gather(at), row_plans, row_real, ragged)
