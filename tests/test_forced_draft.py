"""Forced spans inside SGLang, the pure parts (sglang/forced_draft.py): SGLang's verify layout read back as a tree,
widened by forced spans into columns N.., and the accepted path mapped back; no SGLang, no server."""

from __future__ import annotations

import math

import pytest
import torch
from test_forced import ID, STOP, VOCAB, grammar, letters, spell

from entmtp_sglang.engine.forced import ForcedSpanConfig, ForcedSpans
from entmtp_sglang.sglang import forced_draft
from entmtp_sglang.sglang.forced_draft import (
    ForcedDraft,
    SGLangGrammar,
    accepted_nodes,
    forced_config_from_env,
    rank_priority,
    row_tree,
    widen,
)
from entmtp_sglang.tree import Tree, build_buffers


def layout(tree: Tree, tokens: list[int], width: int, seq_len: int = 10):
    """One row as SGLang's verify holds it: `tree`'s nodes at columns 0..n-1 (padding after), links over the real
    nodes, positions seq_len + depth, the QLEN_ONLY mask."""
    n = tree.num_nodes
    buf = build_buffers(tree)
    first = torch.full((width,), -1, dtype=torch.long)
    sibling = torch.full((width,), -1, dtype=torch.long)
    first[:n], sibling[:n] = buf.retrieve_next_token, buf.retrieve_next_sibling
    toks = torch.zeros(width, dtype=torch.long)
    toks[:n] = torch.tensor(tokens)
    pos = torch.full((width,), seq_len, dtype=torch.long)
    pos[:n] += torch.tensor(tree.depths)
    mask = torch.eye(width, dtype=torch.bool)
    mask[:n, :n] = buf.ancestor_mask.bool()
    return toks, pos, mask, first, sibling


def test_row_tree_reads_the_real_nodes_off_the_links_and_ranks_siblings():
    #   0 ─ 1 ─ 3        columns 4, 5: padding (unlinked)
    #    └─ 2
    tree = Tree((-1, 0, 0, 1))
    toks, _, _, first, sibling = layout(tree, [5, 6, 7, 8], 6)
    row = row_tree(toks.tolist(), first.tolist(), sibling.tolist())
    assert row.tree.parents == (-1, 0, 0, 1) and row.columns == (0, 1, 2, 3)
    assert row.tokens == (5, 6, 7, 8) and row.ranks == (0, 0, 1, 0)
    # the top-1 path's leaf (3) first: its path sums to 0, leaf 2's to -1
    assert rank_priority(row) == [0.0, 0.0, -1.0, 0.0]


def test_widen_hangs_spans_in_new_columns_with_their_ancestors_positions_and_links():
    g = grammar('root ::= "ab" [d-f] "ghiq" [0-9]')
    spans = ForcedSpans(spell, ForcedSpanConfig(max_tokens=4, max_nodes=4, min_reach=0.0, forced_only=False))
    #   row 0: 0 ─ 1 (ab) ─ 2 (d)     row 1: 0 (a resting row)
    trees = [Tree((-1, 0, 1)), Tree((-1,))]
    rows_in = [layout(trees[0], [0, ID["ab"], ID["d"]], 3), layout(trees[1], [0], 3)]
    toks, pos, mask, first, sibling = (torch.stack([r[k] for r in rows_in]) for k in range(5))
    rows = [row_tree(toks[b].tolist(), first[b].tolist(), sibling[b].tolist()) for b in range(2)]
    assert rows[1].tree.num_nodes == 1 and rows[1].columns == (0,)
    exts = [spans.extend(r.tree, list(r.tokens), g, 16, rank_priority(r)) for r in rows]
    assert letters(exts[0].tokens[3:]) == "ghiq" and [VOCAB[t] for t in exts[0].tokens[3:]] == ["ghi", "q"]
    assert [VOCAB[t] for t in exts[1].tokens[1:]] == ["ab"]   # the span after the root
    out = widen(toks, pos, mask, first, sibling, rows, exts)
    assert out.num_nodes == 3 + 2 and out.max_depth == 4 and out.drafted_depth == (2, 0)
    assert out.columns == ((0, 1, 2, 3, 4), (0, 3))
    assert out.tokens[0].tolist() == [0, ID["ab"], ID["d"], ID["ghi"], ID["q"]]
    assert out.tokens[1].tolist()[:1] + out.tokens[1].tolist()[3:4] == [0, ID["ab"]]
    assert out.positions[0].tolist() == [10, 11, 12, 13, 14] and out.positions[1, 3] == 11
    assert out.next_token[0].tolist() == [1, 2, 3, 4, -1] and out.next_sibling[0].tolist() == [-1] * 5
    assert out.next_token[1].tolist() == [3, -1, -1, -1, -1]
    assert out.real.tolist() == [[True] * 5, [True, False, False, True, False]]
    # each real node sees exactly its ancestors and itself
    for b, ext in enumerate(out.extended):
        cols = out.columns[b]
        for i in range(ext.tree.num_nodes):
            seen = {j for j in range(out.num_nodes) if out.mask[b, cols[i], j]}
            assert seen == {cols[a] for a in ext.tree.path_to(i)}, (b, i)
    # SGLang's accepted global positions (row * N' + column, -1 padded) back to tree nodes
    assert accepted_nodes(out.columns[0], [0, 1, 2, 3, -1], 5, 0) == (0, 1, 2, 3)
    assert accepted_nodes(out.columns[1], [5, 8, -1], 5, 1) == (0, 1)


def test_the_sglang_grammar_adapter_spans_as_the_reference_grammar_does():
    g = grammar('root ::= "abc" [d-f] "ghiq" [0-9] "xy"')

    class Stand:   # SGLang's XGrammarGrammar holds the same xgrammar matcher
        matcher = g.matcher

    adapter = SGLangGrammar.of(Stand(), len(VOCAB))
    for path in ([], [ID["ab"], ID["c"], ID["d"]], [ID["ab"], ID["c"], ID["d"], ID["ghi"], ID["q"], ID["7"]]):
        assert adapter.forced_span(path, spell, 16) == g.forced_span(path, spell, 16)
    assert letters(adapter.forced_span([ID["ab"], ID["c"], ID["d"], ID["ghi"], ID["q"], ID["7"]], spell, 16)) == "xy|"
    assert STOP in adapter.forced_span([ID["ab"], ID["c"], ID["d"], ID["ghi"], ID["q"], ID["7"]], spell, 16)
    assert SGLangGrammar.of(object(), len(VOCAB)) is None   # another grammar backend: no spans


def test_policy_feedback_counts_at_most_the_drafted_depth():
    out = widen(*(torch.zeros((2, 1), dtype=torch.long) for _ in range(2)), torch.ones((2, 1, 1), dtype=torch.bool),
                torch.full((2, 1), -1), torch.full((2, 1), -1),
                [row_tree([0], [-1], [-1])] * 2, [None, None])
    step = forced_draft.ForcedStep(out, None, ("a", "b"), 1)
    assert ForcedDraft.policy_counts(step, [3, 0]) == [3, 0]   # no spans: as counted


def test_the_switch_and_the_cap_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(forced_draft.ENV_FORCED, raising=False)
    monkeypatch.delenv(forced_draft.ENV_FORCED_MAX, raising=False)
    assert forced_config_from_env().max_tokens == 16 and forced_draft.extra_verify_tokens() == 16
    # only the drafter's top-1 path reaches the floor: a lower-ranked turn (-1) does not
    assert forced_config_from_env().min_reach == forced_draft.TOP1_REACH and -1.0 < math.log(forced_draft.TOP1_REACH)
    monkeypatch.setenv(forced_draft.ENV_FORCED_MAX, "6")
    assert forced_config_from_env().max_nodes == 6
    monkeypatch.setenv(forced_draft.ENV_FORCED_MAX, "0")
    with pytest.raises(ValueError, match="ENTMTP_FORCED_MAX_TOKENS"):
        forced_config_from_env()
    monkeypatch.delenv(forced_draft.ENV_FORCED_MAX)   # a bad value is an error whatever the other switches say
    monkeypatch.setenv(forced_draft.ENV_FORCED, "0")
    assert forced_config_from_env() is None and forced_draft.extra_verify_tokens() == 0


def test_extend_rewrites_sglangs_verify_input_and_counts_what_was_accepted():
    from types import SimpleNamespace

    g = grammar('root ::= "ab" [d-f] "ghiq" [0-9]')

    class Stand:   # an SGLang grammar object: its xgrammar matcher, after the tree's root
        matcher = g.matcher

    spans = ForcedSpans(spell, ForcedSpanConfig(max_tokens=4, max_nodes=4, min_reach=0.0, forced_only=False))
    draft = ForcedDraft(spans, len(VOCAB))
    # row 0: 0 ─ 1 (ab) ─ 2 (d), constrained; row 1: 0 ─ 1 (x), unconstrained
    rows_in = [layout(Tree((-1, 0, 1)), [0, ID["ab"], ID["d"]], 3), layout(Tree((-1, 0)), [0, ID["x"]], 3)]
    toks, pos, mask, first, sibling = (torch.stack([r[k] for r in rows_in]) for k in range(5))
    spec = SimpleNamespace(draft_token=toks.flatten(), positions=pos.flatten(), custom_mask=mask.flatten(),
                           retrieve_index=torch.arange(6).view(2, 3), retrieve_next_token=first,
                           retrieve_next_sibling=sibling, draft_token_num=3, spec_steps=2, num_tokens_per_req=3,
                           num_tokens_for_logprob_per_req=3, prepared_out_cache_loc=None, kv_loc_plan=None)
    reqs = [SimpleNamespace(rid="a", sampling_params=SimpleNamespace(max_new_tokens=32), output_ids=[]),
            SimpleNamespace(rid="b", sampling_params=SimpleNamespace(max_new_tokens=32), output_ids=[])]
    assert draft.extend(spec, None, reqs, {}, [100, 100]) is None and spec.draft_token_num == 3   # untouched
    assert draft.extend(spec, None, reqs, {0: Stand()}, [3, 100]) is None   # no KV room for N + max_nodes
    step = draft.extend(spec, None, reqs, {0: Stand()}, [100, 100])
    assert step is not None and step.base_width == 3
    assert spec.draft_token_num == spec.num_tokens_per_req == 5 and spec.spec_steps == 4
    assert spec.draft_token.view(2, 5)[0].tolist() == [0, ID["ab"], ID["d"], ID["ghi"], ID["q"]]
    assert spec.retrieve_index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert spec.retrieve_next_token.tolist() == [[1, 2, 3, 4, -1], [1, -1, -1, -1, -1]]
    assert spec.custom_mask.numel() == 2 * 5 * 5 and spec.positions.view(2, 5)[0, 4] == 14
    assert step.ragged.counts == (5, 2) and step.ragged.index.tolist() == [0, 1, 2, 3, 4, 5, 6]
    # the target took ab, d, ghi, then not q: the span rejected part-way
    counted = draft.verified(step, reqs, torch.tensor([[0, 1, 2, 3, -1], [5, 6, -1, -1, -1]]))
    assert counted == [(2, 1, 0, 0), (0, 0, 0, 0)]
    s = draft.requests.get(reqs[0]).forced_stats
    assert (s.spans, s.nodes, s.reached, s.tried, s.accepted) == (1, 2, 1, 2, 1)
    assert ForcedDraft.policy_counts(step, [3, 1]) == [2, 1]   # the feedback: at most the drafted depth


def test_only_the_drafters_top1_path_takes_a_span(monkeypatch):
    monkeypatch.delenv(forced_draft.ENV_FORCED, raising=False)
    monkeypatch.delenv(forced_draft.ENV_FORCED_MAX, raising=False)
    g = grammar('root ::= "ab" [d-f] "ghiq" [0-9]')
    #   0 ─ 1 (ab)     top-1: the grammar decides nothing after it (d, e or f)
    #    └─ 2 (a)      rank 1: "b" is forced after it
    toks, _, _, first, sibling = layout(Tree((-1, 0, 0)), [0, ID["ab"], ID["a"]], 3)
    row = row_tree(toks.tolist(), first.tolist(), sibling.tolist())
    everywhere = ForcedSpans(spell, ForcedSpanConfig(max_tokens=4, max_nodes=4, min_reach=0.0, forced_only=False))
    assert [VOCAB[t] for t in everywhere.extend(row.tree, list(row.tokens), g, 16, rank_priority(row)).tokens[3:]] \
        == ["b"]
    top1 = ForcedSpans(spell, forced_config_from_env())
    assert top1.extend(row.tree, list(row.tokens), g, 16, rank_priority(row)).spans == ()


def test_the_span_after_the_root_hangs_where_the_draft_parts_from_it(monkeypatch):
    monkeypatch.delenv(forced_draft.ENV_FORCED, raising=False)
    monkeypatch.delenv(forced_draft.ENV_FORCED_MAX, raising=False)
    g = grammar('root ::= "abc" [d-f]')   # the tokenizer spells "abc" as ab, c
    spans = ForcedSpans(spell, forced_config_from_env())
    #   0 ─ 1 (a) ─ 2 (b)      the top-1 path spells "ab" otherwise: its leaf's span is "c"
    #    └─ 3 (x)              no drafted child holds "ab": the span after the root hangs below the root
    tree = Tree((-1, 0, 1, 0))
    toks, pos, mask, first, sibling = layout(tree, [0, ID["a"], ID["b"], ID["x"]], 4)
    row = row_tree(toks.tolist(), first.tolist(), sibling.tolist())
    ext = forced_draft.with_root_span(spans, row, spans.extend(row.tree, list(row.tokens), g, 16, rank_priority(row)),
                                      g, 16)
    assert ext.tree.parents == (-1, 0, 1, 0, 0, 4, 2) and ext.num_drafted == 4
    assert [VOCAB[t] for t in ext.tokens[4:]] == ["ab", "c", "c"]
    out = widen(toks[None], pos[None], mask[None], first[None], sibling[None], [row], [ext])
    # the root's children in rank order 1, 3, then the span (column 4); siblings ascending, as SGLang lists them
    assert out.next_token[0].tolist() == [1, 2, 6, -1, 5, -1, -1]
    assert out.next_sibling[0].tolist() == [-1, 3, -1, 4, -1, -1, -1]
    assert out.positions[0].tolist() == [10, 11, 12, 11, 11, 12, 13]
    # the top-1 path spelled as the tokenizer does: its leaf's span is the same text, nothing more is hung
    toks, _, _, first, sibling = layout(Tree((-1, 0, 1)), [0, ID["ab"], ID["c"]], 3)
    row = row_tree(toks.tolist(), first.tolist(), sibling.tolist())
    base = spans.extend(row.tree, list(row.tokens), g, 16, rank_priority(row))
    assert forced_draft.with_root_span(spans, row, base, g, 16) is base


def test_span_outcomes_count_where_spans_hung_and_how_far_they_went():
    #   0 ─ 1 ─ 2 ─ 4' 5'      below the leaf 2: reached, its first token accepted, its second not
    #    │   └─ 8' 9'          below the inner node 1 (the span after the root, where the draft parted from it):
    #    └─ 3 ─ 6' 7'          reached, cut at its first token; below the leaf 3: not reached
    from entmtp_sglang.forced_spans import extend_tree

    tree = Tree((-1, 0, 1, 0))
    ext = extend_tree(tree, [10, 11, 12, 13], {2: [20, 21], 3: [30, 31], 1: [40, 41]}, inner=True)
    outcomes = forced_draft.SpanOutcomes()
    spans = {sp.leaf: sp for sp in ext.spans}
    outcomes.add(ext, (0, 1, 2, spans[2].first))             # 2's span: first token accepted, second not
    assert outcomes.kinds["leaf"] == [2, 4, 1, 0, 1, 2]       # 3's span not reached; 2 tokens tried
    assert outcomes.kinds["inner"] == [1, 2, 1, 1, 0, 1]      # 1 was reached, its span cut at the first token
    outcomes.steps = 1
    assert "leaf: 2 spans of 2.0 tokens, 50% reached" in outcomes.summary()
    assert "inner: 1 spans of 2.0 tokens, 100% reached, 100% of those cut" in outcomes.summary()


def test_spans_are_cut_to_what_pays_for_its_verify():
    """A span's k-th token is accepted with probability reach * acceptance**k; it is verified only where that is at
    least the token's price in emitted tokens (per-token seconds against a step's seconds per emitted token)."""
    assert forced_draft.span_cap(0.5, 0.8, 0.0, 16) == 16                  # free tokens: the whole span
    assert forced_draft.span_cap(0.5, 0.8, 0.2, 16) == 4                   # 0.5 * 0.8**4 = 0.205; ** 5 = 0.164
    assert forced_draft.span_cap(0.5, 0.8, 0.2, 3) == 3
    assert forced_draft.span_cap(0.2, 0.9, 0.3, 16) == 0                   # rarely reached: no span
    assert forced_draft.span_cap(1.0, 1.0, 0.9, 16) == 16                  # always accepted: whatever it costs
    # 2 ms a token against a 40 ms step emitting 3 tokens a row, one row: 0.15; eight rows: 1.2 (nothing pays)
    assert forced_draft.token_threshold(0.002, 0.040, 1, 3.0) == pytest.approx(0.15)
    assert forced_draft.token_threshold(0.002, 0.040, 8, 3.0) == pytest.approx(1.2)
    assert forced_draft.token_threshold(0.0, 0.040, 1, 3.0) == 0.0         # verify tokens free (a GPU at batch 1)
    # the caps follow what the server's spans did: spans below the top-1 leaf seldom reached get shorter
    spans = ForcedSpans(spell, forced_config_from_env())
    fd = forced_draft.ForcedDraft(spans, len(VOCAB))
    assert fd.caps(0.0) == (16, 16)
    before = fd.caps(0.15)
    fd.outcomes.kinds["leaf"] = [100, 700, 20, 0, 60, 80]                 # 20 % reached, 0.75 a token
    leaf, inner = fd.caps(0.15)
    assert leaf < before[0] and inner == before[1] and leaf == forced_draft.span_cap(
        *fd.outcomes.worth("leaf"), 0.15, 16)
    fd.observe([2, 4])
    assert fd.tokens_per_row == pytest.approx(2.0 + 0.05 * (4.0 - 2.0))


@pytest.mark.parametrize("lookup", [True, False])
def test_a_rows_span_goes_on_with_its_own_repeats_unless_lookup_spans_are_off(monkeypatch, lookup):
    """Where the grammar decides nothing below the top-1 leaf, the span goes on with the request's own text
    repeating (HistoryLookup over its prompt and output, ENTMTP_LOOKUP_SPANS), as far as the grammar allows."""
    from types import SimpleNamespace

    monkeypatch.setenv(forced_draft.ENV_LOOKUP, "1" if lookup else "0")
    g = grammar('root ::= ("a" [b-d] "e")+ "."')
    output = [ID[c] for c in "abeace"]
    assert g.advance(output)

    class Stand:   # an SGLang grammar object: its xgrammar matcher, after the request's output
        matcher = g.matcher

    spans = ForcedSpans(spell, ForcedSpanConfig(max_tokens=8, max_nodes=8, min_reach=0.0, forced_only=False))
    draft = ForcedDraft(spans, len(VOCAB))
    spec = _one_row_spec()
    req = SimpleNamespace(rid="r", sampling_params=SimpleNamespace(max_new_tokens=64), output_ids=output,
                          origin_input_ids=[ID["x"], ID["y"]])
    step = draft.extend(spec, None, [req], {0: Stand()}, [100])
    got = [VOCAB[t] for t in spec.draft_token.view(1, -1)[0].tolist()]
    # the top-1 path a, b; then e (the grammar's), then a, c (the repeat of "a c" after "a b e"), e (the grammar's)
    assert got == (["e", "a", "b", "e", "a", "c", "e"] if lookup else ["e", "a", "b", "e"])
    assert step is not None and step.layout.extended[0].num_forced == (4 if lookup else 1)
    assert draft.lookup_on == lookup


@pytest.mark.parametrize("mode", ["all", "1", "0"])
def test_a_row_without_a_grammar_takes_its_own_repeats_as_spans(monkeypatch, mode):
    """A free row (grammar None): with ENTMTP_LOOKUP_SPANS=all, below its top-1 leaf the tokens that followed the
    latest earlier occurrence of its path's end in its prompt and output, counted apart from the grammar's spans;
    with 1 (constrained rows only) and with 0, nothing."""
    from types import SimpleNamespace

    monkeypatch.setenv(forced_draft.ENV_LOOKUP, mode)
    lookup = mode == "all"
    spans = ForcedSpans(spell, ForcedSpanConfig(max_tokens=3, max_nodes=3, min_reach=0.0, forced_only=False))
    draft = ForcedDraft(spans, len(VOCAB))
    spec = _one_row_spec()
    req = SimpleNamespace(rid="r", sampling_params=SimpleNamespace(max_new_tokens=64),
                          origin_input_ids=[ID[c] for c in "xabcdy"], output_ids=[ID["e"]])
    step = draft.extend(spec, None, [req], {0: None}, [100])
    if not lookup:
        assert step is None and spec.draft_token_num == 3   # untouched: nothing to hang without a grammar
        return
    got = [VOCAB[t] for t in spec.draft_token.view(1, -1)[0].tolist()]
    assert got == ["e", "a", "b", "c", "d", "y"]           # "a b" was followed by "c d y" in the prompt (cap 3)
    assert step.free == frozenset({0})
    draft.verified(step, [req], torch.tensor([[0, 1, 2, 3, -1, -1]]))   # the target took a, b, c; not d
    assert draft.outcomes.kinds["free leaf"][:3] == [1, 3, 1] and draft.outcomes.kinds["leaf"][0] == 0
    assert draft.outcomes.worth("free leaf")[1] < draft.outcomes.worth("leaf")[1]   # a lower prior for guesses


def test_the_lookup_switch_is_validated(monkeypatch):
    monkeypatch.setenv(forced_draft.ENV_LOOKUP, "yes")
    with pytest.raises(ValueError, match="ENTMTP_LOOKUP_SPANS='yes': takes one of 0, 1, all"):
        forced_draft.lookup_mode()
    monkeypatch.setenv(forced_draft.ENV_LOOKUP, " ALL ")
    assert forced_draft.lookup_mode() == "all"
    monkeypatch.delenv(forced_draft.ENV_LOOKUP)
    assert forced_draft.lookup_mode() == "all"   # the default: every row, with a grammar or not


def _one_row_spec():
    """SGLang's verify input for one row: 0 (e) ─ 1 (a) ─ 2 (b), the top-1 path ending at b."""
    from types import SimpleNamespace

    toks, pos, mask, first, sibling = layout(Tree((-1, 0, 1)), [ID["e"], ID["a"], ID["b"]], 3)
    return SimpleNamespace(draft_token=toks.flatten(), positions=pos.flatten(), custom_mask=mask.flatten(),
                           retrieve_index=torch.arange(3).view(1, 3), retrieve_next_token=first[None],
                           retrieve_next_sibling=sibling[None], draft_token_num=3, spec_steps=2, num_tokens_per_req=3,
                           num_tokens_for_logprob_per_req=3, prepared_out_cache_loc=None, kv_loc_plan=None)
