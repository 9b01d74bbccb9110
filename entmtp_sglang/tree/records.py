"""One calibration record: what the drafter proposed at a position and where the target's continuation ranked.

Written by the offline calibration (`calibrate.record_positions`, teacher forcing: every rank known) and by
a serving ENTMTP worker (`costs/online.position_record`: rank -1 where a verified step cannot tell).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PositionRecord:
    prompt: int
    pos: int  # index in the generated output of the root token
    draft_entropy: float
    target_entropy: float  # target entropy after the root (known once this position is verified)
    ranks: tuple[int, ...]  # per depth; max_rank: not among the candidates; -1: not observed (served steps)
    draft_margin: float = math.nan  # drafter top-1 minus top-2 probability (nan: an older record)
    # per depth d (1..K), the drafter's max_rank largest probabilities (descending) at depth d along the true
    # continuation (teacher forcing: the distribution the rank-r child of an accepted parent is drafted from);
    # empty in older records. The per-node acceptance predictor (tree/acceptance.py) is fitted on these.
    draft_probs: tuple[tuple[float, ...], ...] = ()

    @property
    def chain_accepted(self) -> int:
        n = 0
        for r in self.ranks:
            if r != 0:
                break
            n += 1
        return n
