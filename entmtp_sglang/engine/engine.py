"""The reference tree-speculative engine (pure torch; CPU or GPU).

One decode step for a batch, each request with its own tree:

    draft   : drafter.begin(f_{n-1}, root) -> the policy chooses a tree -> drafter.expand(tree), level by
              level; a staged policy may cut the tree to one of its prefixes after each level
    verify  : one target pass over all tree nodes with the tree attention mask
    accept  : greedy (longest path matching the target's argmax) or recursive rejection sampling
    commit  : move the accepted nodes' KV into place (compaction); root <- the target's next token

The drafter is driven through the drafting protocol (`entmtp_sglang.drafting`): prefill once, then begin,
expand and commit each step; the target hands it the features it reads (`Drafting.target_layers`).

A chooser with a `rests(active)` hook may skip the drafter for a step (every active request decodes plainly,
chain:0); a drafter with a draft cache then catches up on the skipped tokens in one commit before it drafts again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..forced_spans import HistoryLookup, LookupOnly
from ..grammar import GrammarDraftMasks
from ..model.llama import LlamaForCausalLM
from ..policy.chooser import StepChooser, StepRecord, StepView
from ..policy.eagle2 import DynamicTree, prune_by_confidence, subtree
from ..policy.signals import entropy_nats, top_margin, top_probs
from ..tree import Tree
from .batch_tree import pad_trees, tree_attention_mask
from .draft import DraftState, make_drafting
from .forced import ForcedSpans, ForcedStats, ForcedStep
from .sampling import SamplingParams, probs_from_logits
from .verify import NO_TOKEN, Accepted, verify_greedy_batch, verify_sampling


class RequestError(ValueError):
    """A request that cannot be served as asked (empty prompt, too long, ...)."""


@dataclass
class RequestResult:
    """finish_reason is one of
        "eos"                          the end-of-sequence token (unconstrained request)
        "length"                       max_new_tokens reached (unconstrained request)
        "grammar_complete"             the grammar accepted its stop token: the output is complete
        "length: grammar incomplete"   max_new_tokens reached before the grammar was complete
        "grammar_dead_end: ..."        the grammar allows no token of the vocabulary next (or rejected
                                       one); the rest of the message says where
    `finish_kind` is the part before the first ':'."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str = ""
    forced: ForcedStats | None = None  # forced spans drafted, accepted and kept (when the engine drafts them)

    @property
    def finish_kind(self) -> str:
        return self.finish_reason.split(":")[0]

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per step, forced spans' tokens included."""
        return sum(getattr(s, "accepted_all", s.accepted) for s in self.steps) / max(1, len(self.steps))

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per target forward pass (prefill counts as one)."""
        return len(self.output_ids) / (1 + len(self.steps))


def static_chooser(tree: Tree) -> StepChooser:
    return lambda view: tree


def _merge_commits(parts: list[tuple]) -> tuple:
    """Several steps' draft-cache commits (path tokens (B, T), path features (B, T, d), counts (B,)), in
    order, as one: each row's entries packed one after another."""
    counts = sum(c for _, _, c in parts)
    b, width = counts.shape[0], max(1, int(counts.max()))
    tokens = torch.zeros((b, width), dtype=torch.int64)
    feats = torch.zeros((b, width, parts[0][1].shape[-1]), dtype=parts[0][1].dtype)
    fill = [0] * b
    for t, f, c in parts:
        for i, k in enumerate(c.tolist()):
            tokens[i, fill[i]: fill[i] + k] = t[i, :k]
            feats[i, fill[i]: fill[i] + k] = f[i, :k]
            fill[i] += k
    return tokens, feats, counts


class Engine:
    def __init__(self, target: LlamaForCausalLM, drafter_kind: str, drafter: torch.nn.Module,
                 eos_token_id: int | None = None):
        self.target = target
        self.drafter_kind = drafter_kind
        self.drafter = drafter
        self.eos = eos_token_id
        self.context = target.shape.max_position_embeddings

    # ------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if len(prompt_ids) == 0:
            raise RequestError("empty prompt: give at least one token of input")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model context of {self.context} tokens")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, chooser: StepChooser,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 observer: Callable | None = None, grammars: list | None = None,
                 grammar_drafting: bool = True, forced_spans: ForcedSpans | None = None) -> list[RequestResult]:
        """Generate for a batch. `chooser` picks each request's tree per step. `observer(state, lens,
        drafting, active)`, if given, sees the drafter state of every step before the tree is chosen
        (`state.root_logits` already masked by each request's grammar when drafts are masked).

        `grammars[i]` (a `grammar.RequestGrammar` or None) constrains request i: the target's logits at
        every tree node are masked by that node's grammar state, so the output equals constrained
        plain decoding. With `grammar_drafting`, drafts are masked too (illegal branches are pruned)
        and the entropy the policy sees is the masked one; without it the grammar acts only at
        verification, as in SGLang.

        `forced_spans` (`forced.ForcedSpans`): below every leaf of a constrained request's tree, the text its
        grammar alone decides there, as the tokenizer spells it, verified like any draft; with its `lookup` on,
        where the grammar decides nothing, and on every request without a grammar, the request's own text
        repeating (lookup spans, `forced_spans.LookupOnly`: as ENTMTP does inside SGLang by default). A request
        whose span after the root is worth its tree's depth drafts nothing that step (`forced.py`). Each result's
        `forced` counts them and its steps are `forced.ForcedStepRecord`s."""
        for p in prompts:
            self.check_request(p, max_new_tokens)
        gen = torch.Generator().manual_seed(seed)
        b = len(prompts)
        results = [RequestResult(list(p), forced=ForcedStats() if forced_spans is not None else None)
                   for p in prompts]
        drafting = make_drafting(self.drafter_kind, self.drafter, self.target)
        max_nodes_guess = 64 + (forced_spans.config.max_nodes if forced_spans is not None else 0)
        capacity = max(len(p) for p in prompts) + max_new_tokens + max_nodes_guess + 2
        cache = self.target.new_cache(b, capacity)

        # prefill (right-padded prompts, causal within each row)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        length = int(lens.max())
        ids = torch.zeros((b, length), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        pos = torch.arange(length).expand(b, length)
        causal = torch.ones(length, length, dtype=torch.bool).tril().expand(b, 1, length, length)
        capture = drafting.target_layers
        hidden, features = self._target(ids, pos, causal, cache, torch.zeros(b, dtype=torch.int64), capture)
        last = hidden[torch.arange(b), lens - 1]  # (B, d) = f_{L-1}
        grammars = grammars or [None] * b
        first = self.target.logits(last)
        stuck = [False] * b  # the grammar allows no token at all before the first one
        for i, g in enumerate(grammars):
            if g is not None:
                allowed = g.root_mask()
                stuck[i] = not bool(allowed.any())
                first[i] = first[i].masked_fill(~allowed, float("-inf")) if not stuck[i] else 0.0
        roots = self._pick(first, sampling, gen)
        drafting.prefill(ids, lens, features, capacity)
        for r, t, g, dead in zip(results, roots.tolist(), grammars, stuck):
            if dead:
                r.finish_reason = "grammar_dead_end: no token of the vocabulary is allowed at the start"
                continue
            r.output_ids.append(t)
            if g is not None:
                g.advance([t])
        active = [not dead and not self._finished(r, max_new_tokens, g)
                  for r, g, dead in zip(results, grammars, stuck)]
        feats = features[torch.arange(b), lens - 1]  # (B, D): the drafter's features of position L-1
        rests = getattr(chooser, "rests", None)
        deferred = []  # the drafter's commits of the steps that rested it
        free = [None] * b  # the lookup spans of each request without a grammar (`_forced_step`)

        while any(active):
            t0 = time.perf_counter()
            if rests is not None and rests([i for i, a in enumerate(active) if a]):
                feats, roots, commit = self._plain_step(feats, roots, lens, cache, sampling, gen, grammars,
                                                        active, results, max_new_tokens, t0, capture,
                                                        self._forced_step(forced_spans, grammars, active, results,
                                                                          lens, max_new_tokens, free))
                deferred.append(commit)
                continue
            if deferred:
                drafting.commit(*_merge_commits(deferred))
            deferred = []
            state, legal = self._begin_step(drafting, feats, roots, grammars, active, grammar_drafting)
            if observer is not None:  # after the grammar mask: it sees what the choosers' views carry
                observer(state, lens, drafting, active)
            views, chosen = self._choose_trees(chooser, state, results, active, lens, drafting)
            forced = self._forced_step(forced_spans, grammars, active, results, lens, max_new_tokens, free)
            only = forced.forced_only_rows(chosen) if forced is not None else set()
            drafted = [Tree.chain(0) if i in only else t for i, t in enumerate(chosen)]
            restage = chooser.restage if getattr(chooser, "staged", False) else None
            tokens, trees, staged, logprobs = self._draft(drafting, state, drafted, legal, restage, active)
            if forced is not None:  # the grammar's spans below the leaves: the trees as verified
                tokens, trees = forced.extend(tokens, trees, logprobs)
            accepted, features, logits = self._verify(tokens, trees, lens, cache, sampling, gen, grammars, active,
                                                      capture)
            feats, roots, commit = self._commit(accepted, features, lens, cache, state, active)
            drafting.commit(*commit)
            names = [staged[i][0].name if i in staged else t.name for i, t in enumerate(chosen)]
            depths = [staged[i][0].max_depth if i in staged else getattr(t, "wide", t).max_depth
                      for i, t in enumerate(chosen)]
            self._record(results, views, names, trees, accepted, logits, grammars, active,
                         max_new_tokens, time.perf_counter() - t0, forced=forced, chosen_depths=depths)
        return results

    def _plain_step(self, feats, roots, lens, cache, sampling, gen, grammars, active, results, max_new_tokens, t0,
                    capture=None, forced: ForcedStep | None = None):
        """A step that rests the drafter: every request verifies its root alone (chain:0), with the forced span
        after it where `forced`. Returns the next features and roots, and the draft-cache commit to apply before
        the drafter runs again."""
        b = len(results)
        chain0 = Tree.chain(0)
        trees = [chain0] * b
        state = DraftState(feats, roots, None)
        tokens = roots.view(b, 1).clone()
        if forced is not None:
            tokens, trees = forced.extend(tokens, trees)
        accepted, features, logits = self._verify(tokens, trees, lens, cache, sampling, gen, grammars, active,
                                                  capture)
        feats, roots, commit = self._commit(accepted, features, lens, cache, state, active)
        views = [StepView(i, 0.0, (), sum(active), int(lens[i])) for i in range(b)]
        self._record(results, views, [chain0.name] * b, trees, accepted, logits, grammars, active,
                     max_new_tokens, time.perf_counter() - t0, rested=True, forced=forced, chosen_depths=[0] * b)
        return feats, roots, commit

    # -- one decode step, in order ----------------------------------------------------------------
    def _begin_step(self, drafting, feats, roots, grammars, active, grammar_drafting):
        """The drafter's distribution for each request's next position (before any tree is chosen),
        masked by the request's grammar when drafts are masked; and the grammar masks for drafting."""
        state = drafting.begin(feats, roots)
        legal = None
        if any(g is not None for g in grammars) and grammar_drafting:
            now = {i: g.root_mask() for i, g in enumerate(grammars) if g is not None and active[i]}
            for i, m in now.items():
                state.root_logits[i] = state.root_logits[i].masked_fill(~m, float("-inf"))
            legal = GrammarDraftMasks(grammars, now, state.root_logits.shape[-1])
        return state, legal

    def _choose_trees(self, chooser, state, results, active, lens, drafting):
        """Each active request's tree from the chooser (chain:0 for finished rows and where the tree
        would run past the context); returns the views the chooser saw and the trees."""
        d_ent = entropy_nats(state.root_logits)
        d_margin = top_margin(state.root_logits)
        d_top = top_probs(state.root_logits).tolist()
        views, trees = [], []
        for i in range(len(results)):
            view, tree = None, Tree.chain(0)
            if active[i]:
                view = StepView(i, float(d_ent[i]), tuple(results[i].steps), sum(active), int(lens[i]),
                                float(d_margin[i]), tuple(d_top[i]))
                tree = chooser(view)
                tree.check_depth(drafting.max_depth, f"the {self.drafter_kind} drafter")
                if int(lens[i]) + tree.max_depth + 1 > self.context:
                    tree = Tree.chain(0)  # no room left to speculate: plain decoding
            views.append(view)
            trees.append(tree)
        return views, trees

    def _record(self, results, views, names, trees, accepted, logits, grammars, active, max_new_tokens, seconds,
                rested: bool = False, forced: ForcedStep | None = None, chosen_depths: list[int] | None = None):
        """Append each active request's accepted tokens (cut at max_new_tokens and eos), advance its
        grammar, log the step (under the chosen tree's name; its nodes as verified), and update `active`.
        With `forced`, the record also counts the step's forced spans (`ForcedStep.record`)."""
        for i, r in enumerate(results):
            if not active[i]:
                continue
            acc, node_tokens = accepted[i]
            ent = entropy_nats(logits[i, list(acc.nodes)]).nan_to_num(0.0).tolist()  # nan: nothing allowed
            new = [node_tokens[n] for n in acc.nodes[1:]]
            if acc.next_token != NO_TOKEN:
                new.append(acc.next_token)
            new = new[: max_new_tokens - len(r.output_ids)]
            if self.eos is not None and self.eos in new:
                new = new[: new.index(self.eos) + 1]
            if grammars[i] is not None:
                grammars[i].advance(new)
            v = views[i]
            rec = StepRecord(names[i], trees[i].num_nodes, acc.num_accepted, ent, v.draft_entropy, seconds,
                             v.draft_margin, rested)
            if forced is not None:
                rec = forced.record(i, rec, acc.nodes, min(len(new), acc.num_accepted), chosen_depths[i])
            r.steps.append(rec)
            r.output_ids.extend(new)
            active[i] = not self._finished(r, max_new_tokens, grammars[i])

    def _forced_step(self, spans: ForcedSpans | None, grammars, active, results, lens, max_new_tokens, free: list
                     ) -> ForcedStep | None:
        """This step's forced spans (None without `forced_spans`, or without grammars and lookup spans). A request
        may verify as many levels below its root as fit before the context limit and are still wanted
        (max_new_tokens). `free[i]`: request i's lookup spans where it has no grammar (`LookupOnly`, made on first
        use and kept from step to step)."""
        if spans is None or (not spans.config.lookup and all(g is None for g in grammars)):
            return None
        room = [max(0, min(self.context - int(lens[i]) - 1, max_new_tokens - len(r.output_ids) - 1))
                for i, r in enumerate(results)]
        sources = list(grammars)
        for i, (g, r) in enumerate(zip(grammars, results)):
            if g is None:
                if spans.config.lookup and active[i]:   # no grammar: its spans are its own text repeating
                    if free[i] is None:
                        free[i] = LookupOnly(HistoryLookup())
                    free[i].lookup.sync(r.prompt_ids, r.output_ids)
                    sources[i] = free[i]
                continue
            if spans.config.lookup:   # lookup spans: each constrained request's text, indexed as its output grows
                if getattr(g, "lookup", None) is None:
                    g.lookup = HistoryLookup()
                g.lookup.sync(r.prompt_ids, r.output_ids)
            if spans.ends is not None:   # spans end in the token the model writes there (SpanEnds)
                if getattr(g, "join", None) is None:
                    g.join = spans.ends.request()
                g.join.sync(r.output_ids)
        return ForcedStep(spans, sources, active, [r.forced for r in results], room)

    # ------------------------------------------------------------------------------------------
    def _finished(self, r: RequestResult, max_new_tokens: int, grammar=None) -> bool:
        """Set r.finish_reason and return True if the request is done (output is already cut at
        max_new_tokens and at the first eos; the grammar has accepted exactly the output)."""
        if grammar is not None and grammar.dead_end:
            r.finish_reason = f"grammar_dead_end: the grammar rejected token id {grammar.rejected_token}"
            return True
        if grammar is not None and grammar.terminated:
            r.finish_reason = "grammar_complete"
            return True
        if self.eos is not None and r.output_ids and r.output_ids[-1] == self.eos:
            r.finish_reason = "eos"
            return True
        if len(r.output_ids) >= max_new_tokens:
            r.finish_reason = "length" if grammar is None else "length: grammar incomplete"
            return True
        if grammar is not None and not bool(grammar.root_mask().any()):
            r.finish_reason = (f"grammar_dead_end: no token of the vocabulary is allowed after generated "
                               f"token {len(r.output_ids)} (id {r.output_ids[-1]})")
            return True
        return False

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if sampling.greedy:
            return logits.argmax(-1)
        return torch.multinomial(probs_from_logits(logits, sampling), 1, generator=gen).squeeze(-1)

    def _draft(self, drafting, state: DraftState, trees: list, legal, restage=None, active=None):
        """Fill every node of each request's tree with a drafted token; a staged decision or an EAGLE-2 style
        tree keeps fewer nodes, and grammar-masked drafts lose the branches the grammar forbids. Returns the
        (B, N) tokens (padded), the trees as they will be verified, and {request: (tree, nodes)} for the
        requests a staged decision moved to a smaller tree, and each kept node's draft log-prob under its parent's
        distribution (B, N).

        `restage(depth, drafted, drafting)`, a chooser's staged decision, is called after each drafted level
        beyond the first with `drafted[i][n]`, node n's draft probability (None where not drafted yet), and
        `drafting[i]`, the tree request i drafts (None for a finished request); it returns {request: (tree,
        its nodes in the drafted tree)}, and the drafter expands those nodes only."""
        wide = [t.wide if isinstance(t, DynamicTree) else t for t in trees]
        padded = pad_trees(wide)
        if legal is not None:
            legal.parents = padded.parents
        staged: dict[int, tuple[Tree, tuple[int, ...]]] = {}
        after_level = None
        if restage is not None:
            def after_level(depth: int, tokens: torch.Tensor, logprobs: torch.Tensor):
                probs = torch.exp(logprobs).masked_fill(padded.depths > depth, float("nan")).tolist()
                drafting_now = [w if active is None or active[i] else None for i, w in enumerate(wide)]
                new = restage(depth, [[None if p != p else p for p in row] for row in probs], drafting_now)
                if not new:
                    return None
                staged.update(new)
                keep = torch.ones_like(padded.valid)
                for i, (_, image) in new.items():
                    keep[i] = False
                    keep[i, list(image)] = True
                return keep
        tokens, logprobs = drafting.expand(state, padded, legal, after_level)  # (B, N)
        prune = legal is not None and bool(torch.isinf(logprobs).any())
        if prune or staged or any(isinstance(t, DynamicTree) for t in trees):
            new_tokens, new_trees, new_logprobs = [], [], []
            for i, t in enumerate(trees):
                full = t.wide if isinstance(t, DynamicTree) else t
                base, image = staged.get(i, (full, list(range(full.num_nodes))))
                lp = logprobs[i, image].tolist()
                keep = t.keep if isinstance(t, DynamicTree) else base.num_nodes
                nodes = prune_by_confidence(base, lp, keep)
                if nodes == list(range(base.num_nodes)):
                    new_trees.append(base)
                else:
                    new_trees.append(subtree(base, nodes))
                new_tokens.append(tokens[i, [image[k] for k in nodes]])
                new_logprobs.append(logprobs[i, [image[k] for k in nodes]])
            trees = new_trees
            tokens = torch.zeros(pad_trees(new_trees).parents.shape, dtype=torch.int64)
            logprobs = torch.zeros(tokens.shape, dtype=logprobs.dtype)
            for i, (row, lp) in enumerate(zip(new_tokens, new_logprobs)):
                tokens[i, : len(row)] = row
                logprobs[i, : len(lp)] = lp
        return tokens, trees, staged, logprobs

    def _target(self, ids, positions, mask, cache, start, capture):
        """The target's final-normed hidden states (B, T, d) and the drafter's features: those same states, or
        with `capture` (the drafter's `target_layers`) the residual streams entering those layers (B, T, D)."""
        if capture is None:
            hidden = self.target(ids, positions, mask, cache, start)
            return hidden, hidden
        return self.target(ids, positions, mask, cache, start, capture=capture)

    def _verify(self, tokens: torch.Tensor, trees: list, lens, cache, sampling, gen, grammars, active, capture=None):
        """One target pass over every node of every tree (tree attention), the grammar masks applied to
        the target's logits, and acceptance: greedy (longest path matching the target's argmax) or
        recursive rejection sampling. Returns [(Accepted, node tokens)], the drafter's features at every
        node (`_target`), logits."""
        padded = pad_trees(trees)
        b, n = tokens.shape
        positions = lens.view(b, 1) + padded.depths
        mask = tree_attention_mask(lens, padded)
        hidden, features = self._target(tokens, positions, mask, cache, lens, capture)  # (B, N, d), (B, N, D)
        logits = self.target.logits(hidden)  # (B, N, V)
        alive = torch.ones(tokens.shape, dtype=torch.bool)  # (B, N): some token is allowed after the node
        for i, g in enumerate(grammars):
            if g is not None and active[i]:
                k = trees[i].num_nodes
                masks = g.tree_masks(trees[i], tokens[i, :k].tolist())
                logits[i, :k] = logits[i, :k].masked_fill(~masks, float("-inf"))
                alive[i, :k] = masks.any(-1)  # False after a stop token or at a grammar dead end
        sizes = [t.num_nodes for t in trees]
        node_tokens = [row[:k] for row, k in zip(tokens.tolist(), sizes)]
        if sampling.greedy:  # one batched call (kernels.verify_tree_greedy)
            argmax = logits.argmax(-1).masked_fill(~alive, NO_TOKEN)
            return list(zip(verify_greedy_batch(padded.parents, sizes, tokens, argmax), node_tokens)), features, logits
        accepted = []
        for i, tree in enumerate(trees):
            probs = probs_from_logits(logits[i, : tree.num_nodes], sampling)
            probs = probs.masked_fill(~alive[i, : tree.num_nodes, None], 0.0)
            accepted.append((verify_sampling(tree, node_tokens[i], probs, gen), node_tokens[i]))
        return accepted, features, logits

    def _commit(self, accepted: list[tuple[Accepted, list[int]]], hidden, lens, cache, state, active):
        """Compact the accepted nodes' KV to contiguous slots; return next features and roots."""
        b = len(accepted)
        rows, src, dst = [], [], []
        feats = torch.empty_like(hidden[:, 0])
        roots = torch.empty(b, dtype=torch.int64)
        width = max(len(a.nodes) for a, _ in accepted)
        path_tokens = torch.zeros((b, width), dtype=torch.int64)
        path_feats = torch.zeros((b, width, hidden.shape[-1]), dtype=hidden.dtype)
        counts = torch.zeros(b, dtype=torch.int64)
        for i, (acc, node_tokens) in enumerate(accepted):
            if not active[i]:  # finished rows stay where they are
                feats[i], roots[i] = state.features[i], state.roots[i]
                continue
            base = int(lens[i])
            for j, node in enumerate(acc.nodes):
                if node != j:
                    rows.append(i)
                    src.append(base + node)
                    dst.append(base + j)
                path_tokens[i, j] = node_tokens[node]
                path_feats[i, j] = state.features[i] if j == 0 else hidden[i, acc.nodes[j - 1]]
            counts[i] = len(acc.nodes)
            feats[i] = hidden[i, acc.nodes[-1]]
            roots[i] = acc.next_token if acc.next_token != NO_TOKEN else 0  # the request ends this step
        cache.keep(torch.tensor(rows, dtype=torch.int64), torch.tensor(src, dtype=torch.int64),
                   torch.tensor(dst, dtype=torch.int64))
        lens += counts
        return feats, roots, (path_tokens, path_feats, counts)
