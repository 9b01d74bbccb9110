"""What a policy and an engine exchange, with no engine behind it: the reference engine (`engine/engine.py`)
and the SGLang worker (`sglang/worker.py`) both import their side of it from here.

* `StepRecord`  - one verified step of one request, as the reference engine logs it;
* `StepView`    - what a tree chooser sees of one request before a step (its history of `StepRecord`s);
* `StepChooser` - the reference engine's chooser: `chooser(view) -> Tree | DynamicTree` per request and step,
                  with the optional hooks `rests(active)`, `staged` + `restage(...)` and `observe(...)`;
* `TreeChooser` - what an engine calls on the EntMTP policy's state per step: `choose`, `record`, `forget`,
                  `rests` and `restage`, as `controller.TreeController` has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from ..tree import Tree
    from .controller import RequestInput, StageInput
    from .eagle2 import DynamicTree


@dataclass
class StepRecord:
    tree: str
    num_nodes: int
    accepted: int  # drafted tokens accepted (0 .. depth)
    target_entropy: list[float]  # target entropy (nats) at each accepted position, root first
    draft_entropy: float  # the drafter's entropy for the first drafted position
    seconds: float  # wall time of the whole batch step
    draft_margin: float = 0.0  # the drafter's top-1 minus top-2 probability there
    rested: bool = False  # a plain step the policy took without running the drafter (draft values are 0)


@dataclass(frozen=True)
class StepView:
    """What a tree chooser sees for one request at one step (read-only)."""

    index: int  # request index in the batch
    draft_entropy: float  # drafter entropy for the next position, before the tree is chosen
    history: tuple[StepRecord, ...]
    batch_size: int
    position: int  # tokens committed so far
    draft_margin: float = 0.0  # drafter top-1 minus top-2 probability for the next position
    draft_probs: tuple[float, ...] = ()  # the drafter's largest probabilities for the next position, descending

    def draft_value(self, signal: str) -> float:
        """This step's draft value for a tree set's signal: the margin for draft_margin, else the entropy."""
        return self.draft_margin if signal == "draft_margin" else self.draft_entropy


StepChooser = Callable[[StepView], "Tree | DynamicTree"]


@runtime_checkable
class TreeChooser(Protocol):
    """The calls an engine makes on the policy's state (`controller.TreeController`): per step `choose` the
    batch's tree (None: decode plainly), after verification `record` each request's accepted drafts, when a
    request ends `forget` it; `rests` before a step (may it skip the drafter?), `restage` after a drafted
    level (a staged decision among the chosen tree's prefixes)."""

    def choose(self, requests: Sequence[RequestInput], rows: int | None = None,
               group: Hashable = "batch") -> int | None: ...

    def record(self, key: Hashable, accepted: int | None) -> None: ...

    def forget(self, key: Hashable) -> None: ...

    def rests(self, groups: Sequence[Hashable]) -> bool: ...

    def restage(self, idx: int, requests: Sequence[StageInput], drafted_depth: int,
                rows: int | None = None) -> tuple[int, tuple[int, ...]]: ...
