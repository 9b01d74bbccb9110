"""Forced spans: text the grammar alone decides, drafted without the drafter (jump-forward drafting).

Under a grammar, much of the output is not the model's choice: JSON keys, quotes, separators, braces, `const`
and enum values. After the drafter has filled a request's tree, every leaf whose path the grammar accepts and
whose grammar state decides what comes next (`RequestGrammar.forced_span`: xgrammar's jump-forward string as
the tokenizer spells it, and tokens that are the only legal one) gets those tokens as a chain below it:

    tree (drafted)          tree (verified)
    0 ─ 1 ─ 3               0 ─ 1 ─ 3 ─ 5 ─ 6 ─ 7      leaf 3 ends where the grammar writes `", "age": `
     └─ 2 ─ 4                └─ 2 ─ 4                  leaf 4: nothing forced

A forced span is a draft like any other (a point mass at each node): the target verifies it, so the output is
plain decoding's; where the model spells the text otherwise, the span is rejected from that token on.

What a span is worth (`ForcedSpans.expected_tokens`): the i-th forced token is accepted with probability a^i,
where a is the forced tokens' acceptance measured so far (accepted over tried, both counted from the first
token of each span the accepted path reached), with `prior_weight` tokens of pseudo-evidence at
`prior_acceptance` (the engine-wide rate once some spans were verified). When the span after the root is
worth at least what the chosen tree could give at most (its depth), the step drafts nothing for that request
and verifies the span alone (`forced_only`): it gets the tokens without paying for drafter levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forced_spans import (  # noqa: F401  (the pure parts, shared with SGLang's worker; re-exported here)
    Extended,
    ForcedSpanConfig,
    ForcedSpans,
    ForcedStats,
    Span,
    extend_tree,
    path_tokens,
)
from ..policy.chooser import StepRecord
from ..tree import Tree


@dataclass
class ForcedStepRecord(StepRecord):
    """A step of a request served with forced spans. `accepted` is what a policy's acceptance feedback reads: the
    accepted nodes up to the depth of the tree the policy chose (forced tokens within that depth stand in for the
    drafts it would have made there under the grammar's mask; beyond it they are the grammar's, not the
    drafter's); `accepted_all` counts every accepted node, forced ones included."""

    accepted_all: int = 0
    forced_nodes: int = 0  # forced nodes verified this step
    forced_accepted: int = 0  # of them, on the accepted path
    forced_only: bool = False  # the drafter drafted nothing for the request: its span alone was verified


class ForcedStep:
    """One decode step's forced spans for a batch, between the engine's phases:

        only = step.forced_only_rows(chosen)      # after the policy chose: rows that draft nothing (chain:0)
        tokens, trees = step.extend(tokens, trees) # after drafting: spans below every leaf, as verified
        record = step.record(i, base, accepted, kept, chosen_depth)   # after verification, per request

    `room[i]`: how many levels below the root request i may verify this step (context, max_new_tokens)."""

    def __init__(self, spans: ForcedSpans, grammars: list, active: list[bool], stats: list[ForcedStats],
                 room: list[int]):
        self.spans, self.grammars, self.active, self.stats, self.room = spans, grammars, active, stats, room
        self.exts: list[Extended | None] = [None] * len(grammars)
        self.only: set[int] = set()

    def _rows(self):
        return [i for i, g in enumerate(self.grammars) if g is not None and self.active[i] and self.room[i] > 0]

    def forced_only_rows(self, chosen: list) -> set[int]:
        """The rows whose span after the root is worth at least their chosen tree's depth (`forced_only`)."""
        for i in self._rows():
            tree = getattr(chosen[i], "wide", chosen[i])  # an EAGLE-2 style DynamicTree: its widest form
            if tree.max_depth == 0:
                continue
            span = self.spans.root_span(self.grammars[i], self.room[i])
            if self.spans.forced_only(len(span), tree, self.stats[i]):
                self.only.add(i)
        return self.only

    def extend(self, tokens, trees: list[Tree], logprobs=None):
        """(B, N) drafted tokens and the trees as drafted -> the same with every leaf's span below it.
        `logprobs` (B, N): each drafted node's draft log-prob under its parent's distribution (leaf order)."""
        rows = self._rows()
        if not rows:
            return tokens, trees
        trees = list(trees)
        for i in rows:
            k = trees[i].num_nodes
            ext = self.spans.extend(trees[i], tokens[i, :k].tolist(), self.grammars[i], self.room[i],
                                    logprobs[i, :k].tolist() if logprobs is not None else None)
            if ext.spans:
                self.exts[i], trees[i] = ext, ext.tree
        if all(e is None for e in self.exts):
            return tokens, trees
        out = torch.zeros((len(trees), max(t.num_nodes for t in trees)), dtype=torch.int64)
        for i, t in enumerate(trees):
            ext = self.exts[i]
            out[i, : t.num_nodes] = torch.tensor(ext.tokens) if ext is not None else tokens[i, : t.num_nodes]
        return out, trees

    def record(self, i: int, base: StepRecord, nodes: tuple[int, ...], kept: int, chosen_depth: int
               ) -> ForcedStepRecord:
        """Request i's step record: `base` as the engine logs it, `nodes` the accepted path (root first), `kept`
        the accepted drafts that entered the output (after max_new_tokens and eos cuts), `chosen_depth` the
        depth of the tree the policy chose."""
        ext, forced_accepted = self.exts[i], 0
        if ext is not None:
            forced_accepted = self.spans.verified(ext, nodes, self.stats[i])
            self.stats[i].output_tokens += sum(1 for n in nodes[1: 1 + kept] if n >= ext.num_drafted)
        fields = {k: getattr(base, k) for k in StepRecord.__dataclass_fields__}
        fields["accepted"] = min(base.accepted, chosen_depth)
        return ForcedStepRecord(**fields, accepted_all=base.accepted, forced_nodes=ext.num_forced if ext else 0,
                                forced_accepted=forced_accepted, forced_only=i in self.only)
