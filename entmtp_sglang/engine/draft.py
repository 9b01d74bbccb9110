"""Drafting: fill every node of each request's tree with a candidate token (the protocol and the registry of
kinds are in `entmtp_sglang.drafting`).

Drafting is deterministic (top-k per parent): the child of rank r gets the drafter's r-th most likely
token at that position. Each drafter works in two phases so a policy can look at the drafter's
distribution for the next position before choosing the tree:

    state = drafter.begin(features, roots)      # state.root_logits: drafter logits over x_{n+1}
    tokens, logprobs = drafter.expand(state, trees)   # (B, N): tokens[:, 0] = roots; each node's
                                                      # draft log-prob under its parent's distribution
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafting import Drafting, drafter_kind
from ..model.drafters import EagleDraft, HydraHead, MedusaHeads
from ..model.linear import linear
from ..model.llama import LlamaForCausalLM
from .batch_tree import PaddedTrees, tree_attention_mask


@dataclass
class DraftState:
    features: torch.Tensor  # (B, D) target features of position n-1 (`Drafting.target_layers`)
    roots: torch.Tensor  # (B,) the known next tokens x_n
    root_logits: torch.Tensor  # (B, V) drafter logits over x_{n+1}
    extra: object = None


def _children_from_parents(tokens, logprobs, trees: PaddedTrees, depth: int, parent_idx: torch.Tensor,
                           parent_ok: torch.Tensor, logits: torch.Tensor, legal=None) -> None:
    """Give each node at `depth` the rank-th best token of its parent's logits (and its log-prob).

    logits (B, M, V) belong to the parents listed in parent_idx (B, M). `legal(parent_idx, tokens)`,
    if given, returns (B, M, V) bool: the tokens a grammar allows after each parent; a child that has
    no legal token left gets log-prob -inf (the engine prunes it)."""
    b, n = trees.parents.shape
    sel = trees.valid & (trees.depths == depth)
    if not bool(sel.any()):
        return
    if legal is not None:
        logits = logits.float().masked_fill(~legal(parent_idx, tokens), float("-inf"))
    k = int(trees.ranks[sel].max()) + 1
    top = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)  # (B, M, k)
    par = trees.parents.clamp(min=0)  # (B, N)
    match = (parent_idx.unsqueeze(1) == par.unsqueeze(2)) & parent_ok.unsqueeze(1)  # (B, N, M)
    slot = match.float().argmax(-1)  # (B, N): position of each node's parent within parent_idx
    rank = trees.ranks.clamp(max=k - 1).unsqueeze(-1)
    for src, dst in ((top.indices, tokens), (top.values, logprobs)):
        cand = torch.gather(src, 1, slot.unsqueeze(-1).expand(b, n, k))  # (B, N, k)
        dst[sel] = torch.gather(cand, 2, rank).squeeze(-1)[sel].to(dst.dtype)


def _restage(trees: PaddedTrees, after_level, depth: int, tokens, logprobs) -> None:
    """A staged decision after drafting `depth`: `after_level(depth, tokens, logprobs)` may return a (B, N)
    bool mask of the nodes to keep; the others are drafted no further (nor are their descendants)."""
    if after_level is None:
        return
    keep = after_level(depth, tokens, logprobs)
    if keep is None:
        return
    valid = trees.valid & keep
    kids = torch.zeros(valid.shape, dtype=torch.int64)
    kids.scatter_add_(1, trees.parents.clamp(min=0), (valid & (trees.parents >= 0)).long())
    trees.valid.copy_(valid)
    trees.has_children.copy_(valid & (kids > 0))


def _start(state: DraftState, trees: PaddedTrees, legal=None):
    b, n = trees.parents.shape
    tokens = torch.zeros((b, n), dtype=torch.int64)
    tokens[:, 0] = state.roots
    logprobs = torch.zeros((b, n), dtype=torch.float32)
    root_idx = torch.zeros((b, 1), dtype=torch.int64)
    ok = torch.ones((b, 1), dtype=torch.bool)
    _children_from_parents(tokens, logprobs, trees, 1, root_idx, ok, state.root_logits.unsqueeze(1), legal)
    return tokens, logprobs


class MedusaDrafting(Drafting):
    def __init__(self, heads: MedusaHeads, target: LlamaForCausalLM | None = None):
        self.heads = heads
        self.max_depth = heads.max_depth

    def begin(self, features, roots) -> DraftState:
        return DraftState(features, roots, self.heads.head_logits(features, 1))

    def expand(self, state: DraftState, trees: PaddedTrees, legal=None, after_level=None):
        """`after_level`: a staged decision after each drafted level (`_restage`)."""
        tokens, logprobs = _start(state, trees, legal)
        for depth in range(1, trees.max_depth):
            idx, ok = trees.level(depth, need_children=True)  # parents of the depth+1 nodes
            if idx.shape[1] == 0:
                break
            # Medusa heads ignore the parent's token: every parent at a depth shares one distribution
            logits = self.heads.head_logits(state.features, depth + 1).unsqueeze(1).expand(-1, idx.shape[1], -1)
            _children_from_parents(tokens, logprobs, trees, depth + 1, idx, ok, logits, legal)
            _restage(trees, after_level, depth + 1, tokens, logprobs)
        return tokens, logprobs

    def path_logits(self, state: DraftState, true_tokens: torch.Tensor) -> list[torch.Tensor]:
        """Drafter logits at depths 1..K along the true continuation true_tokens (B, K) = x_{n+1..n+K}."""
        return [state.root_logits] + [self.heads.head_logits(state.features, k)
                                      for k in range(2, true_tokens.shape[1] + 1)]


class HydraDrafting(Drafting):
    def __init__(self, head: HydraHead, target: LlamaForCausalLM | None = None):
        self.head = head
        self.max_depth = head.max_depth

    def begin(self, features, roots) -> DraftState:
        z, logits = self.head.step(features, roots, 1)
        return DraftState(features, roots, logits, extra=z)

    def expand(self, state: DraftState, trees: PaddedTrees, legal=None, after_level=None):
        """`after_level`: a staged decision after each drafted level (`_restage`)."""
        b, n = trees.parents.shape
        d = state.features.shape[-1]
        tokens, logprobs = _start(state, trees, legal)
        states = torch.zeros((b, n, d), dtype=state.features.dtype)
        states[:, 0] = state.extra
        for depth in range(1, trees.max_depth):
            idx, ok = trees.level(depth, need_children=True)  # parents of depth+1 nodes
            if idx.shape[1] == 0:
                break
            par = torch.gather(trees.parents, 1, idx).clamp(min=0)
            prev = torch.gather(states, 1, par.unsqueeze(-1).expand(-1, -1, d))
            tok = torch.gather(tokens, 1, idx)
            z, logits = self.head.step(prev, tok, depth + 1)
            states.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, d), torch.where(ok.unsqueeze(-1), z, prev))
            _children_from_parents(tokens, logprobs, trees, depth + 1, idx, ok, logits, legal)
            _restage(trees, after_level, depth + 1, tokens, logprobs)
        return tokens, logprobs

    def path_logits(self, state: DraftState, true_tokens: torch.Tensor) -> list[torch.Tensor]:
        out, z = [state.root_logits], state.extra
        for k in range(2, true_tokens.shape[1] + 1):
            z, logits = self.head.step(z, true_tokens[:, k - 2].clamp(min=0), k)
            out.append(logits)
        return out


class EagleDrafting(Drafting):
    """EAGLE with its own KV cache; slot j of a row holds position j + 1 (position 0 has no entry).

    The draft model reads the target's features at committed positions and its own output (width
    `state.extra.shape[-1]`) inside the tree, so a drafter whose features are wider than its output (EAGLE-3)
    drafts through this class too."""

    def __init__(self, draft: EagleDraft, target: LlamaForCausalLM):
        self.draft = draft
        self.lm_head = target.lm_head_weight
        self.max_depth = draft.max_depth
        self.cache = None
        self.lens = None  # (B,) committed draft-cache entries per row

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.draft.head is not None:  # a draft vocabulary: -inf outside it
            return self.draft.head(out)
        return linear(out, self.lm_head)

    def prefill(self, prompt_ids: torch.Tensor, prompt_lens: torch.Tensor, features: torch.Tensor,
                capacity: int) -> None:
        """prompt_ids (B, L) right-padded, features (B, L, d) = target features f_0 .. f_{L-1}."""
        b, length = prompt_ids.shape
        self.cache = self.draft.new_cache(b, capacity)
        self.lens = torch.zeros(b, dtype=torch.int64)
        if length > 1:
            self.extend(prompt_ids[:, 1:], features[:, :-1], prompt_lens - 1)

    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Append counts[b] entries per row: tokens x_p with the true target features f_{p-1}."""
        b, t = tokens.shape
        start = self.lens
        positions = start.view(b, 1) + 1 + torch.arange(t).view(1, t)
        span = int(start.max()) + t
        slots = torch.arange(span).view(1, 1, span)
        qpos = start.view(b, 1, 1) + torch.arange(t).view(1, t, 1)
        mask = (slots <= qpos).unsqueeze(1)  # causal over committed + new entries
        self.draft(tokens, feats, positions.clamp(max=self.draft.rotary.cos.shape[0] - 1), mask,
                   self.cache, start)
        self.lens = self.lens + counts

    def begin(self, features, roots) -> DraftState:
        b = roots.shape[0]
        pos = (self.lens + 1).view(b, 1)
        span = int(self.lens.max()) + 1
        mask = (torch.arange(span).view(1, span) <= self.lens.view(b, 1)).view(b, 1, 1, span)
        out = self.draft(roots.view(b, 1), features.view(b, 1, -1), pos, mask, self.cache, self.lens)
        return DraftState(features, roots, self.logits(out[:, 0]), extra=out[:, 0])

    def expand(self, state: DraftState, trees: PaddedTrees, legal=None, after_level=None):
        """`after_level`: a staged decision after each drafted level (`_restage`)."""
        b, n = trees.parents.shape
        d = state.extra.shape[-1]  # the draft model's own output, fed to its children
        tokens, logprobs = _start(state, trees, legal)
        outs = torch.zeros((b, n, d), dtype=state.extra.dtype)
        outs[:, 0] = state.extra
        for depth in range(1, trees.max_depth):
            idx, ok = trees.level(depth, need_children=True)
            if idx.shape[1] == 0:
                break
            par = torch.gather(trees.parents, 1, idx).clamp(min=0)
            feats = torch.gather(outs, 1, par.unsqueeze(-1).expand(-1, -1, d))
            tok = torch.gather(tokens, 1, idx)
            pos = self.lens.view(b, 1) + 1 + depth
            pos = pos.expand_as(idx).clamp(max=self.draft.rotary.cos.shape[0] - 1)
            mask = tree_attention_mask(self.lens, trees, queries=idx)
            slots = self.lens.view(b, 1) + idx  # node i lives at slot lens + i
            out = self.draft(tok, feats, pos, mask, self.cache, slots)
            outs.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, d), torch.where(ok.unsqueeze(-1), out, feats))
            _children_from_parents(tokens, logprobs, trees, depth + 1, idx, ok, self.logits(out), legal)
            _restage(trees, after_level, depth + 1, tokens, logprobs)
        return tokens, logprobs

    def path_logits(self, state: DraftState, true_tokens: torch.Tensor) -> list[torch.Tensor]:
        """Chain drafting through the true tokens; uses scratch slots past the committed entries."""
        b = true_tokens.shape[0]
        out, feat = [state.root_logits], state.extra
        for k in range(2, true_tokens.shape[1] + 1):
            slot = (self.lens + k - 1).view(b, 1)
            span = int(slot.max()) + 1
            mask = (torch.arange(span).view(1, span) <= slot).view(b, 1, 1, span)
            pos = (slot + 1).clamp(max=self.draft.rotary.cos.shape[0] - 1)
            o = self.draft(true_tokens[:, k - 2].clamp(min=0).view(b, 1), feat.view(b, 1, -1), pos, mask,
                           self.cache, slot)
            feat = o[:, 0]
            out.append(self.logits(feat))
        return out

    def commit(self, path_tokens: torch.Tensor, path_feats: torch.Tensor, counts: torch.Tensor) -> None:
        """After verification: path_tokens (B, T) = root and accepted drafts, path_feats the true
        target features of the positions before them; counts[b] valid entries."""
        self.extend(path_tokens, path_feats, counts)


def make_drafting(kind: str, module, target: LlamaForCausalLM) -> Drafting:
    """The drafting of a registered drafter kind (`entmtp_sglang.drafting.DRAFTER_KINDS`)."""
    return drafter_kind(kind).build_drafting(module, target)
