"""Drafting with an EAGLE-3 drafter: EAGLE's drafting (its own KV cache, one tree level per pass) over the target's
fused features, with the drafter's own final norm and draft-vocabulary head."""

from __future__ import annotations

import torch

from ..model.eagle3 import Eagle3Draft
from ..model.llama import LlamaForCausalLM
from .draft import EagleDrafting


class Eagle3Drafting(EagleDrafting):
    """The engine hands it the residual streams entering `target_layers` (B, 3d) as features; inside the tree
    each level reads its parent's output (B, d), as EAGLE's drafting already does."""

    def __init__(self, draft: Eagle3Draft, target: LlamaForCausalLM):
        super().__init__(draft, target)
        self.target_layers = draft.target_layers

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.draft.logits(out)
