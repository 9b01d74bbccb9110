"""The worker's record of verified steps: calibration records from a live SGLang server.

Per decode step the worker hands this object the drafter's root distribution (from the draft-extend logits it
already has), the top candidates at every node it expands, the drafted tokens, and after verification the
target's token after every node (`observe.py`) and the step's wall time. Each request's step becomes one
`PositionRecord` (`costs/online.py`). They go to

* `ENTMTP_RECORD=FILE`: one JSON line per step (tree, batch size, seconds, records), which
  `entmtp calibrate --engine sglang` turns into a tree set;
* `OnlineCalibration`, when the server started with the generic set (no set for this model): the worker
  refits the set's predictor and costs from them every so many steps, and every `PROBE_EVERY`-th step drafts
  the set's largest tree so deep nodes keep being observed.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from ..costs.online import OnlineCalibration, StepObservation, position_record
from ..policy.signals import entropy_nats, top_margin
from ..tree.treeset import TreeSet

logger = logging.getLogger("entmtp_sglang.sglang")
MAX_RANK = 6
PROBE_EVERY = 16


def _top(logits: torch.Tensor, k: int, hot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and probabilities; `hot` maps a draft vocabulary's ids to the target's (EAGLE-3)."""
    probs = torch.softmax(logits.float(), -1)
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    ids = top.indices if hot is None else hot[top.indices]
    return ids.cpu(), top.values.cpu()


class StepObserver:
    def __init__(self, tree_set: TreeSet, record_path: Path | None = None,
                 online: OnlineCalibration | None = None, max_rank: int = MAX_RANK, timed: bool = True):
        self.tree_set = tree_set
        self.online = online
        self.timed = timed          # feed step times to the online refit (False: keep the set's costs)
        self.max_rank = max_rank
        self.max_depth = tree_set.max_depth
        self.file = open(record_path, "a") if record_path is not None else None
        self._roots: dict = {}      # rid -> (ids, probs, entropy, margin) of the drafter's next root
        self._expanded: dict = {}   # node -> (ids (bs, R), probs (bs, R)) this step
        self._tokens: dict = {}     # node -> drafted tokens (bs,) this step
        self._ids: dict = {}        # rid -> small int (PositionRecord.prompt), live requests
        self._next_id = 0
        largest = max(tree_set.trees, key=lambda e: (e.tree.num_nodes, e.tree.max_depth))
        self._probe = largest.tree.name

    @classmethod
    def for_worker(cls, config, tree_set: TreeSet, timed: bool = True) -> "StepObserver | None":
        online = None
        if config.online and not tree_set.provenance.get("generic"):
            online = OnlineCalibration(tree_set)
            logger.info("ENTMTP: refitting the tree set's acceptance predictor and step costs online "
                        "(ENTMTP_ONLINE_CALIBRATION=1); the calibrated ones are the prior")
        if tree_set.provenance.get("generic"):
            online = OnlineCalibration(tree_set)
            logger.warning(
                "ENTMTP: no tree set was calibrated for model %r; starting uncalibrated with a generic set "
                "(%s) and calibrating online from verified steps (estimates are logged as they are refitted). "
                "For calibrated tree choice from the first request: entmtp calibrate --engine sglang "
                "--model-path MODEL --speculative-draft-model-path DRAFT --out SET.json, then start with "
                "ENTMTP_TREE_SET=SET.json", config.model_name, ", ".join(e.tree.name for e in tree_set.trees))
        if online is None and config.record_path is None:
            return None
        return cls(tree_set, config.record_path, online, timed=timed)

    # -- what the worker hands in, in step order -----------------------------------------------------
    def probe_tree(self, step: int) -> str | None:
        """The tree every request pins this step (online calibration's probe), or None: every `PROBE_EVERY`-th
        step, alternately the set's largest tree (deep observations) and the next tree in turn (so no
        tree's cost or acceptance estimate goes stale because the policy stopped choosing it)."""
        if self.online is None or step % PROBE_EVERY != PROBE_EVERY - 1:
            return None
        k = step // PROBE_EVERY
        return self._probe if k % 2 == 0 else self.tree_set.trees[(k // 2) % len(self.tree_set.trees)].tree.name

    def expanded(self, column, logits: torch.Tensor, hot: torch.Tensor | None = None) -> None:
        """Draft logits (bs, rows, vocab) of the nodes in `column` (one per row)."""
        ids, probs = _top(logits[:, : len(column)], self.max_rank, hot)
        for c, node in enumerate(column):
            self._expanded[node] = (ids[:, c], probs[:, c])

    def drafted(self, token: dict) -> None:
        self._tokens = {n: t.cpu() for n, t in token.items()}

    def roots(self, reqs, logits: torch.Tensor, hot: torch.Tensor | None = None) -> None:
        """The draft-extend logits (bs, vocab): each request's root distribution for its next step."""
        ids, probs = _top(logits, self.max_rank, hot)
        ent, margin = entropy_nats(logits.float()).tolist(), top_margin(logits.float()).tolist()
        for i, r in enumerate(reqs):
            self._roots[r.rid] = (ids[i].tolist(), probs[i].tolist(), ent[i], margin[i])

    def forget(self, rid) -> None:
        """A request SGLang released: its root and record id go (the worker's `RequestTable` calls this)."""
        self._roots.pop(rid, None)
        self._ids.pop(rid, None)

    def step(self, reqs, plan, chosen: int | None, seconds: float, verified,
             ragged: tuple[int, int] | None = None) -> None:
        """After verification: `verified` = (target argmax (bs, nodes in verify order), root entropy (bs,));
        `ragged` = (tokens verified, draft levels) of a ragged step (each row its own node count), which records no
        positions but is timed in the file (`tokens`, `depth`: the calibration's ragged step cost)."""
        expanded, tokens, self._expanded, self._tokens = self._expanded, self._tokens, {}, {}
        if ragged is not None:   # not the shape tree's full step (its time) nor its nodes (its records)
            if self.file is not None:
                self.file.write(json.dumps({"tree": "ragged", "batch": len(reqs), "seconds": round(seconds, 6),
                                            "tokens": ragged[0], "depth": ragged[1], "records": []}) + "\n")
                self.file.flush()
            return
        if self.online is not None and chosen is not None:
            self.online.observe_time(chosen, len(reqs), seconds if self.timed else None)
        if verified is None:
            return
        target, target_entropy = verified
        parents = plan.tree.parents if plan is not None else (-1,)
        order = [0, *plan.selected_nodes] if plan is not None else [0]
        if tuple(target.shape) != (len(reqs), len(order)) or set(tokens) != set(range(1, len(parents))):
            return   # not the step this observer was told about (e.g. an idle or mixed batch)
        records = []
        for b, r in enumerate(reqs):
            root = self._roots.get(r.rid)
            if root is None:
                continue
            row = target[b].tolist()
            tgt = [0] * len(parents)
            for j, node in enumerate(order):
                tgt[node] = row[j]
            toks = (-1, *(int(tokens[n][b]) for n in range(1, len(parents))))
            exp = {0: (root[0], root[1]), **{n: (ids[b].tolist(), ps[b].tolist()) for n, (ids, ps) in expanded.items()}}
            if r.rid not in self._ids:   # record ids count up, never reused after a request is forgotten
                self._ids[r.rid], self._next_id = self._next_id, self._next_id + 1
            rid = self._ids[r.rid]
            records.append(position_record(StepObservation(parents, toks, exp, tuple(tgt)), self.max_depth,
                                           self.max_rank, rid, len(getattr(r, "output_ids", ()) or ()),
                                           root[2], float(target_entropy[b]), root[3]))
        if self.online is not None:
            self.online.observe(records)
        if self.file is not None:
            name = plan.tree.name if plan is not None else "chain:0"
            self.file.write(json.dumps({"tree": name, "batch": len(reqs), "seconds": round(seconds, 6),
                                        "records": [record_row(x) for x in records]}) + "\n")
            self.file.flush()


def record_row(r) -> list:
    nan = lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else round(v, 4)  # noqa: E731
    return [r.prompt, r.pos, nan(r.draft_entropy), nan(r.target_entropy), list(r.ranks), nan(r.draft_margin),
            [list(p) for p in r.draft_probs]]
