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

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..policy.chooser import StepRecord
from ..tree import Tree


@dataclass(frozen=True)
class ForcedSpanConfig:
    """max_tokens: the longest span below one leaf; max_nodes: forced nodes per request and step;
    prior_acceptance / prior_weight: the acceptance assumed before any span is verified, and its weight in
    tokens; forced_only: a request whose span after the root is worth its tree's depth drafts nothing;
    min_reach: no span below a leaf the drafter gives less than this probability of being reached."""

    max_tokens: int = 16
    max_nodes: int = 48
    prior_acceptance: float = 0.9
    prior_weight: float = 4.0
    forced_only: bool = True
    min_reach: float = 0.3

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_nodes < self.max_tokens:
            raise ValueError(f"max_nodes ({self.max_nodes}) must be >= max_tokens ({self.max_tokens})")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must lie in [0, 1], got {self.prior_acceptance}")
        if not 0.0 <= self.min_reach < 1.0:
            raise ValueError(f"min_reach must lie in [0, 1), got {self.min_reach}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")


@dataclass
class ForcedStats:
    """One request's forced spans. spans / nodes: spans and forced tokens verified; reached / tried / accepted:
    spans the accepted path entered, their tokens up to and including the first rejected one, and their
    accepted tokens; output_tokens: accepted forced tokens kept in the output (after max_new_tokens/eos cuts)."""

    spans: int = 0
    nodes: int = 0
    reached: int = 0
    tried: int = 0
    accepted: int = 0
    output_tokens: int = 0

    @property
    def acceptance(self) -> float:
        """Per-token acceptance of forced tokens (geometric: accepted / tried); nan before any was tried."""
        return self.accepted / self.tried if self.tried else float("nan")

    @property
    def mean_span(self) -> float:
        return self.nodes / self.spans if self.spans else 0.0

    def share(self, output_len: int) -> float:
        """The share of an output of `output_len` tokens that came from forced spans."""
        return self.output_tokens / output_len if output_len else 0.0

    def add(self, other: "ForcedStats") -> None:
        for k in ("spans", "nodes", "reached", "tried", "accepted", "output_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def to_json(self, output_len: int) -> dict:
        a = self.acceptance
        return {"spans": self.spans, "forced_nodes": self.nodes, "spans_reached": self.reached,
                "tried": self.tried, "accepted": self.accepted, "output_tokens": self.output_tokens,
                "share_of_output": round(self.share(output_len), 4), "mean_span": round(self.mean_span, 3),
                "acceptance": None if a != a else round(a, 4)}


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


@dataclass(frozen=True)
class Span:
    """A forced chain below `leaf`: its nodes are first .. first + len(tokens) - 1 of the extended tree."""

    leaf: int
    first: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Extended:
    """A drafted tree with its forced spans: `tree` and `tokens` as verified; nodes >= num_drafted are forced."""

    tree: Tree
    tokens: tuple[int, ...]
    num_drafted: int
    spans: tuple[Span, ...] = ()

    @property
    def num_forced(self) -> int:
        return self.tree.num_nodes - self.num_drafted


def extend_tree(tree: Tree, tokens: list[int], spans: dict[int, list[int]]) -> Extended:
    """`tree` with a chain of `spans[leaf]` below each leaf named, appended in leaf order."""
    parents, toks, out = list(tree.parents), list(tokens[: tree.num_nodes]), []
    for leaf in sorted(spans):
        chain = spans[leaf]
        if not chain:
            continue
        if tree.children[leaf]:
            raise ValueError(f"node {leaf} has children: forced spans hang below leaves only")
        out.append(Span(leaf, len(parents), tuple(chain)))
        for k, t in enumerate(chain):
            parents.append(leaf if k == 0 else len(parents) - 1)
            toks.append(int(t))
    if not out:
        return Extended(tree, tuple(toks), tree.num_nodes)
    return Extended(Tree(tuple(parents), name=f"{tree.name}+forced{len(parents) - tree.num_nodes}"),
                    tuple(toks), tree.num_nodes, tuple(out))


def path_tokens(tree: Tree, tokens: list[int], node: int) -> list[int]:
    """The tokens from below the root down to `node` (the root's own token is already the grammar's)."""
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = tree.parents[node]
    return path[::-1]


class ForcedSpans:
    """Forced-span drafting for the engine: `spell(text) -> token ids` is the tokenizer's ordinary encoding.
    Keeps the engine-wide acceptance of forced tokens (the calibration later requests start from)."""

    def __init__(self, spell: Callable[[str], list[int]], config: ForcedSpanConfig = ForcedSpanConfig()):
        self.config = config
        self.spell = lru_cache(maxsize=4096)(lambda text: tuple(spell(text)))
        self.seen = ForcedStats()  # every verified span so far (the engine-wide calibration)

    @classmethod
    def for_tokenizer(cls, tokenizer, config: ForcedSpanConfig = ForcedSpanConfig()) -> "ForcedSpans":
        """From a `tokenizers.Tokenizer` (or the bundle's PromptTokenizer): encode without special tokens."""
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        return cls(lambda text: inner.encode(text, add_special_tokens=False).ids, config)

    # -- what a span is worth ------------------------------------------------------------------
    def acceptance(self, stats: ForcedStats | None = None) -> float:
        """The forced tokens' acceptance for a request with `stats` so far: its own evidence on a prior that is
        the engine-wide rate (itself on `prior_acceptance`)."""
        c = self.config
        prior = (self.seen.accepted + c.prior_weight * c.prior_acceptance) / (self.seen.tried + c.prior_weight)
        if stats is None:
            return prior
        return (stats.accepted + c.prior_weight * prior) / (stats.tried + c.prior_weight)

    @staticmethod
    def expected_tokens(span_len: int, acceptance: float) -> float:
        """E[accepted tokens] of a span of `span_len` forced tokens: sum_{i=1..span_len} a^i."""
        a = acceptance
        return float(span_len) if a >= 1.0 else a * (1.0 - a ** span_len) / (1.0 - a)

    def forced_only(self, span_len: int, tree: Tree, stats: ForcedStats | None = None) -> bool:
        """Whether the span after the root is worth at least what `tree` could give at most (its depth): then
        the step drafts nothing for the request and verifies the span alone."""
        if not self.config.forced_only or span_len == 0:
            return False
        return self.expected_tokens(span_len, self.acceptance(stats)) >= tree.max_depth

    # -- drafting ------------------------------------------------------------------------------
    def root_span(self, grammar, room: int) -> list[int]:
        """The span right after the root (its grammar state is the request's now), at most `room` tokens."""
        return grammar.forced_span([], self.spell, min(self.config.max_tokens, room))

    def extend(self, tree: Tree, tokens: list[int], grammar, room: int,
               logprobs: list[float] | None = None) -> Extended:
        """Hang the forced span of each leaf below it, at most max_tokens per span and max_nodes per tree, and no
        deeper than `room` levels below the root (context and cache). With `logprobs` (each node's draft log-prob
        under its parent's distribution), the leaves the drafter most expects to be reached come first and those
        it gives less than `min_reach` are left alone; else node order."""
        budget = self.config.max_nodes
        spans: dict[int, list[int]] = {}
        depths = tree.depths
        leaves = [n for n in range(tree.num_nodes) if not tree.children[n]]
        if logprobs is not None:
            reach = [0.0] * tree.num_nodes  # log P(the path to node n is drafted right), by the drafter
            for n in range(1, tree.num_nodes):
                reach[n] = reach[tree.parents[n]] + logprobs[n]
            floor = math.log(self.config.min_reach) if self.config.min_reach > 0 else -math.inf
            leaves = sorted((n for n in leaves if reach[n] >= floor), key=lambda n: -reach[n])
        for leaf in leaves:
            if budget <= 0:
                break
            cap = min(self.config.max_tokens, budget, room - depths[leaf])
            if cap <= 0:
                continue
            span = grammar.forced_span(path_tokens(tree, tokens, leaf), self.spell, cap)
            if span:
                spans[leaf] = span
                budget -= len(span)
        return extend_tree(tree, tokens, spans)

    # -- after verification --------------------------------------------------------------------
    def verified(self, ext: Extended, accepted_nodes: tuple[int, ...], stats: ForcedStats) -> int:
        """Count one verified tree's spans into `stats` (and the engine-wide calibration); returns the forced
        tokens on the accepted path."""
        on_path = set(accepted_nodes)
        step = ForcedStats(spans=len(ext.spans), nodes=ext.num_forced)
        for sp in ext.spans:
            if sp.leaf not in on_path:
                continue
            k = sum(1 for j in range(len(sp.tokens)) if sp.first + j in on_path)
            step.reached += 1
            step.accepted += k
            step.tried += k + (k < len(sp.tokens))  # the first rejected token was tried too
        stats.add(step)
        self.seen.add(step)
        return step.accepted



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
