"""Forced spans (jump-forward drafting): the grammar's decided text drafted without the drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.forced import ForcedSpanConfig, ForcedSpans, ForcedStats, extend_tree, path_tokens
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.engine.sampling import SamplingParams
from entmtp_sglang.forced_spans import HistoryLookup
from entmtp_sglang.grammar import GrammarSpec, RequestGrammar, compile_grammar
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tree import Tree, from_sglang

# a raw vocabulary: the stop token, single letters a..y, and a few longer spellings
VOCAB = ["</s>", *"abcdefghijklmnopqrstuvwxy", "gh", "ghi", "xy", "ab", "q\"", *"0123456789", " ", " c", " 7"]
VOCAB += [""] * (97 - len(VOCAB))  # empty strings: special tokens xgrammar never allows as text (97: the
# random test model's vocabulary)
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


def test_trailing_whitespace_is_left_to_the_next_token():
    g = grammar('root ::= "ab " [0-9] " c"')
    assert [VOCAB[t] for t in g.forced_span([], spell, 16)] == ["ab"]  # not "ab", " ": the model writes " 7"
    assert g.forced_span([ID["ab"]], spell, 16) == []  # " " alone: it goes with what follows
    assert [VOCAB[t] for t in g.forced_span([ID["ab"], ID[" 7"]], spell, 16)] == [" c", "</s>"]


def test_nothing_forced_where_every_state_has_a_choice():
    g = grammar("root ::= [a-c]+")
    assert g.forced_span([], spell, 16) == []
    assert g.forced_span([ID["a"], ID["b"]], spell, 16) == []


def test_history_lookup_guesses_the_token_after_the_latest_earlier_occurrence():
    h = HistoryLookup(min_n=2, max_n=3)
    h.sync([5, 1, 2, 3, 9, 1, 2, 4], [])
    assert h([]) is None                        # (2, 4) never occurred before; nor did (1, 2, 4)
    assert h([1, 2]) == 4                       # (1, 2) last occurred before 4, not 3: the latest wins
    assert h([3, 9]) == 1
    assert h([7]) is None
    h.sync([5, 1, 2, 3, 9, 1, 2, 4], [5, 1])    # the output grows: indexed where it ended
    assert h([]) == 2 and h([2]) == 3           # (5, 1) -> 2; (5, 1, 2) -> 3: the longest match first
    h.sync([5, 1], [2])                         # another prompt: rebuilt
    assert h.tokens == [5, 1, 2] and h([]) is None and h([5, 1]) == 2
    h.sync([5, 1], [3, 5])                      # an output that is not the indexed one grown: rebuilt
    assert h.tokens == [5, 1, 3, 5] and h([]) is None and h([1]) == 3
    with pytest.raises(ValueError, match="min_n <= max_n"):
        HistoryLookup(min_n=3, max_n=2)


def test_a_span_goes_on_with_the_requests_own_repeats_where_the_grammar_decides_nothing():
    """`jump_forward_span` with a lookup: the grammar's text first, then where it decides nothing the request's
    history repeating, as far as the grammar allows it; the matcher left as found."""
    from entmtp_sglang.grammar import jump_forward_span

    g = grammar('root ::= ("a" [b-d] "e")+ "."')
    h = HistoryLookup(min_n=2, max_n=4)
    h.sync([ID[c] for c in "abeace"], [])      # the history: abe ace
    plain = jump_forward_span(g.matcher, [ID["a"], ID["b"]], spell, 16, len(VOCAB))
    assert letters(plain) == "e"                # the grammar alone: e, then a or "." is the model's choice
    more = jump_forward_span(g.matcher, [ID["a"], ID["b"]], spell, 16, len(VOCAB), h)
    assert letters(more) == "eace"              # e (forced), then the repeat of "ace": a, c (guessed), e (forced)
    h = HistoryLookup(min_n=2, max_n=4)
    h.sync([ID[c] for c in "abeaxe"], [])       # a repeat the grammar refuses (x) is cut there
    assert letters(jump_forward_span(g.matcher, [ID["a"], ID["b"]], spell, 16, len(VOCAB), h)) == "ea"
    assert letters(jump_forward_span(g.matcher, [ID["a"], ID["b"]], spell, 1, len(VOCAB), h)) == "e"  # the cap
    assert letters(jump_forward_span(g.matcher, [], spell, 16, len(VOCAB))) == "a"   # as found


def test_a_span_ends_in_the_token_the_model_writes_there_joined_to_what_follows():
    """`SpanEnds`: where the grammar decides nothing after a spelled text's last token (`x`: a space or `y` may
    follow), the span ends in a token the grammar allows there that goes on from it (`xy`), the one the request wrote
    most, else the one emitted more often than the spelled token over all requests; never one the grammar refuses,
    and nothing changes where the grammar decides more after the last token. The matcher is left as found."""
    from entmtp_sglang.forced_spans import SpanEnds
    from entmtp_sglang.grammar import jump_forward_span

    ends = SpanEnds(VOCAB)
    assert [VOCAB[u] for u in ends.extensions(ID["x"])] == ["xy"] and ends.extensions(ID["7"]) == ()

    def span(g, join, path=()):
        return [VOCAB[t] for t in jump_forward_span(g.matcher, list(path), spell, 16, len(VOCAB), join=join)]

    g = grammar('root ::= ("gh" "x" " "? "y" [0-9])+')
    first = ends.request()
    first.sync([])
    assert span(g, None) == ["gh", "x"] and span(g, first) == ["gh", "x"]   # nothing written yet: as spelled
    wrote = [ID["gh"], ID["xy"], ID["7"]]
    first.sync(wrote)                                                      # the request wrote xy once
    assert span(g, first) == ["gh", "xy"] and span(g, None) == ["gh", "x"]   # (then a digit: the model's choice)
    assert span(g, first, wrote) == []                                     # after it: gh again or the end
    other = ends.request()
    other.sync([])                                                         # a new request: what all emitted
    assert span(g, other) == ["gh", "xy"]
    other.sync([ID["gh"], ID["x"], ID[" "]])                               # it wrote x alone, xy never: over all
    assert span(g, other) == ["gh", "x"]                                   # xy no more often than x: as spelled
    assert span(grammar('root ::= "ghx" " " [0-9]'), first) == ["gh", "x"]     # only a space may follow x
    assert span(grammar('root ::= "ghxy" [0-9]'), first) == ["gh", "xy"]       # y decided: spelled xy anyway
    assert span(g, None) == ["gh", "x"]                                    # the matcher as found


def test_span_ends_extensions_equal_a_scan_of_the_whole_vocabulary():
    """`SpanEnds.extensions` bisects the sorted pieces: on the bundled tokenizer's whole vocabulary (byte-level
    pieces, duplicates and empty strings included) it gives exactly the tokens a scan finds, in id order."""
    import random

    from tokenizers import Tokenizer

    from entmtp_sglang.forced_spans import SpanEnds

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    pieces = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())] + ["ab", "", "a"]
    ends = SpanEnds(pieces)
    rng = random.Random(0)
    for u in [*rng.sample(range(len(pieces)), 300), *range(len(pieces) - 3, len(pieces))]:
        head = pieces[u]
        scan = tuple(v for v, p in enumerate(pieces) if head and len(p) > len(head) and p.startswith(head))
        assert ends.extensions(u) == scan, head


def test_the_only_legal_token_read_off_the_packed_mask_equals_the_unpacked_one():
    """`_only_legal` (one nonzero word with one bit) against unpacking the whole bitmask, on random masks with
    none, one or several bits, bit 31 and bits past the vocabulary included."""
    import random

    from entmtp_sglang.grammar import _bool_mask, _only_legal

    rng = random.Random(37)
    for _ in range(3000):
        vocab = rng.choice([31, 33, 64, 97, 49152])
        words = (vocab + 31) // 32 + rng.choice([0, 0, 1])
        packed = [0] * words
        for _ in range(rng.choice([0, 1, 1, 1, 2, 5])):
            t = rng.randrange(words * 32)
            packed[t // 32] |= 1 << (t % 32)
        bm = torch.tensor([[(x + 2 ** 31) % 2 ** 32 - 2 ** 31 for x in packed]], dtype=torch.int32)
        legal = _bool_mask(bm, vocab)[0].nonzero().flatten()
        assert _only_legal(bm, vocab) == (int(legal[0]) if legal.numel() == 1 else None)

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


# ---- in the engine ----------------------------------------------------------------------------------------
# The bundled model spells JSON mostly a character at a time where its tokenizer has whole words: the const
# value's span ("person record"}) is rejected after its first token, the keys' spans are accepted.
RECORD = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "kind": {"const": "person record"}},
          "required": ["name", "age", "kind"]}
BUNDLED_VOCAB = 4096


def _bundled_grammar(kind: str, source: str) -> RequestGrammar:
    return RequestGrammar(compile_grammar(GrammarSpec(kind, source), str(BUNDLED_MODEL), BUNDLED_VOCAB),
                          BUNDLED_VOCAB)


BUNDLED_CASES = [  # (kind, source, prompt): forced text at the start, in the middle and at the end
    ("json_schema", json.dumps(RECORD), "User: give a record\nAssistant: "),
    ("regex", r"The answer is [0-9]{1,3}\. Done\.", "User: What is 6 times 7?\nAssistant: "),
    ("ebnf", 'root ::= "Answer: " ("yes" | "no") ", final answer."', "User: Is it? Say yes or no.\nAssistant: "),
]


def _caught_up(seen: list):
    """An observer that checks the EAGLE draft cache holds every committed position (slot j is position j + 1)."""
    def observe(state, lens, drafting, active):
        if hasattr(drafting, "lens") and drafting.lens is not None:
            rows = [i for i, a in enumerate(active) if a]
            assert drafting.lens[rows].tolist() == (lens[rows] - 1).tolist()
            seen.append(len(rows))
    return observe


@pytest.mark.parametrize("kind, tree", [("medusa", Tree.chain(2)), ("hydra", from_sglang(3, 3, 8)),
                                        ("eagle", from_sglang(2, 3, 6))])
def test_greedy_equals_plain_with_forced_spans(bundled, kind, tree):
    b = bundled[kind]
    engine = Engine(b.target, kind, b.drafter, b.eos_token_id)
    forced = ForcedSpans.for_tokenizer(b.tokenizer)
    total, only = ForcedStats(), 0
    for gkind, source, text in BUNDLED_CASES:
        prompt = b.tokenizer.encode(text).ids
        ref = generate_plain(b.target, prompt, 80, eos_token_id=b.eos_token_id, grammar=_bundled_grammar(gkind, source))
        seen: list = []
        out = engine.generate([prompt], 80, static_chooser(tree), grammars=[_bundled_grammar(gkind, source)],
                              forced_spans=forced, observer=_caught_up(seen))[0]
        assert out.output_ids == ref, gkind
        assert out.finish_reason == "grammar_complete"  # the last span ends the output (its stop token)
        assert out.forced.spans > 0 and out.forced.accepted > 0 and out.forced.output_tokens > 0
        assert any(s.forced_nodes for s in out.steps) and len(out.steps) < len(ref)
        assert kind != "eagle" or seen  # the draft cache was checked at every drafted step
        only += sum(s.forced_only for s in out.steps)
        total.add(out.forced)
    assert total.tried > total.accepted  # some spans were spelled otherwise by the model: rejected part-way
    assert only > 0  # some steps verified a span alone, without the drafter


def test_the_record_schema_spans_start_middle_end_and_one_is_rejected_part_way(bundled):
    b = bundled["hydra"]
    engine = Engine(b.target, "hydra", b.drafter, b.eos_token_id)
    forced = ForcedSpans.for_tokenizer(b.tokenizer)
    prompt = b.tokenizer.encode(BUNDLED_CASES[0][2]).ids
    out = engine.generate([prompt], 80, static_chooser(Tree.chain(1)),
                          grammars=[_bundled_grammar(*BUNDLED_CASES[0][:2])], forced_spans=forced)[0]
    text = [b.tokenizer.decode([t]) for t in out.output_ids]
    assert "".join(text[:-1]).startswith('{"name": "') and "".join(text[:-1]).endswith('"kind": "person record"}')
    # the first step verifies `"name": "` after the prefill's "{" alone (forced_only): all accepted
    first = out.steps[0]
    assert first.forced_only and first.forced_accepted == first.forced_nodes == 4
    # "person record"} is spelled p|erson| record|"} by the tokenizer and p|e|r|s|o|n... by the model
    assert any(s.forced_nodes > s.forced_accepted for s in out.steps)


def test_a_batch_mixing_grammars_and_free_requests(bundled):
    b = bundled["eagle"]
    engine = Engine(b.target, "eagle", b.drafter, b.eos_token_id)
    forced = ForcedSpans.for_tokenizer(b.tokenizer)
    prompts = [b.tokenizer.encode(t).ids for _, _, t in BUNDLED_CASES] + [b.tokenizer.encode("def add(a, b):").ids]
    refs = [generate_plain(b.target, p, 60, eos_token_id=b.eos_token_id,
                           grammar=_bundled_grammar(k, s) if k else None)
            for p, (k, s) in zip(prompts, [c[:2] for c in BUNDLED_CASES] + [(None, None)])]
    seen: list = []
    outs = engine.generate(prompts, 60, static_chooser(from_sglang(2, 3, 6)),
                           grammars=[_bundled_grammar(k, s) for k, s, _ in BUNDLED_CASES] + [None],
                           forced_spans=forced, observer=_caught_up(seen))
    assert [o.output_ids for o in outs] == refs
    assert all(o.forced.accepted > 0 for o in outs[:3])
    assert max(seen) == 4


# ---- random model, raw vocabulary ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_span_that_ends_the_output(random_models, kind):
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    ebnf = 'root ::= [a-c] "defg"'
    ref = generate_plain(target, [5, 6, 7], 20, grammar=grammar(ebnf))
    out = engine.generate([[5, 6, 7]], 20, static_chooser(Tree.chain(2)), grammars=[grammar(ebnf)],
                          forced_spans=ForcedSpans(spell))[0]
    assert out.output_ids == ref and letters(ref)[1:] == "defg|"
    assert out.finish_reason == "grammar_complete"
    # one step: the root (the first letter) and its span d e f g </s>, drafted without the drafter
    assert len(out.steps) == 1 and out.steps[0].forced_only and out.steps[0].forced_accepted == 5
    assert out.forced.output_tokens == 5 and out.forced.share(len(out.output_ids)) == 5 / 6


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_a_grammar_that_forces_nothing_behaves_as_today(random_models, kind):
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    prompts = [[5, 6, 7], [8, 9]]
    runs = {}
    for spans in (None, ForcedSpans(spell, ForcedSpanConfig(lookup=False))):   # (repeats: the next test)
        runs[spans is None] = engine.generate(prompts, 16, static_chooser(from_sglang(3, 3, 8)),
                                              grammars=[grammar("root ::= [a-c]+"), None], forced_spans=spans)
    for today, now in zip(runs[True], runs[False]):
        assert now.output_ids == today.output_ids
        assert [(s.tree, s.num_nodes, s.accepted) for s in now.steps] == \
               [(s.tree, s.num_nodes, s.accepted) for s in today.steps]
        assert now.forced.spans == 0


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_where_the_grammar_decides_nothing_lookup_spans_repeat_the_requests_own_text(random_models, kind):
    """`[a-c]+` decides no token, but 24 letters of three repeat some pair (9 pairs, 23 places): with lookup spans
    (the default) the engine drafts the letter that followed the pair's latest earlier occurrence, verified like any
    draft; the output stays plain decoding's. Without them nothing is drafted beyond the drafter's tree."""
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    ebnf = "root ::= [a-c]+"
    ref = generate_plain(target, [5, 6, 7], 24, grammar=grammar(ebnf))
    runs = {}
    for lookup in (True, False):
        spans = ForcedSpans(spell, ForcedSpanConfig(lookup=lookup))
        out = engine.generate([[5, 6, 7]], 24, static_chooser(Tree.chain(1)), grammars=[grammar(ebnf)],
                              forced_spans=spans)[0]
        assert out.output_ids == ref
        runs[lookup] = out
    assert runs[True].forced.spans > 0 and runs[True].forced.tried > 0, runs[True].forced
    assert runs[False].forced.spans == 0
    print(kind, "lookup spans:", runs[True].forced.to_json(len(ref)))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_requests_without_a_grammar_take_their_own_repeats_as_spans(random_models, kind):
    """With forced spans on, a request without a grammar drafts its own text repeating below its tree's leaves (and
    after its root on a step the policy rests the drafter), as ENTMTP does inside SGLang: in a batch beside a
    constrained request, every output stays plain decoding's; without lookup spans the free requests get none."""
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    prompts = [[40], [5, 6, 7, 5, 6, 7, 5, 6], [8, 9]]   # the first output repeats one token 19 times, then another
    grammars = lambda: [None, None, grammar("root ::= [a-c]+")]  # noqa: E731
    refs = [generate_plain(target, p, 24, grammar=g) for p, g in zip(prompts, grammars())]
    runs = {}
    for lookup in (True, False):
        outs = engine.generate(prompts, 24, static_chooser(Tree.chain(1)), grammars=grammars(),
                               forced_spans=ForcedSpans(spell, ForcedSpanConfig(lookup=lookup)))
        assert [o.output_ids for o in outs] == refs, lookup
        runs[lookup] = outs
    free = ForcedStats()
    for o in runs[True][:2]:
        free.add(o.forced)
    assert free.spans > 0 and free.tried > 0 and free.accepted > 0, free
    assert all(o.forced.spans == 0 for o in runs[False][:2])
    rested = engine.generate(prompts[:1], 24, _Resting(), forced_spans=ForcedSpans(spell))[0]   # plain steps
    assert rested.output_ids == refs[0]
    assert all(s.rested for s in rested.steps) and rested.forced.accepted > 0


class _Resting:
    """A chooser that rests the drafter on every step (plain steps: each root verified with its span alone)."""

    def __call__(self, view):
        return Tree.chain(0)

    def rests(self, active):
        return True


def _exact_sequences(target, prompt: list[int], ebnf: str, max_len: int) -> dict[tuple, float]:
    """The distribution of whole outputs under plain sampling (temperature 1): the target's distribution masked
    by the grammar at each step, enumerated."""
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], p: float):
        g = grammar(ebnf)
        g.advance(prefix)
        if g.terminated or len(prefix) >= max_len:
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + p
            return
        ids = torch.tensor([prompt + prefix])
        n = ids.shape[1]
        cache = target.new_cache(1, n + 1)
        hidden = target(ids, torch.arange(n).view(1, n), torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n),
                        cache, torch.zeros(1, dtype=torch.int64))
        logits = target.logits(hidden[0, -1]).masked_fill(~g.root_mask(), float("-inf"))
        probs = torch.softmax(logits.double(), -1)
        for t in probs.nonzero().flatten().tolist():
            walk(prefix + [t], p * float(probs[t]))

    with torch.no_grad():
        walk([], 1.0)
    return out


def test_sampling_keeps_the_masked_target_distribution(random_models):
    """Sampled outputs under a grammar with forced spans (several spellings: a|b or ab, g|h|i, gh|i or ghi)
    against the exact distribution of plain sampling (the target masked by the grammar at each step):
    chi-square over whole output sequences, fixed seed."""
    target, drafters = random_models
    ebnf = 'root ::= "ab" [d-e] "ghi"'
    prompt = [5, 6, 7]
    exact = _exact_sequences(target, prompt, ebnf, 12)
    assert len(exact) >= 8 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)
    n = 600
    engine = Engine(target, "hydra", drafters["hydra"])
    forced = ForcedSpans(spell)
    outs = engine.generate([prompt] * n, 12, static_chooser(Tree.chain(2)), SamplingParams(temperature=1.0),
                           seed=3, grammars=[grammar(ebnf) for _ in range(n)], forced_spans=forced)
    assert sum(o.forced.spans for o in outs) > n and sum(o.forced.accepted for o in outs) > 0
    counts: dict[tuple, int] = {}
    for o in outs:
        counts[tuple(o.output_ids)] = counts.get(tuple(o.output_ids), 0) + 1
    assert set(counts) <= set(exact)
    # cells with an expected count under 5 are pooled
    big = [s for s, p in exact.items() if p * n >= 5]
    cells = [(counts.get(s, 0), exact[s] * n) for s in big]
    rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
    if rest[1] > 0:
        cells.append(rest)
    # the tokenizer's spelling of "ghi" is one of three the target samples: a sampler that took spans as given
    # (or never took them) would fail
    assert 0.1 < sum(p for s, p in exact.items() if ID["ghi"] in s) < 0.9
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    assert dof >= 4
    assert p_value > 1e-3, (chi2, dof, cells)


def test_leaves_the_drafter_expects_to_reach_come_first():
    #   0 ─ 1 ─ 3      node draft probs: 1: 0.2, 2: 0.8, 3: 0.5, 4: 0.9 -> reach 3: 0.1, 4: 0.72
    #    └─ 2 ─ 4
    g = grammar('root ::= [a-b] [a-b] "cdefghijk"')
    tree = Tree((-1, 0, 0, 1, 2))
    toks = [ID["x"], ID["a"], ID["b"], ID["a"], ID["b"]]
    lp = [0.0, math.log(0.2), math.log(0.8), math.log(0.5), math.log(0.9)]
    fs = ForcedSpans(spell, ForcedSpanConfig(max_tokens=4, max_nodes=6, min_reach=0.0))
    ext = fs.extend(tree, toks, g, room=20, logprobs=lp)
    assert [(s.leaf, letters(s.tokens)) for s in ext.spans] == [(3, "cd"), (4, "cdef")]  # 4 first: budget
    ext = ForcedSpans(spell, ForcedSpanConfig(min_reach=0.2)).extend(tree, toks, g, room=20, logprobs=lp)
    assert [s.leaf for s in ext.spans] == [4]  # leaf 3 (reach 0.1) is left alone
    assert [s.leaf for s in fs.extend(tree, toks, g, room=20).spans] == [3, 4]  # node order without log-probs
