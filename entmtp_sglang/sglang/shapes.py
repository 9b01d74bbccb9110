"""One runtime state per tree shape, built at start-up and switched by tree id: SGLang's `--speculative-adaptive`
machinery (`SpecRuntimeState`, `EAGLEWorkerV2.build_adaptive_runtime_state`), keyed by tree instead of by step count.

A tree's shape, for SGLang, is what sizes its buffers and graphs: its draft levels (`speculative_num_steps`, the
tree's depth) and the tokens verified (`speculative_num_draft_tokens`, its node count). Trees of one shape share
a state: the draft backend with its draft graph, the target backend with a verify graph at that width, and the
draft-extend backend with its graph. What differs between trees of one shape (which draft slots each row attends
to) is a tensor of the tree's `TreeIndex`, handed to the state's draft backend when the tree is chosen. chain:0
has no state: a resting step is SGLang's plain decode forward (worker.py).

Graphs are captured by SGLang when its flags ask for them (upstream's `build_adaptive_runtime_state`): on a CPU
there are none, and on CUDA ENTMTP keeps decode graphs off for now (docs/gpu.md), so today every state holds
eager backends. The table and the switch are the same either way.

No SGLang import here: `build` takes the function that builds one state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from .tree_plan import TreePlan

State = TypeVar("State")


@dataclass(frozen=True, order=True)
class Shape:
    num_steps: int          # draft levels: the tree's depth
    num_draft_tokens: int   # nodes verified: the tree's node count

    @classmethod
    def of(cls, plan: TreePlan) -> Shape:
        return cls(plan.num_steps, plan.num_nodes)


class ShapeStates(Generic[State]):
    """Tree id -> its shape's pre-built runtime state (None for chain:0, which rests)."""

    def __init__(self, shapes: Sequence[Shape | None], states: dict[Shape, State]):
        missing = {s for s in shapes if s is not None} - set(states)
        if missing:
            raise ValueError(f"no runtime state for tree shapes {sorted(missing)}")
        self.shapes = tuple(shapes)
        self.states = dict(states)

    @classmethod
    def build(cls, plans: Sequence[TreePlan], build_state: Callable[[Shape], State],
              built: dict[Shape, State] | None = None) -> ShapeStates[State]:
        """One `build_state(shape)` per distinct speculative shape of `plans` (in order of size); `built` holds
        states that exist already (the server's start-up shape) and are reused."""
        shapes = [Shape.of(p) if p.num_steps > 0 else None for p in plans]
        states = dict(built or {})
        for shape in sorted({s for s in shapes if s is not None}):
            if shape not in states:
                states[shape] = build_state(shape)
        return cls(shapes, {s: states[s] for s in set(shapes) if s is not None})

    def state_of(self, tree: int) -> State | None:
        shape = self.shapes[tree]
        return None if shape is None else self.states[shape]

    def __len__(self) -> int:
        return len(self.states)
