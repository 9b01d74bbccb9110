"""Grammar inside SGLang: the grammar-lowered entropy signal and grammar-aware drafting for ENTMTP.

SGLang keeps one grammar object per constrained request (`req.grammar`, xgrammar's matcher behind
SGLang's `BaseGrammarObject`: `accept_token`, `rollback`, `fill_vocab_mask`, `apply_vocab_mask`,
`allocate_vocab_mask`, `is_terminated`). When a decode step starts its state is "after the tree's root"
(the last token SGLang verified), which is exactly the state its own verify walk (`traverse_tree`) starts
from. We use the same object, and leave it in the state we found it:

* the draft signal (entropy, or top-1 margin) of a constrained request is taken over the tokens the
  grammar allows next, so
  structured output looks as predictable as it is and gets deeper trees;
* every drafted node's children are the top-k of the drafter's logits masked by the grammar state after
  the node's path, so no draft token the grammar forbids is proposed (a forbidden one could never be
  accepted by SGLang's grammar-masked verify).

Drafts only change which tokens are proposed; verification stays SGLang's (target logits masked by the
grammar), so output is unchanged. A grammar that raises is left alone for the step (plain drafts).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..grammar import token_allowed
from ..policy.signals import draft_signal, top_probs

logger = logging.getLogger("entmtp_sglang.sglang")


def live_grammar(req):
    """The request's grammar object if drafting may consult it this step, else None."""
    g = getattr(req, "grammar", None)
    if g is None or not hasattr(g, "fill_vocab_mask") or not hasattr(g, "rollback"):
        return None
    try:
        if g.is_terminated():
            return None
    except Exception:
        return None
    return g


def path_bitmask(grammar, path: Sequence[int], vocab_size: int) -> torch.Tensor | None:
    """The grammar's next-token bitmask after `path` (tokens after the root), or None when a token of the
    path is not allowed or the grammar terminates on it. The grammar is rolled back before returning."""
    mask = grammar.allocate_vocab_mask(vocab_size=vocab_size, batch_size=1, device="cpu")
    accepted = 0
    try:
        grammar.fill_vocab_mask(mask, 0)
        for t in path:
            if not token_allowed(mask[0], int(t)):
                return None
            grammar.accept_token(int(t))
            accepted += 1
            if grammar.is_terminated():
                return None
            grammar.fill_vocab_mask(mask, 0)
        return mask
    finally:
        if accepted:
            grammar.rollback(accepted)


def allowed_ids(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(len(ids),) bool: whether xgrammar's packed bitmask row (int32 words, bit t % 32 of word t // 32) allows each
    token id; an id past the mask is not allowed. One gather and a shift over `ids`, not a pass over the vocabulary."""
    return _allowed(bitmask.reshape(-1), _BitIndex(ids))


class _BitIndex:
    """Where each of a fixed list of token ids sits in a packed bitmask: its word and its bit. Made once per id
    list (the server's token map: `_index_of`)."""

    __slots__ = ("ids", "word", "shift", "last_word")

    def __init__(self, ids: torch.Tensor):
        self.ids = ids.to("cpu", torch.long)
        self.word = self.ids // 32
        self.shift = (self.ids % 32).to(torch.int32)
        self.last_word = int(self.word.max()) if self.word.numel() else -1


def _allowed(words: torch.Tensor, index: _BitIndex) -> torch.Tensor:
    if index.last_word < words.numel():
        return ((words[index.word] >> index.shift) & 1).bool()
    inside = index.word < words.numel()
    return inside & ((words[torch.where(inside, index.word, 0)] >> index.shift) & 1).bool()


_INDEX: list = [None, None]   # the server's token map and its _BitIndex (one map a server; the map kept alive)


def _index_of(hot: torch.Tensor) -> _BitIndex:
    """The bit index of a draft vocabulary's map, made on first use."""
    if _INDEX[0] is not hot:
        _INDEX[:] = [hot, _BitIndex(hot)]
    return _INDEX[1]


def masked_logits(logits: torch.Tensor, grammar, bitmask: torch.Tensor, hot: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """A float copy of one row of logits (V,) with every token the bitmask forbids at -inf. `hot`: the target id of
    each draft token when the logits are over a draft vocabulary (--speculative-token-map, EAGLE-3): the
    target-vocabulary mask is read at those ids, straight off xgrammar's packed bitmask (`allowed_ids`: for
    SmolLM2's 8,192-token map 2-5x faster than scattering the logits into the target vocabulary and masking that,
    `bench/experiments/grammar_mask.py`). Over the target vocabulary, or with another mask format, the grammar
    object's own `apply_vocab_mask` masks them (`_masked_by_grammar`)."""
    row = logits.detach().float().reshape(-1)
    if hot is None or bitmask.dtype != torch.int32:
        return _masked_by_grammar(row, grammar, bitmask, hot).to(logits.device)
    index = _index_of(hot)
    if index.ids.numel() != row.numel():
        raise ValueError(f"{row.numel()} draft logits against a token map of {index.ids.numel()} ids")
    allowed = _allowed(bitmask.cpu().reshape(-1), index).to(row.device)
    return row.masked_fill(~allowed, float("-inf"))


def _masked_by_grammar(row: torch.Tensor, grammar, bitmask: torch.Tensor, hot: torch.Tensor | None) -> torch.Tensor:
    """`masked_logits` through the grammar object's own `apply_vocab_mask` over the target vocabulary (a draft
    vocabulary's logits scattered into it first)."""
    row = row.cpu()
    if hot is not None:
        hot = hot.to("cpu", torch.long)
        full = torch.full((max(bitmask.shape[-1] * 32, int(hot.max()) + 1),), float("-inf"))
        full[hot] = row
        return _masked_by_grammar(full, grammar, bitmask, None)[hot]
    row = row.reshape(1, -1).clone()
    v = min(row.shape[-1], bitmask.shape[-1] * 32)
    part = row[:, :v].contiguous()
    grammar.apply_vocab_mask(part, bitmask[:, : (v + 31) // 32])
    out = torch.full_like(row, float("-inf"))
    out[:, :v] = part
    return out[0]


def grammar_topk(logits: torch.Tensor, grammar, path: Sequence[int], k: int, vocab_size: int,
                 hot: torch.Tensor | None = None):
    """Top-k target token ids of `logits` (V,) among the tokens the grammar allows after `path`; None when the
    grammar gives no guidance there (path invalid or grammar finished). `hot`: as in `masked_logits`."""
    bitmask = path_bitmask(grammar, path, vocab_size)
    if bitmask is None:
        return None
    top = torch.topk(masked_logits(logits, grammar, bitmask, hot), k).indices
    return top if hot is None else hot.to(top.device)[top]


def grammar_signal(logits: torch.Tensor, grammar, vocab_size: int, kind: str = "draft_entropy",
                   with_probs: bool = False, hot: torch.Tensor | None = None):
    """A draft signal (`policy.signals.draft_signal`: entropy in nats, or top-1 margin) of softmax(logits)
    restricted to the tokens the grammar allows next (renormalised); None when the grammar gives no
    guidance or allows nothing. `with_probs`: (signal, the masked top-k probabilities) instead. `hot`: as in
    `masked_logits` (the signal is then over the allowed tokens of the draft vocabulary)."""
    bitmask = path_bitmask(grammar, (), vocab_size)
    if bitmask is None:
        return None
    row = masked_logits(logits, grammar, bitmask, hot)
    if not torch.isfinite(row).any():
        return None
    value = float(draft_signal(kind, row.float().unsqueeze(0))[0])
    return (value, tuple(top_probs(row.unsqueeze(0))[0].tolist())) if with_probs else value
