"""Forced spans, the pure parts both engines share: text the grammar alone decides, drafted without the drafter.

`ForcedSpans.extend` hangs below each leaf of a drafted tree the tokens its grammar decides there (a grammar object
with `forced_span(path, spell, n)`: `grammar.RequestGrammar` in the reference engine, SGLang's xgrammar objects
through `sglang/forced_draft.py`); `ForcedSpans.verified` counts what the target accepted. The reference engine's
step (engine/forced.py) and SGLang's worker (sglang/forced_draft.py) wire them in.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from .tree import Tree


@dataclass(frozen=True)
class ForcedSpanConfig:
    """max_tokens: the longest span below one leaf; max_nodes: forced nodes per request and step;
    prior_acceptance / prior_weight: the acceptance assumed before any span is verified, and its weight in
    tokens; forced_only: a request whose span after the root is worth its tree's depth drafts nothing;
    min_reach: no span below a leaf the drafter gives less than this probability of being reached; lookup: where
    the grammar decides nothing, a span goes on with the request's own text repeating (`HistoryLookup`), as far as
    the grammar allows; join_ends: where the grammar's text ends inside a token the model writes whole, the span
    ends in that token (`SpanEnds`)."""

    max_tokens: int = 16
    max_nodes: int = 48
    prior_acceptance: float = 0.9
    prior_weight: float = 4.0
    forced_only: bool = True
    min_reach: float = 0.3
    lookup: bool = True
    join_ends: bool = True

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


@dataclass(frozen=True)
class Span:
    """A forced chain below `leaf`: its nodes are first .. first + len(tokens) - 1 of the extended tree."""

    leaf: int
    first: int
    tokens: tuple[int, ...]
    guessed: tuple[bool, ...] = ()   # per token, whether a lookup guessed it (not the grammar); () none was

    @property
    def num_guessed(self) -> int:
        return sum(self.guessed)


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


def extend_tree(tree: Tree, tokens: list[int], spans: dict[int, list[int]], inner: bool = False,
                guessed: dict[int, tuple[bool, ...]] | None = None) -> Extended:
    """`tree` with a chain of `spans[leaf]` below each leaf named, appended in leaf order. `inner`: a named node may
    have children too (the chain is then its last child). `guessed[leaf]`: per token of its span, whether a lookup
    guessed it (`Span.guessed`)."""
    parents, toks, out = list(tree.parents), list(tokens[: tree.num_nodes]), []
    for leaf in sorted(spans):
        chain = spans[leaf]
        if not chain:
            continue
        if tree.children[leaf] and not inner:
            raise ValueError(f"node {leaf} has children: forced spans hang below leaves only")
        tags = tuple((guessed or {}).get(leaf, ()))
        out.append(Span(leaf, len(parents), tuple(chain), tags if any(tags) and len(tags) == len(chain) else ()))
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

    def __init__(self, spell: Callable[[str], list[int]], config: ForcedSpanConfig = ForcedSpanConfig(),
                 pieces: Sequence[str] | None = None):
        self.config = config
        self.spell = lru_cache(maxsize=4096)(lambda text: tuple(spell(text)))
        self.seen = ForcedStats()  # every verified span so far (the engine-wide calibration)
        # `pieces`: each token id's vocabulary string (for `SpanEnds`; None: spans end as the tokenizer spells them)
        self.ends = SpanEnds(pieces) if pieces is not None and config.join_ends else None

    @classmethod
    def for_tokenizer(cls, tokenizer, config: ForcedSpanConfig = ForcedSpanConfig()) -> "ForcedSpans":
        """From a `tokenizers.Tokenizer` (or the bundle's PromptTokenizer): encode without special tokens."""
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        pieces = [inner.id_to_token(i) or "" for i in range(inner.get_vocab_size())]
        return cls(lambda text: inner.encode(text, add_special_tokens=False).ids, config, pieces)

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
        guessed: dict[int, tuple[bool, ...]] = {}
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
                guessed[leaf] = tuple(getattr(grammar, "last_guessed", ()))
                budget -= len(span)
        return extend_tree(tree, tokens, spans, guessed=guessed)

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


class SpanEnds:
    """Where a span's text ends inside a token the model writes whole, the span ends in that token.

    A grammar's text is spelled as the tokenizer spells it alone, but the model spells it joined to what follows.
    Under free whitespace the grammar decides a key up to its closing quote (a space may come before the colon), so
    the span ends in `"`, while the model writes the quote and the colon as one token, `":`: the span's last token
    was rejected after every key (124 of 214 spans of SmolLM2's answers to held-out JSON prompts). Where the grammar
    decides nothing after a spelled text's last token, `RequestSpanEnds` offers in its place a token the grammar
    allows there whose text goes on from it (`extensions`), the one the model wrote most:

        text `name"`, spelled  name ─ "        the model wrote `":` 5 times in this answer, `"` + ` :` never
        the span           ->  name ─ ":       (then on, as far as the grammar or the lookup goes)

    first in the request's own output; where it wrote none of them yet, by the tokens emitted over every request
    (`emitted`), only where one was emitted more often than the spelled token itself. A guess like any span's
    token: the target verifies it. `pieces`: each token id's vocabulary string (byte-level pieces keep the prefix
    order of the text they spell)."""

    def __init__(self, pieces: Sequence[str]):
        self.pieces = list(pieces)
        self.emitted: Counter = Counter()   # tokens emitted over all requests (`RequestSpanEnds.sync`)
        self._ext: dict[int, tuple[int, ...]] = {}
        self._sets: dict[int, frozenset] = {}
        self._order: list[int] | None = None   # token ids by piece (built on first use), and their pieces
        self._sorted: list[str] = []

    def extensions(self, token: int) -> tuple[int, ...]:
        """The tokens whose piece starts with `token`'s and is longer, by id (cached per token). The pieces that
        start with a string are one run of the sorted pieces: two bisections, not a scan of the vocabulary."""
        out = self._ext.get(token)
        if out is None:
            head = self.pieces[token] if 0 <= token < len(self.pieces) else ""
            out = ()
            if head:
                if self._order is None:
                    self._order = sorted(range(len(self.pieces)), key=self.pieces.__getitem__)
                    self._sorted = [self.pieces[u] for u in self._order]
                lo = bisect.bisect_right(self._sorted, head)   # past the pieces equal to head
                hi = bisect.bisect_left(self._sorted, head + "\U0010ffff", lo)
                out = tuple(sorted(u for u in self._order[lo:hi] if len(self.pieces[u]) > len(head)))
            self._ext[token] = out
        return out

    def extension_set(self, token: int) -> frozenset:
        out = self._sets.get(token)
        if out is None:
            out = self._sets[token] = frozenset(self.extensions(token))
        return out

    def request(self) -> "RequestSpanEnds":
        return RequestSpanEnds(self)


class RequestSpanEnds:
    """One request's side of `SpanEnds`: its output's tokens counted (`sync`, append-only like `HistoryLookup`), and
    `__call__(token, allowed)`, the token to end a span in instead of `token` (None: keep it)."""

    def __init__(self, ends: SpanEnds):
        self.ends = ends
        self.counts: Counter = Counter()
        self.output: list[int] = []

    def sync(self, output) -> None:
        n = len(self.output)
        if len(output) < n or (n and int(output[n - 1]) != self.output[-1]):   # another output: count it anew
            self.counts, self.output, n = Counter(), [], 0
        new = [int(t) for t in output[n:]]
        self.output.extend(new)
        self.counts.update(new)
        self.ends.emitted.update(new)

    def __call__(self, token: int, allowed: Callable[[int], bool]) -> int | None:
        ext = self.ends.extensions(int(token))
        if not ext:
            return None
        mine = sorted((u for u in self.counts if u in self.ends.extension_set(int(token))),
                      key=lambda u: -self.counts[u])
        for u in mine:
            if allowed(u):
                return u
        seen = self.ends.emitted
        floor = seen[int(token)]
        for u in sorted((u for u in ext if seen[u] > floor), key=lambda u: -seen[u]):
            if allowed(u):
                return u
        return None


class HistoryLookup:
    """A request's own text as a draft (prompt lookup / n-gram drafting): after the tokens so far, the token that
    followed the latest earlier occurrence of their last n tokens in the request's history (prompt and output),
    the longest match first, n from `max_n` down to `min_n`; None where none occurred.

        history  ... {"id": 1, "tags": ["a"]}, {"id": 2, "tags": ["b"]}, {"
        below    id                      (tokens below the root: a draft path, then what the span took)
        -> `":` the token after the latest earlier `{"id` (n = 2 here: `{"`, `id`)

    Structured output repeats itself (the keys of every object in an array, values copied from the prompt), and a
    small model under a schema often loops; where the grammar decides nothing, this guesses the repeat. A guess is
    a draft like any other: the target verifies it. `sync` keeps the index up to date as the output grows (append
    only; another prompt, or an output that is not the indexed one grown, rebuilds it)."""

    def __init__(self, min_n: int = 2, max_n: int = 4, shared=None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.shared = shared   # what earlier requests wrote (shared_ngrams.SharedNgrams), asked after this history
        self.tokens: list[int] = []
        self.prompt_len = -1
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def sync(self, prompt, output) -> None:
        """Make the history `prompt` + `output`: the new output tokens indexed (all of it if the prompt changed or
        the history shrank)."""
        total, known = len(prompt) + len(output), len(self.tokens) - self.prompt_len   # output tokens indexed
        if (len(prompt) != self.prompt_len or total < len(self.tokens)
                or (prompt and int(prompt[-1]) != self.tokens[self.prompt_len - 1])
                or (known > 0 and int(output[known - 1]) != self.tokens[-1])):
            self.tokens, self.prompt_len = [int(t) for t in prompt], len(prompt)
            self.index = {n: {} for n in self.index}
            done = 0
        else:
            done = len(self.tokens)
        self.tokens.extend(int(t) for t in output[len(self.tokens) - self.prompt_len:])
        # n-grams ending at e <= len - 2, so every indexed one has a token after it; later ends overwrite earlier
        toks = self.tokens
        for e in range(max(done - 1, 0), len(toks) - 1):
            for n, idx in self.index.items():
                if e + 1 >= n:
                    idx[tuple(toks[e + 1 - n: e + 1])] = e

    def __call__(self, below) -> int | None:
        """The next token after the history and `below`: the longest match first, at each length the request's own
        history before what earlier requests wrote (`shared`)."""
        tail = (self.tokens[-self.max_n:] + [int(t) for t in below])[-self.max_n:]
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            key = tuple(tail[-n:])
            e = self.index[n].get(key)
            if e is not None:
                return self.tokens[e + 1]
            if self.shared is not None and n <= self.shared.max_n:
                token = self.shared.get(key)
                if token is not None:
                    return token
        return None


class LookupOnly:
    """A row without a grammar, as `ForcedSpans` reads a grammar: its spans are its own text repeating
    (`HistoryLookup`), token by token while the lookup has a next token."""

    def __init__(self, lookup: HistoryLookup):
        self.lookup = lookup
        self.last_guessed: tuple[bool, ...] = ()

    def forced_span(self, path: list[int], spell, max_tokens: int) -> list[int]:
        out: list[int] = []
        while len(out) < max_tokens:
            t = self.lookup(list(path) + out)
            if t is None:
                break
            out.append(int(t))
        self.last_guessed = (True,) * len(out)
        return out
