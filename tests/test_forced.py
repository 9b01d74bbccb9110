"""Forced spans (jump-forward drafting): the grammar's decided text drafted without the drafter."""

from __future__ import annotations

import pytest

from entmtp_sglang.engine.forced import ForcedSpanConfig, ForcedSpans, ForcedStats, extend_tree, path_tokens
from entmtp_sglang.grammar import RequestGrammar
from entmtp_sglang.tree import Tree

# a raw vocabulary: the stop token, single letters a..y, and a few longer spellings
VOCAB = ["</s>", *"abcdefghijklmnopqrstuvwxy", "gh", "ghi", "xy", "ab", "q\"", *"0123456789"]
VOCAB += [""] * (64 - len(VOCAB))  # empty strings: special tokens xgrammar never allows as text
STOP = 0
ID = {s: i for i, s in enumerate(VOCAB) if s}


def grammar(ebnf: str) -> RequestGrammar:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[STOP])
    return RequestGrammar(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(ebnf), len(VOCAB))


def spell(text: str) -> list[int]:
    """Greedy longest match, as a BPE tokenizer spells these strings."""
    out, i = [], 0
    while i < len(text):
        n = max(n for n in range(1, 4) if text[i: i + n] in ID)
        out.append(ID[text[i: i + n]])
        i += n
    return out


def letters(ids) -> str:
    return "".join(VOCAB[t] if t != STOP else "|" for t in ids)


def test_forced_span_follows_the_grammar_and_the_tokenizers_spelling():
    g = grammar('root ::= "abc" [d-f] "ghiq" [0-9] "xy"')
    assert letters(g.forced_span([], spell, 16)) == "abc"
    assert [VOCAB[t] for t in g.forced_span([], spell, 16)] == ["ab", "c"]  # the tokenizer's spelling
    assert g.forced_span([ID["a"], ID["b"], ID["c"]], spell, 16) == []  # d, e or f: the model's choice
    after_d = [ID["ab"], ID["c"], ID["d"]]
    assert [VOCAB[t] for t in g.forced_span(after_d, spell, 16)] == ["ghi", "q"]  # not q": a digit follows
    assert [VOCAB[t] for t in g.forced_span(after_d, spell, 1)] == ["ghi"]  # the cap
    end = after_d + [ID["ghi"], ID["q"], ID["7"]]
    assert letters(g.forced_span(end, spell, 16)) == "xy|"  # the stop token: the only legal token left
    assert g.forced_span([ID["z"] if "z" in ID else ID["y"]], spell, 16) == []  # an illegal path
    assert g.forced_span(end + [ID["xy"], STOP], spell, 16) == []  # terminated
    # the matcher is where it was: nothing accepted
    assert letters(g.forced_span([], spell, 16)) == "abc"
    assert g.advance([ID["ab"], ID["c"]]) and g.forced_span([], spell, 16) == []


def test_a_spelling_the_grammar_refuses_is_cut_there():
    g = grammar('root ::= "ab" [0-9]')
    # a tokenizer that spells "ab" as "a" then "q\"" (a token the grammar refuses): "a" is taken, then the
    # rest of the decided text ("b") is spelled again
    odd = lambda s: [ID["a"], ID['q"']] if s == "ab" else spell(s)  # noqa: E731
    assert letters(g.forced_span([], odd, 16)) == "ab"
    assert g.forced_span([], lambda s: [ID['q"']], 16) == []


def test_nothing_forced_where_every_state_has_a_choice():
    g = grammar("root ::= [a-c]+")
    assert g.forced_span([], spell, 16) == []
    assert g.forced_span([ID["a"], ID["b"]], spell, 16) == []


def test_extend_tree_hangs_spans_below_leaves():
    #   drafted              extended
    #   0 ─ 1 ─ 3            0 ─ 1 ─ 3 ─ 5 ─ 6
    #    └─ 2 ─ 4             └─ 2 ─ 4 ─ 7
    tree = Tree((-1, 0, 0, 1, 2))
    ext = extend_tree(tree, [10, 11, 12, 13, 14], {3: [20, 21], 4: [30]})
    assert ext.tree.parents == (-1, 0, 0, 1, 2, 3, 5, 4)
    assert ext.tokens == (10, 11, 12, 13, 14, 20, 21, 30)
    assert ext.num_drafted == 5 and ext.num_forced == 3
    assert [(s.leaf, s.first, s.tokens) for s in ext.spans] == [(3, 5, (20, 21)), (4, 7, (30,))]
    assert path_tokens(ext.tree, list(ext.tokens), 6) == [11, 13, 20, 21]
    assert extend_tree(tree, [10, 11, 12, 13, 14], {}).tree == tree
    with pytest.raises(ValueError, match="node 1 has children"):
        extend_tree(tree, [10, 11, 12, 13, 14], {1: [5]})


def test_extend_respects_caps_and_room():
    g = grammar('root ::= [a-b] "cdefghijk"')
    fs = ForcedSpans(spell, ForcedSpanConfig(max_tokens=4, max_nodes=6))
    tree = Tree((-1, 0, 0))
    ext = fs.extend(tree, [ID["x"], ID["a"], ID["b"]], g, room=20)
    assert [letters(s.tokens) for s in ext.spans] == ["cdef", "cd"]  # 4 per span, 6 per tree
    ext = fs.extend(tree, [ID["x"], ID["a"], ID["b"]], g, room=3)
    assert [letters(s.tokens) for s in ext.spans] == ["cd", "cd"]  # no deeper than 3 below the root
    chain0 = Tree.chain(0)
    assert fs.extend(chain0, [ID["x"]], g, room=20).num_forced == 0  # a or b: a choice
    g.advance([ID["a"]])
    assert letters(fs.extend(chain0, [ID["a"]], g, room=20).tokens[1:]) == "cdef"


def test_verified_counts_acceptance_from_the_first_token_of_each_reached_span():
    fs = ForcedSpans(spell)
    tree = Tree((-1, 0, 0, 1, 2))
    ext = extend_tree(tree, [10, 11, 12, 13, 14], {3: [20, 21, 22], 4: [30]})  # nodes 5-7 below 3, 8 below 4
    st = ForcedStats()
    assert fs.verified(ext, (0, 1, 3, 5, 6), st) == 2  # span below 3: two of three accepted, the third tried
    assert (st.spans, st.nodes, st.reached, st.tried, st.accepted) == (2, 4, 1, 3, 2)
    assert fs.verified(ext, (0, 2, 4, 8), st) == 1  # the whole span below 4
    assert (st.reached, st.tried, st.accepted) == (2, 4, 3) and st.acceptance == 0.75
    assert fs.verified(ext, (0, 1), st) == 0  # no span reached: drafted, not tried
    assert (st.spans, st.nodes, st.tried) == (6, 12, 4)


def test_what_a_span_is_worth():
    fs = ForcedSpans(spell, ForcedSpanConfig(prior_acceptance=0.9, prior_weight=4))
    assert fs.expected_tokens(3, 1.0) == 3.0
    assert fs.expected_tokens(3, 0.5) == pytest.approx(0.5 + 0.25 + 0.125)
    assert fs.acceptance() == pytest.approx(0.9)
    assert fs.forced_only(3, Tree.chain(2)) and not fs.forced_only(2, Tree.chain(2))  # 2.44 vs 1.71 >= 2
    assert not fs.forced_only(0, Tree.chain(0))
    poor = ForcedStats(tried=20, accepted=2)  # a request whose model spells the text otherwise
    assert fs.acceptance(poor) < 0.3 and not fs.forced_only(16, Tree.chain(2), poor)
    assert not ForcedSpans(spell, ForcedSpanConfig(forced_only=False)).forced_only(16, Tree.chain(1))
    with pytest.raises(ValueError, match="max_nodes"):
        ForcedSpanConfig(max_tokens=16, max_nodes=8)
