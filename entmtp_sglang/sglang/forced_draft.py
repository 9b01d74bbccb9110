"""Forced spans inside SGLang (issue 37, item 3): text the grammar alone decides, drafted without the drafter.

The reference engine's forced spans (engine/forced.py; the pure parts both share in forced_spans.py) in ENTMTP's
SGLang worker. After the draft, before the target verifies, every constrained request's tree (as SGLang will verify
it: draft tokens and first-child / next-sibling links, real nodes only) gets below its leaves the tokens its grammar
decides there (`grammar.jump_forward_span` on SGLang's own xgrammar matcher: the jump-forward string as the
tokenizer spells it, and tokens that are the only legal one), at most `max_tokens` per request and step:

    SGLang's verify layout, bs x N                 with forced spans, bs x N'   (N' = N + the longest row's span)
    row 0: 0 ─ 1 ─ 3   (N = 4, 2 padding)          row 0: 0 ─ 1 ─ 3 ─ 4' ─ 5' ─ 6'     the grammar writes `", "`
            └─ 2                                           └─ 2
    row 1: 0           (a resting row)             row 1: 0 ─ 4' ─ 5'                 the span after the root

Forced nodes take columns N.. of their row; rows with shorter spans are padded there, and every padding column is
left out of the verify links and of the target's forward exactly as ragged verify leaves a row's padding out
(ragged.py): the step always verifies raggedly. A forced node is a draft like any other: SGLang's own acceptance
and grammar walks verify it against the target's argmax under the grammar's mask, so output stays plain SGLang's
even where the model spells the text otherwise (the span is rejected from that token on). The draft extend after
verification runs over the accepted tokens, forced ones included, so the drafter stays caught up.

Two spans at most per request: below the leaf of the drafter's top-1 path (`rank_priority` with the reach floor
`TOP1_REACH`: a span below a lower-ranked draft is verified for nothing unless the target took that draft; the
reference engine found fewer, likelier spans faster too), and the span right after the root where the draft parts
from the tokenizer's spelling of it (`with_root_span`), no deeper than the request's room (context and
max_new_tokens). The policy's
acceptance feedback counts at most the drafted tree's depth (`policy_counts`), as the reference engine's does; each
request's `meta_info` gets `entmtp_forced`: per decode step [forced tokens verified, of them accepted].

No SGLang import: SGLang's objects (grammar, verify input, verify result) are read through their attributes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..forced_spans import (
    Extended,
    ForcedSpanConfig,
    ForcedSpans,
    ForcedStats,
    HistoryLookup,
    LookupOnly,
    RequestSpanEnds,
    extend_tree,
)
from ..grammar import jump_forward_span
from ..settings import DEFAULT_FORCED_MAX_TOKENS, settings
from ..shared_ngrams import SharedNgrams
from ..tree import Tree
from .ragged import RaggedVerify, packed_index
from .requests import RequestTable

logger = logging.getLogger("entmtp_sglang.sglang")

# the switches (read once, in settings.py: `forced_spans`, `forced_max_tokens`, `lookup_spans`, `span_ends`)
ENV_FORCED = "ENTMTP_FORCED_SPANS"              # "0": no forced spans inside SGLang
ENV_FORCED_MAX = "ENTMTP_FORCED_MAX_TOKENS"     # forced tokens per request and step (default 16)
# lookup spans, where a span goes on with the request's own text repeating: "all" (default) on every row (a row without
# a grammar: its spans are its repeats alone), "1" on constrained rows only, "0" off (spans hold the grammar's text)
ENV_LOOKUP = "ENTMTP_LOOKUP_SPANS"
# "0": a grammar span ends in its text's last token as the tokenizer spells it, not in the token the model writes
# there joined to what follows (forced_spans.SpanEnds: `"` -> `":` after a key under free whitespace)
ENV_SPAN_ENDS = "ENTMTP_SPAN_ENDS"
DEFAULT_MAX_TOKENS = DEFAULT_FORCED_MAX_TOKENS
TOP1_REACH = 0.5   # the reach floor (forced_spans.ForcedSpanConfig.min_reach) over `rank_priority`: the top-1 path only


def forced_config_from_env() -> ForcedSpanConfig | None:
    """The forced-span configuration this server runs with (None: off). One span per leaf of at most
    `max_tokens`, and at most `max_tokens` per request and step (what sizes the extra verify width)."""
    env = settings()
    if not env.forced_spans:
        return None
    n = env.forced_max_tokens
    # one span per request: below the leaf of the drafter's top-1 path (`rank_priority` scores it 0, a path with a
    # lower-ranked turn -1, below the reach floor log 0.5); a resting row's root is that leaf
    return ForcedSpanConfig(max_tokens=n, max_nodes=n, min_reach=TOP1_REACH, forced_only=False,
                            lookup=env.lookup_spans != "0", join_ends=env.span_ends)


def finished_normally(req) -> bool:
    """Whether SGLang finished `req` by a stop condition (length, a stop token or string): not aborted (its finish
    reason SGLang's FINISH_ABORT), not retracted (no finish reason: it will be prefilled again)."""
    reason = getattr(req, "finished_reason", None)
    return (reason is not None and "ABORT" not in type(reason).__name__.upper()
            and not getattr(req, "is_retracted", False))


def lookup_mode() -> str:
    """ENTMTP_LOOKUP_SPANS as "0", "1" or "all" (settings.py names another value as an error)."""
    return settings().lookup_spans


def extra_verify_tokens() -> int:
    """Verify positions a request may need beyond its tree this step (KV reserved per decode step)."""
    config = forced_config_from_env()
    return 0 if config is None else config.max_nodes


class SGLangGrammar:
    """A request's SGLang grammar object (xgrammar backend: its `matcher`) as `ForcedSpans` reads a grammar; with
    `lookup` (`HistoryLookup` over the request's text), where the grammar decides nothing its spans go on with the
    request's own text repeating, as far as the grammar allows it."""

    def __init__(self, grammar, vocab_size: int, lookup: HistoryLookup | None = None,
                 join: RequestSpanEnds | None = None):
        self.grammar, self.vocab_size, self.lookup, self.join = grammar, vocab_size, lookup, join
        self.last_guessed: tuple[bool, ...] = ()   # the last span's tokens: whether the lookup guessed each

    @staticmethod
    def of(grammar, vocab_size: int, lookup: HistoryLookup | None = None,
           join: RequestSpanEnds | None = None) -> SGLangGrammar | None:
        """None for a grammar without an xgrammar matcher (another backend): no spans for it."""
        matcher = getattr(grammar, "matcher", None)
        if not hasattr(matcher, "find_jump_forward_string"):
            return None
        return SGLangGrammar(grammar, vocab_size, lookup, join)

    def forced_span(self, path: list[int], spell, max_tokens: int) -> list[int]:
        guessed: list[bool] = []
        out = jump_forward_span(self.grammar.matcher, path, spell, max_tokens, self.vocab_size, self.lookup, guessed,
                                self.join)
        self.last_guessed = tuple(guessed)
        return out


# -- the verify layout (pure) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowTree:
    """One row of SGLang's verify layout as a tree: `tree` over the row's real nodes (node i at column
    `columns[i]`, in column order: SGLang's columns are topological), their tokens, and each node's rank among
    its siblings (0: the drafter's first choice)."""

    tree: Tree
    columns: tuple[int, ...]
    tokens: tuple[int, ...]
    ranks: tuple[int, ...]


def row_tree(tokens: list[int], next_token: list[int], next_sibling: list[int]) -> RowTree:
    """The tree SGLang's verify walks for one row: the columns reachable from the root over first-child /
    next-sibling links (padding, unlinked, is left out)."""
    parent_col, rank_col = {0: -1}, {0: 0}
    stack = [0]
    while stack:
        p = stack.pop()
        c, r = next_token[p], 0
        while c >= 0:
            parent_col[c], rank_col[c] = p, r
            stack.append(c)
            c, r = next_sibling[c], r + 1
    cols = sorted(parent_col)
    node = {c: i for i, c in enumerate(cols)}
    parents = tuple(-1 if c == 0 else node[parent_col[c]] for c in cols)
    return RowTree(Tree(parents, name="row"), tuple(cols), tuple(int(tokens[c]) for c in cols),
                   tuple(rank_col[c] for c in cols))


def rank_priority(row: RowTree) -> list[float]:
    """Each node's score for `ForcedSpans.extend`'s leaf order (its `logprobs` argument): minus its sibling rank, so
    a leaf's sum along its path orders the drafter's top-1 path first, then paths with fewer lower-ranked turns."""
    return [-float(r) for r in row.ranks]


def top1_leaf(tree: Tree) -> int:
    """The leaf of the drafter's top-1 path (first children from the root: SGLang lists siblings by rank)."""
    node = 0
    while tree.children[node]:
        node = tree.children[node][0]
    return node


def with_root_span(spans: ForcedSpans, row: RowTree, ext: Extended, grammar, room: int,
                   max_rest: int | None = None) -> Extended:
    """`ext` (the row's tree with its top-1 leaf's span) and the span right after the root, where the draft parts from
    it: followed down the drafted tree while a drafted child holds its next token, the rest hung below the node where
    no child does, unless that is the top-1 path's leaf (its own span is the same text) or the draft holds it all:

        0 ─ 1 ─ 3 ─ f f f     the top-1 path, spelled otherwise than the tokenizer: its own span
         └─ 2 ─ r r r r       2 is the span's first token, 4 would be its second: the rest below 2

    Within the config's max_nodes per request, after the top-1 leaf's span; at most `max_rest` tokens below the node
    where the draft parted from it (what pays, `span_cap`)."""
    tree = row.tree
    budget = spans.config.max_nodes - ext.num_forced
    if budget <= 0 or max_rest == 0:
        return ext
    span = spans.root_span(grammar, min(room, budget))
    tags = tuple(getattr(grammar, "last_guessed", ()))
    node, i = 0, 0
    while i < len(span):
        kid = next((c for c in tree.children[node] if row.tokens[c] == span[i]), None)
        if kid is None:
            break
        node, i = kid, i + 1
    limit = room - tree.depths[node] if max_rest is None else min(room - tree.depths[node], max_rest)
    rest = span[i: i + max(0, limit)]
    if not rest or node == top1_leaf(tree):
        return ext
    chains = {sp.leaf: list(sp.tokens) for sp in ext.spans}
    guessed = {sp.leaf: sp.guessed for sp in ext.spans}
    chains[node], guessed[node] = rest, tags[i: i + len(rest)]
    return extend_tree(tree, list(row.tokens), chains, inner=True, guessed=guessed)


@dataclass(frozen=True)
class ForcedLayout:
    """A step's verify layout with forced spans: (bs, N') tensors as SGLang's verify input holds them, flattened
    there, and per row its extension (None: no span) with the column of every node of the extended tree."""

    num_nodes: int
    max_depth: int
    tokens: torch.Tensor        # (bs, N') draft tokens (column 0: the root's)
    positions: torch.Tensor     # (bs, N')
    mask: torch.Tensor          # (bs, N', N') QLEN_ONLY tree mask: [b, i, j] = column j is an ancestor-or-self of i
    next_token: torch.Tensor    # (bs, N') first child, real nodes only (-1: none)
    next_sibling: torch.Tensor  # (bs, N')
    real: torch.Tensor          # (bs, N') bool: the columns verified
    extended: tuple[Extended | None, ...]
    columns: tuple[tuple[int, ...], ...]   # per row: column of each node of its (extended) tree
    drafted_depth: tuple[int, ...]          # per row: the depth of its tree as drafted (before spans)


def widen(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, next_token: torch.Tensor,
          next_sibling: torch.Tensor, rows: list[RowTree], extended: list[Extended | None]) -> ForcedLayout:
    """SGLang's (bs, N) verify layout with each row's forced nodes in columns N.. (pure; host tensors):

        N' = N + max forced nodes of a row
        old columns: as they were (tokens, positions, mask rows; links over the real nodes)
        forced node f of row b (tree node n + f): column N + f, token, position = root's + its depth,
            mask row = its parent's row + itself, linked below its parent
        padding columns: unlinked, not real, visible to themselves only"""
    bs, n = tokens.shape
    width = n + max((e.num_forced for e in extended if e is not None), default=0)
    out_tokens = torch.zeros((bs, width), dtype=tokens.dtype)
    out_tokens[:, :n] = tokens
    out_pos = positions[:, :1].expand(bs, width).clone()
    out_pos[:, :n] = positions
    out_mask = torch.eye(width, dtype=torch.bool).repeat(bs, 1, 1)
    out_mask[:, :n, :n] = mask
    first = torch.full((bs, width), -1, dtype=torch.long)
    sibling = torch.full((bs, width), -1, dtype=torch.long)
    real = torch.zeros((bs, width), dtype=torch.bool)
    first[:, :n], sibling[:, :n] = next_token, next_sibling
    columns, depths, max_depth = [], [], 0
    for b, (row, ext) in enumerate(zip(rows, extended)):
        real[b, list(row.columns)] = True
        depths.append(row.tree.max_depth)
        if ext is None:
            columns.append(row.columns)
            max_depth = max(max_depth, row.tree.max_depth)
            continue
        cols = list(row.columns) + [n + f for f in range(ext.num_forced)]
        columns.append(tuple(cols))
        tree = ext.tree
        max_depth = max(max_depth, tree.max_depth)
        for node in range(ext.num_drafted, tree.num_nodes):
            c, p = cols[node], cols[tree.parents[node]]
            out_tokens[b, c] = ext.tokens[node]
            out_pos[b, c] = positions[b, 0] + tree.depths[node]
            out_mask[b, c] = out_mask[b, p]
            out_mask[b, c, c] = True
            real[b, c] = True
            kids = tree.children[tree.parents[node]]   # a chain's node is its parent's last child
            k = kids.index(node)
            if k == 0:
                first[b, p] = c
            else:   # below an inner node (the span after the root, where the draft parted from it)
                sibling[b, cols[kids[k - 1]]] = c
    return ForcedLayout(width, max_depth, out_tokens, out_pos, out_mask, first, sibling, real, tuple(extended),
                        tuple(columns), tuple(depths))


def accepted_nodes(columns: tuple[int, ...], accept_row: list[int], width: int, row: int) -> tuple[int, ...]:
    """A row's accepted path as nodes of its extended tree (root first), from SGLang's accept_index row (global
    positions row * N' + column, -1 padded)."""
    node_of = {c: i for i, c in enumerate(columns)}
    return tuple(node_of[g - row * width] for g in accept_row if g >= 0 and g - row * width in node_of)


def new_tokens_left(req) -> int:
    """Tokens the request may still emit (max_new_tokens less its output; large when unset): the deepest a span
    below its root is worth verifying."""
    limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    if limit is None:
        return 1 << 30
    return max(int(limit) - len(getattr(req, "output_ids", ()) or ()), 0)


def span_cap(reach: float, acceptance: float, threshold: float, max_tokens: int) -> int:
    """How many tokens of a span are worth verifying: its k-th token is accepted with probability
    reach * acceptance**k (the span reached, then k tokens in a row the target's), and verifying it costs
    `threshold` of one emitted token's time (`token_threshold`); the longest prefix whose last token still pays,
    at most `max_tokens` (0: no span)."""
    if threshold <= 0:
        return max_tokens
    k, p = 0, reach
    while k < max_tokens and p * acceptance >= threshold:
        k, p = k + 1, p * acceptance
    return k


def token_threshold(per_token: float, step_seconds: float, rows: int, tokens_per_row: float) -> float:
    """A verified token's cost in emitted tokens: `per_token` seconds against a step of `step_seconds` that emits
    `rows * tokens_per_row` tokens (a forced token pays where its chance of acceptance is at least this)."""
    if step_seconds <= 0 or per_token <= 0:
        return 0.0
    return per_token * rows * max(tokens_per_row, 1.0) / step_seconds


@dataclass
class SpanOutcomes:
    """What became of the server's forced spans, by where they hung: below a leaf of the drafted tree ("leaf": the
    top-1 path's) or inside it ("inner": the span after the root, where the draft parted from it). Per kind:
    [spans, forced tokens, spans reached (the accepted path came to their first token), of them rejected at the
    first token, forced tokens accepted, forced tokens tried (of reached spans: up to and including the first
    rejected one)]. `worth(kind)`: the chance a span of that kind is reached and the per-token acceptance once it
    is, each with a prior (`PRIOR_REACH`, `ForcedSpanConfig.prior_acceptance`) worth `PRIOR_WEIGHT` observations."""

    PRIOR_REACH = {"leaf": 0.5, "inner": 0.9, "free leaf": 0.5, "free inner": 0.9}
    PRIOR_WEIGHT = 8.0
    FREE_PRIOR_ACCEPTANCE = 0.5   # a repeat guessed in free text, before any was verified

    steps: int = 0
    kinds: dict = field(default_factory=lambda: {k: [0] * 6 for k in SpanOutcomes.PRIOR_REACH})
    prior_acceptance: float = 0.9

    def worth(self, kind: str) -> tuple[float, float]:
        spans, _, reached, _, accepted, tried = self.kinds[kind]
        w = self.PRIOR_WEIGHT
        prior = self.FREE_PRIOR_ACCEPTANCE if kind.startswith("free") else self.prior_acceptance
        return ((reached + w * self.PRIOR_REACH[kind]) / (spans + w), (accepted + w * prior) / (tried + w))

    def add(self, ext: Extended, accepted: tuple[int, ...], free: bool = False) -> None:
        """`free`: the row has no grammar (its spans are its own repeats alone)."""
        on_path = set(accepted)
        drafted_parents = set(ext.tree.parents[1: ext.num_drafted])
        for sp in ext.spans:
            c = self.kinds[("free " if free else "") + ("inner" if sp.leaf in drafted_parents else "leaf")]
            k = 0
            while k < len(sp.tokens) and sp.first + k in on_path:
                k += 1
            reached = sp.leaf in on_path
            c[0], c[1], c[2] = c[0] + 1, c[1] + len(sp.tokens), c[2] + reached
            c[3] += reached and k == 0
            c[4] += k
            c[5] += (k + (k < len(sp.tokens))) if reached else 0

    def summary(self) -> str:
        parts = []
        for kind, (spans, tokens, reached, first, accepted, _) in self.kinds.items():
            if spans:
                parts.append(f"{kind}: {spans} spans of {tokens / spans:.1f} tokens, {reached / spans:.0%} reached, "
                             f"{first / max(reached, 1):.0%} of those cut at their first token, {accepted} of "
                             f"{tokens} tokens accepted")
        return "; ".join(parts) or "none"


@dataclass
class ForcedStep:
    """This step's forced spans: the layout verified, the ragged verify it rides, and the width it replaced."""

    layout: ForcedLayout
    ragged: RaggedVerify
    rids: tuple[str, ...]
    base_width: int
    free: frozenset = frozenset()   # rows without a grammar: their spans are their own repeats


class ForcedDraft:
    """Forced spans for the ENTMTP worker: `extend` rewrites a step's verify input (after the draft, before the
    verify); `verified` counts what was accepted; `policy_counts` cuts the acceptance feedback to the drafted
    depth. Per-request state (statistics, the request's text as an n-gram index, its side of the span ends) lives in
    the request's entry of the worker's `RequestTable` (requests.py), dropped when SGLang releases the request."""

    LOG_EVERY = 200   # steps with spans between two start-up-log lines of the server's span outcomes

    def __init__(self, spans: ForcedSpans, vocab_size: int, requests: RequestTable | None = None):
        self.spans, self.vocab_size = spans, vocab_size
        self.requests = requests if requests is not None else RequestTable()
        self.outcomes = SpanOutcomes(prior_acceptance=spans.config.prior_acceptance)
        self.tokens_per_row = 2.0   # tokens a row emits per speculating step (a running mean, `observe`)
        self.last_caps = (spans.config.max_tokens, spans.config.max_tokens)
        # each request's text as an n-gram index (HistoryLookup), with ENTMTP_LOOKUP_SPANS other than 0; rows without
        # a grammar take lookup spans with ENTMTP_LOOKUP_SPANS=all only
        mode = lookup_mode() if spans.config.lookup else "0"
        self.lookup_on = mode != "0"
        self.lookup_free = mode == "all"
        # what earlier requests wrote (ENTMTP_CROSS_SPANS=1): finished outputs indexed when SGLang releases them
        self.shared = SharedNgrams() if self.lookup_on and settings().cross_spans else None
        if self.shared is not None:
            self.requests.on_release(self.index_finished)
            self.requests.counted["shared_ngrams"] = lambda: len(self.shared)

    def lookup(self, req) -> HistoryLookup | None:
        """The request's HistoryLookup, synced to its prompt and output (None: lookup spans off)."""
        if not self.lookup_on:
            return None
        st = self.requests.of(req)
        if st.lookup is None:
            st.lookup = HistoryLookup(shared=self.shared)
        st.lookup.sync(getattr(req, "origin_input_ids", None) or (), getattr(req, "output_ids", None) or ())
        return st.lookup

    def index_finished(self, req, state=None) -> None:
        """A released request's output into the shared index (`shared`), if it finished: an aborted request (its
        finish reason an abort) or a retracted one (no finish reason: it will run again) is not indexed."""
        if self.shared is None or not finished_normally(req):
            return
        self.shared.insert(getattr(req, "output_ids", None) or (), getattr(req, "origin_input_ids", None) or ())

    def clear_shared(self) -> None:
        """Empty the shared index (SGLang's flush_cache: a benchmark's passes must not draft from each other)."""
        if self.shared is not None:
            self.shared.clear()

    def join(self, req) -> RequestSpanEnds | None:
        """The request's side of the server's `SpanEnds`, synced to its output (None: span ends off)."""
        if self.spans.ends is None:
            return None
        st = self.requests.of(req)
        if st.join is None:
            st.join = self.spans.ends.request()
        st.join.sync(getattr(req, "output_ids", None) or ())
        return st.join

    def observe(self, accepted: list[int]) -> None:
        """A verified step's accepted drafts per row, into the running mean of tokens emitted per row and step."""
        if accepted:
            mean = 1.0 + sum(accepted) / len(accepted)
            self.tokens_per_row += 0.05 * (mean - self.tokens_per_row)

    def caps(self, threshold: float) -> tuple[int, int]:
        """The longest spans worth verifying below the top-1 leaf and after the root (`span_cap` over what the
        server's spans did so far, `outcomes.worth`), at a verified token's cost `threshold` (`token_threshold`)."""
        return self.caps_of(threshold)

    def caps_of(self, threshold: float, free: bool = False) -> tuple[int, int]:
        """`caps` for the spans of constrained rows, or with `free` of rows without a grammar (their repeats)."""
        n, pre = self.spans.config.max_tokens, "free " if free else ""
        return (span_cap(*self.outcomes.worth(pre + "leaf"), threshold, n),
                span_cap(*self.outcomes.worth(pre + "inner"), threshold, n))

    @classmethod
    def for_worker(cls, tokenizer_path: str, vocab_size: int, ragged: bool, topk: int,
                   requests: RequestTable | None = None) -> ForcedDraft | None:
        """The forced-span drafter of a worker, or None (logged at start-up either way)."""
        config = forced_config_from_env()
        reason = (f"{ENV_FORCED}=0" if config is None
                  else "ragged verify is off" if not ragged
                  else "top-k 1 trees (SGLang then keeps no accepted-path compaction)" if topk < 2 else None)
        if reason is not None:
            logger.info("ENTMTP: forced spans off (%s): constrained requests draft the grammar's text like any other",
                        reason)
            return None
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        mode = lookup_mode()
        logger.info("ENTMTP: forced spans on: below the leaves of a constrained request's tree, the text its grammar "
                    "decides, as the tokenizer spells it, up to %d tokens per request and step, verified like any "
                    "draft (%s=0 turns them off); lookup spans (%s=%s): %s", config.max_tokens, ENV_FORCED,
                    ENV_LOOKUP, mode, {"0": "off", "1": "where the grammar decides nothing, the request's own text "
                                       "repeating, on constrained rows", "all": "the request's own text repeating, "
                                       "on constrained rows and rows without a grammar"}[mode])
        logger.info("ENTMTP: span ends (%s=%s): %s", ENV_SPAN_ENDS, int(config.join_ends),
                    "where the grammar decides nothing after a span's text, its last token may be one the model writes "
                    "joined to what follows (`\"` -> `\":`)" if config.join_ends else "off: spans end as the tokenizer "
                    "spells their text")
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        return cls(ForcedSpans(lambda text: tok.encode(text, add_special_tokens=False), config,
                               [p or "" for p in pieces]), vocab_size, requests)

    def extend(self, spec, ragged: RaggedVerify | None, reqs, grammars: dict[int, object], kv_rooms: list[int],
               threshold: float = 0.0) -> ForcedStep | None:
        """Hang each constrained row's spans into SGLang's verify input `spec` (an EagleVerifyInput; edited in
        place) and return the step, or None when no row has a span (`spec` untouched). `grammars`: row -> SGLang
        grammar object of the rows that may take spans; `kv_rooms[row]`: KV positions left before its context
        limit (a row takes spans only where N + max_nodes fit); `threshold`: a verified token's cost in emitted
        tokens (`token_threshold`; 0: every span at its full length), which caps each span (`caps`).
        A row whose grammar is None has none: with lookup spans on, its spans are its own repeats (`LookupOnly`)."""
        if not self.lookup_free:
            grammars = {b: g for b, g in grammars.items() if g is not None}
        if not grammars or getattr(spec, "prepared_out_cache_loc", None) is not None \
                or getattr(spec, "kv_loc_plan", None) is not None:
            return None
        bs = len(reqs)
        n = int(spec.draft_token_num)
        if spec.draft_token.numel() != bs * n or spec.custom_mask is None or spec.custom_mask.numel() < bs * n * n:
            return None
        tokens = spec.draft_token.view(bs, n).cpu()
        links = (ragged.next_token, ragged.next_sibling) if ragged is not None else \
            (spec.retrieve_next_token, spec.retrieve_next_sibling)
        first, sibling = (t.cpu().long() for t in links)
        host_tokens, host_first, host_sibling = tokens.tolist(), first.tolist(), sibling.tolist()
        rows = [row_tree(host_tokens[b], host_first[b], host_sibling[b]) for b in range(bs)]
        extended: list[Extended | None] = [None] * bs
        caps = {False: self.caps_of(threshold), True: self.caps_of(threshold, free=True)}
        self.last_caps = caps[False]
        for b, g in grammars.items():
            room = new_tokens_left(reqs[b]) if kv_rooms[b] >= n + self.spans.config.max_nodes else 0
            leaf_cap, inner_cap = caps[g is None]
            if room <= 0 or leaf_cap == inner_cap == 0:
                continue
            grammar = (LookupOnly(self.lookup(reqs[b])) if g is None
                       else SGLangGrammar.of(g, self.vocab_size, self.lookup(reqs[b]), self.join(reqs[b])))
            if grammar is None:
                continue
            row = rows[b]
            try:
                leaf_room = min(room, row.tree.depths[top1_leaf(row.tree)] + leaf_cap)
                ext = self.spans.extend(row.tree, list(row.tokens), grammar, leaf_room, rank_priority(row))
                ext = with_root_span(self.spans, row, ext, grammar, room, inner_cap)
            except Exception:   # drafting must never fail a request: no span for it this step
                logger.exception("ENTMTP: forced span failed for %s; none this step", reqs[b].rid)
                continue
            if ext.spans:
                extended[b] = ext
        if all(e is None for e in extended):
            return None
        device = spec.draft_token.device
        mask = spec.custom_mask.reshape(-1)[: bs * n * n].view(bs, n, n).cpu()
        layout = widen(tokens, spec.positions.view(bs, n).cpu(), mask, first, sibling, rows, extended)
        w = layout.num_nodes
        spec.draft_token = layout.tokens.reshape(-1).to(device, spec.draft_token.dtype)
        spec.positions = layout.positions.reshape(-1).to(device, spec.positions.dtype)
        spec.custom_mask = layout.mask.reshape(-1).to(device, spec.custom_mask.dtype)
        idx_dtype = spec.retrieve_index.dtype
        spec.retrieve_index = torch.arange(bs * w, device=device, dtype=idx_dtype).view(bs, w)
        spec.retrieve_next_token = layout.next_token.to(device, spec.retrieve_next_token.dtype)
        spec.retrieve_next_sibling = layout.next_sibling.to(device, spec.retrieve_next_sibling.dtype)
        spec.draft_token_num = spec.num_tokens_per_req = spec.num_tokens_for_logprob_per_req = w
        spec.spec_steps = max(int(spec.spec_steps), layout.max_depth)
        real = layout.real.to(device)
        counts = tuple(int(c) for c in layout.real.sum(1).tolist())
        rs = RaggedVerify(real, counts, packed_index(real), spec.retrieve_next_token, spec.retrieve_next_sibling)
        return ForcedStep(layout, rs, tuple(r.rid for r in reqs), n,
                          frozenset(b for b, g in grammars.items() if g is None))

    def verified(self, step: ForcedStep, reqs, accept_index: torch.Tensor | None
                 ) -> list[tuple[int, int, int, int]]:
        """Count the verified spans, per request (the grammar's tokens verified, of them accepted, the lookup's
        guesses verified, of them accepted); `accept_index` (bs, W): SGLang's accepted global positions."""
        out = []
        rows = accept_index.tolist() if accept_index is not None else [[] for _ in reqs]
        for b, r in enumerate(reqs):
            ext = step.layout.extended[b]
            if ext is None:
                out.append((0, 0, 0, 0))
                continue
            st = self.requests.of(r)
            if st.forced_stats is None:
                st.forced_stats = ForcedStats()
            stats = st.forced_stats
            nodes = accepted_nodes(step.layout.columns[b], rows[b], step.layout.num_nodes, b)
            self.outcomes.add(ext, nodes, b in step.free)
            got = self.spans.verified(ext, nodes, stats)
            stats.output_tokens += got
            on_path = set(nodes)
            guessed = sum(sp.num_guessed for sp in ext.spans)
            guessed_got = sum(1 for sp in ext.spans for j, g in enumerate(sp.guessed) if g and sp.first + j in on_path)
            out.append((ext.num_forced - guessed, got - guessed_got, guessed, guessed_got))
        self.outcomes.steps += 1
        if self.outcomes.steps % self.LOG_EVERY == 0:
            logger.info("ENTMTP forced spans over %d steps: %s; %.2f tokens a row per step; spans capped at %s "
                        "(below the top-1 leaf, after the root) at the last step's token price", self.outcomes.steps,
                        self.outcomes.summary(), self.tokens_per_row, self.last_caps)
        return out

    @staticmethod
    def policy_counts(step: ForcedStep, counts: list[int]) -> list[int]:
        """Accepted drafts as the policy's feedback reads them: at most the depth each row's tree was drafted to
        (beyond it the tokens are the grammar's, not the drafter's)."""
        return [min(int(c), d) if e is not None else int(c)
                for c, d, e in zip(counts, step.layout.drafted_depth, step.layout.extended)]
