"""Grammar-aware drafting and the grammar-lowered entropy inside SGLang, on SGLang's own grammar objects.

The grammars are real: SGLang's `XGrammarGrammarBackend` over the bundled model's tokenizer, dispatching a
held-out JSON schema and a regex exactly as the server does. (Named after test_kernels on purpose: SGLang
must not be imported before the Triton-interpreter kernel tests of the same process.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.testing import import_sglang_or_skip

from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tasks import load_prompts, load_schema

XGrammarGrammarBackend = import_sglang_or_skip("sglang.srt.constrained.xgrammar_backend").XGrammarGrammarBackend

from entmtp_sglang.sglang import grammar_draft  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend():
    from transformers import AutoTokenizer

    d = BUNDLED_MODEL
    tok = AutoTokenizer.from_pretrained(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return XGrammarGrammarBackend(tok, vocab_size=vocab, model_eos_token_ids=[tok.eos_token_id],
                                  any_whitespace=False), tok, vocab


def allowed_set(grammar, vocab):
    mask = grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
    grammar.fill_vocab_mask(mask, 0)
    return {t for t in range(vocab) if grammar_draft.token_allowed(mask[0], t)}


def json_grammar(backend):
    be, tok, vocab = backend
    item = next(it for it in load_prompts("json", "test") if it["id"] == "002873801e56")
    schema = load_schema(item)
    return be.dispatch_json(json.dumps(schema)), tok, vocab


def test_masked_signals_are_taken_over_the_allowed_tokens(backend):
    g, tok, vocab = json_grammar(backend)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(vocab, generator=gen) * 3
        ok = sorted(allowed_set(g, vocab))
        p = torch.softmax(logits[ok].double(), -1)
        expect = float(-(p * p.log()).sum())
        got = grammar_draft.grammar_signal(logits, g, vocab)
        assert got == pytest.approx(expect, rel=1e-4, abs=1e-5)
        assert got <= math.log(len(ok)) + 1e-6
        top = p.topk(min(2, len(ok))).values.tolist() + [0.0]
        margin = grammar_draft.grammar_signal(logits, g, vocab, "draft_margin")
        assert margin == pytest.approx(top[0] - top[1], rel=1e-4, abs=1e-5)


def test_grammar_topk_proposes_only_allowed_tokens_and_leaves_the_grammar_as_found(backend):
    g, tok, vocab = json_grammar(backend)
    gen = torch.Generator().manual_seed(1)
    before = allowed_set(g, vocab)
    # walk a few greedy-valid tokens as a draft path
    path = []
    for _ in range(4):
        top = grammar_draft.grammar_topk(torch.randn(vocab, generator=gen), g, path, 3, vocab)
        assert top is not None
        # every proposed child is allowed after the path: check on a fresh copy of the grammar
        probe = g.copy()
        for t in path:
            probe.accept_token(t)
        allowed = allowed_set(probe, vocab)
        assert len(allowed) > 0
        n_ok = min(3, len(allowed))
        assert set(top.tolist()[:n_ok]) <= allowed
        path.append(int(top[0]))
        assert allowed_set(g, vocab) == before, "grammar state changed by drafting"
        assert g.accepted_tokens == []


def test_an_invalid_path_gives_no_guidance_and_is_rolled_back(backend):
    g, tok, vocab = json_grammar(backend)
    before = allowed_set(g, vocab)
    first = min(before)
    probe = g.copy()
    probe.accept_token(first)
    bad = min(set(range(vocab)) - allowed_set(probe, vocab))
    assert grammar_draft.path_bitmask(g, [first, bad], vocab) is None
    assert grammar_draft.grammar_topk(torch.zeros(vocab), g, [first, bad], 2, vocab) is None
    assert allowed_set(g, vocab) == before and g.accepted_tokens == []


def test_regex_grammar_forces_digits(backend):
    be, tok, vocab = backend
    g = be.dispatch_regex(r"[0-9]{3}-[0-9]{2}")
    logits = torch.zeros(vocab)
    top = grammar_draft.grammar_topk(logits, g, [], 4, vocab)
    texts = [tok.decode([t]) for t in top.tolist()]
    assert all(s and s[0].isdigit() for s in texts), texts
    # a terminated grammar is not live: drafting leaves it alone
    class Req:
        grammar = g
    assert grammar_draft.live_grammar(Req()) is g
