"""The grammar mask on draft logits (`sglang/grammar_draft.masked_logits`): over a draft vocabulary, xgrammar's packed
bitmask read at the draft tokens' target ids gives exactly what masking through the grammar object's
`apply_vocab_mask` gives (the path it replaced, still the path over the target vocabulary), on random masks, token
maps and logits. Pure torch and
xgrammar: SGLang is not imported."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.sglang.grammar_draft import _masked_by_grammar, allowed_ids, masked_logits


class XGrammarLike:
    """SGLang's xgrammar grammar object as masked_logits uses it: `apply_vocab_mask` is xgrammar's own kernel."""

    @staticmethod
    def apply_vocab_mask(logits, vocab_mask):
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, vocab_mask)


def random_bitmask(gen, vocab: int, density: float) -> torch.Tensor:
    """(1, ceil(vocab / 32)) int32 words with each token's bit set with probability `density`."""
    words = (vocab + 31) // 32
    bits = torch.rand(words * 32, generator=gen) < density
    packed = (bits.view(words, 32).long() << torch.arange(32)).sum(-1)
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32).view(1, words)


@pytest.mark.parametrize("vocab, density", [(97, 0.5), (1000, 0.02), (4099, 0.9), (4099, 0.0), (4099, 1.0)])
def test_the_packed_mask_read_at_the_ids_is_the_grammars_own_masking_exactly(vocab, density):
    gen = torch.Generator().manual_seed(vocab + int(density * 100))
    g = XGrammarLike()
    for _ in range(4):
        bitmask = random_bitmask(gen, vocab, density)
        logits = torch.randn(vocab + 5, generator=gen) * 4          # a few logits past the mask: never allowed
        logits[torch.rand(vocab + 5, generator=gen) < 0.05] = float("-inf")
        full = masked_logits(logits, g, bitmask)                   # the target vocabulary: the grammar's own masking
        kept = allowed_ids(bitmask, torch.arange(logits.numel())) & torch.isfinite(logits)
        assert torch.equal(torch.isfinite(full), kept) and torch.equal(full[kept], logits[kept])
        # a draft vocabulary (a token map, as SGLang's hot_token_id): ids in any order, some past the mask
        hot = torch.cat([torch.randperm(vocab, generator=gen)[: vocab // 3], torch.tensor([bitmask.numel() * 32 + 3])])
        draft = torch.randn(hot.numel(), generator=gen)
        got = masked_logits(draft, g, bitmask, hot)
        assert torch.equal(got, _masked_by_grammar(draft, g, bitmask, hot))
        assert got[-1] == float("-inf")
        assert torch.equal(masked_logits(draft, g, bitmask, hot), got)   # the map's index, made once, reused


def test_allowed_ids_follows_xgrammars_bit_order():
    import xgrammar as xgr

    vocab = 300
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    allowed = {0, 31, 32, 63, 64, 255, 299}
    for t in allowed:
        word = int(bitmask[0, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
        bitmask[0, t // 32] = word - (1 << 32) if word >= 2**31 else word
    ids = torch.arange(vocab + 40)
    assert set(ids[allowed_ids(bitmask, ids)].tolist()) == allowed


def test_a_token_map_of_another_length_is_refused():
    bitmask = torch.full((1, 4), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="token map"):
        masked_logits(torch.zeros(5), XGrammarLike(), bitmask, torch.arange(7))

