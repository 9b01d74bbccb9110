"""Structured generation through xgrammar on the bundled model."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.engine.sampling import SamplingParams
from entmtp_sglang.grammar import GrammarError, GrammarSpec, RequestGrammar, compile_grammar
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tasks import load_prompts, load_schema
from entmtp_sglang.tree import Tree, from_sglang

VOCAB = 4096
TREE = from_sglang(3, 5, 16)


def _compiled(kind: str, source: str = ""):
    return compile_grammar(GrammarSpec(kind, source), str(BUNDLED_MODEL), VOCAB)


def usable_schemas(limit: int) -> list[tuple[dict, dict]]:
    """Held-out (test split) schemas that xgrammar compiles, with their prompts."""
    out = []
    for item in load_prompts("json", "test"):
        schema = load_schema(item)
        try:
            _compiled("json_schema", json.dumps(schema))
        except GrammarError:
            continue
        out.append((item, schema))
        if len(out) >= limit:
            break
    return out


@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object or a boolean"),
    ("regex", "a[", "Unclosed '['"),
    ("ebnf", "root ::= missing", 'Rule "missing" is not defined'),
    ("regex", "", "empty regex"),
])
def test_bad_grammars_fail_before_generation(kind, source, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        _compiled(kind, source)


def _check_schemas(bundle, schemas, max_new: int):
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    for item, schema in schemas:
        compiled = _compiled("json_schema", json.dumps(schema))
        prompt = bundle.tokenizer.encode(item["prompt"]).ids
        ref = generate_plain(bundle.target, prompt, max_new, eos_token_id=bundle.eos_token_id,
                             grammar=RequestGrammar(compiled, VOCAB))
        out = engine.generate([prompt], max_new, static_chooser(TREE),
                              grammars=[RequestGrammar(compiled, VOCAB)])[0]
        assert out.output_ids == ref, item["id"]
        if out.finish_reason == "grammar_complete":  # complete documents must parse and validate
            assert out.output_ids[-1] == bundle.eos_token_id
            text = bundle.tokenizer.decode(out.output_ids[:-1])
            jsonschema.validate(json.loads(text), schema)
        else:
            assert out.finish_reason == "length: grammar incomplete", out.finish_reason


def test_schema_output_equals_constrained_plain_and_validates(bundled):
    _check_schemas(bundled["hydra"], usable_schemas(4), 96)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_thirty_real_schemas(bundled, kind):
    schemas = usable_schemas(32)
    assert len(schemas) >= 30
    _check_schemas(bundled[kind], schemas, 160)


def test_regex_and_ebnf_constraints(bundled):
    b = bundled["medusa"]
    engine = Engine(b.target, "medusa", b.drafter, b.eos_token_id)
    prompt = b.tokenizer.encode("User: What is 6 times 7?\nAssistant: ").ids
    out = engine.generate([prompt], 40, static_chooser(Tree.chain(4)),
                          grammars=[RequestGrammar(_compiled("regex", r"The answer is [0-9]{1,3}\."), VOCAB)])[0]
    text = b.tokenizer.decode([t for t in out.output_ids if t != b.eos_token_id])
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text
    ebnf = 'root ::= "yes" | "no"'
    out = engine.generate([prompt], 10, static_chooser(Tree.chain(2)),
                          grammars=[RequestGrammar(_compiled("ebnf", ebnf), VOCAB)])[0]
    assert b.tokenizer.decode([t for t in out.output_ids if t != b.eos_token_id]) in ("yes", "no")
    assert out.finish_reason == "grammar_complete" and out.output_ids[-1] == b.eos_token_id


def test_grammar_drafting_prunes_illegal_drafts_and_lowers_entropy(bundled):
    b = bundled["hydra"]
    engine = Engine(b.target, "hydra", b.drafter, b.eos_token_id)
    item, schema = usable_schemas(1)[0]
    compiled = _compiled("json_schema", json.dumps(schema))
    prompt = b.tokenizer.encode(item["prompt"]).ids
    runs = {}
    for drafting in (False, True):
        runs[drafting] = engine.generate([prompt], 64, static_chooser(TREE),
                                         grammars=[RequestGrammar(compiled, VOCAB)], grammar_drafting=drafting)[0]
    assert runs[True].output_ids == runs[False].output_ids
    masked = [s.draft_entropy for s in runs[True].steps]
    assert sum(masked) / len(masked) <= sum(s.draft_entropy for s in runs[False].steps) / len(runs[False].steps)
    assert any(s.num_nodes < TREE.num_nodes for s in runs[True].steps)  # illegal branches were pruned


# ---- how a constrained request ends: dead end, complete, out of length (real xgrammar, random model) ----
# A vocabulary that spells single letters a..y and digits but no "z": a grammar that needs a "z" reaches
# a real dead end (xgrammar allows no token there), with no mocks involved.
TINY_VOCAB = ["</s>", *"abcdefghijklmnopqrstuvwxy", *"0123456789"]
TINY_VOCAB += [""] * (97 - len(TINY_VOCAB))  # empty strings: special tokens xgrammar never allows as text
TINY_STOP = 0


def _tiny_grammar(ebnf: str) -> RequestGrammar:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(TINY_VOCAB, xgr.VocabType.RAW, vocab_size=97, stop_token_ids=[TINY_STOP])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(ebnf)
    return RequestGrammar(compiled, 97)


def _spell(ids: list[int]) -> str:
    return "".join(TINY_VOCAB[t] if t != TINY_STOP else "|" for t in ids)


DEAD_MIDWAY = 'root ::= "abcab" "z"'  # dead after five tokens: no token spells "z"
DEAD_AT_START = 'root ::= "z" [a-c]*'


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
@pytest.mark.parametrize("grammar_drafting", [True, False])
def test_grammar_dead_end_stops_cleanly_with_a_reason(random_models, kind, grammar_drafting):
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    ref_free = generate_plain(target, prompts[2], 20)
    ref_dead = generate_plain(target, prompts[0], 20, grammar=_tiny_grammar(DEAD_MIDWAY))
    assert _spell(ref_dead) == "abcab"
    assert generate_plain(target, prompts[1], 20, grammar=_tiny_grammar(DEAD_AT_START)) == []
    for tree in (Tree.chain(4), from_sglang(3, 4, 10)):
        grammars = [_tiny_grammar(DEAD_MIDWAY), _tiny_grammar(DEAD_AT_START), None]
        dead, start, free = engine.generate(prompts, 20, static_chooser(tree), grammars=grammars,
                                            grammar_drafting=grammar_drafting)
        assert dead.output_ids == ref_dead, tree.name
        assert dead.finish_kind == "grammar_dead_end"
        assert dead.finish_reason == "grammar_dead_end: no token of the vocabulary is allowed after generated " \
                                     f"token 5 (id {ref_dead[-1]})"
        assert start.output_ids == [] and start.steps == []
        assert start.finish_reason == "grammar_dead_end: no token of the vocabulary is allowed at the start"
        assert free.output_ids == ref_free and free.finish_reason == "length"  # the batch is unaffected
    if grammar_drafting:  # the drafts run into the dead end inside the tree: no bonus token after it
        assert dead.steps[-1].accepted == 4 and len(dead.steps) == 1


def test_grammar_dead_end_when_sampling(random_models):
    target, drafters = random_models
    engine = Engine(target, "medusa", drafters["medusa"])
    for drafting in (True, False):
        dead, free = engine.generate([[5, 6, 7], [10, 11]], 20, static_chooser(from_sglang(3, 4, 10)),
                                     SamplingParams(temperature=0.8), seed=1,
                                     grammars=[_tiny_grammar(DEAD_MIDWAY), None], grammar_drafting=drafting)
        assert _spell(dead.output_ids) == "abcab" and dead.finish_kind == "grammar_dead_end"
        assert len(free.output_ids) == 20 and free.finish_reason == "length"


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_grammar_complete_and_length_incomplete(random_models, kind):
    target, drafters = random_models
    engine = Engine(target, kind, drafters[kind])
    prompt = [5, 6, 7]
    for eos in (None, TINY_STOP):  # the stop token ends the grammar whether or not it is the engine's eos
        engine.eos = eos
        done = engine.generate([prompt], 20, static_chooser(Tree.chain(4)),
                               grammars=[_tiny_grammar('root ::= "abc"')])[0]
        assert _spell(done.output_ids) == "abc|" and done.finish_reason == "grammar_complete"
        assert done.output_ids == generate_plain(target, prompt, 20, grammar=_tiny_grammar('root ::= "abc"'))
    long = 'root ::= "abcabcabcabc"'
    cut = engine.generate([prompt, prompt], 5, static_chooser(Tree.chain(4)),
                          grammars=[_tiny_grammar(long), None])
    assert _spell(cut[0].output_ids) == "abcab" and cut[0].finish_reason == "length: grammar incomplete"
    assert cut[1].finish_reason == "length"
    assert cut[0].output_ids == generate_plain(target, prompt, 5, grammar=_tiny_grammar(long))


def test_cli_prints_the_finish_reason(tmp_path, capsys):
    from entmtp_sglang.cli import main

    assert main(["generate", "--model", str(BUNDLED_MODEL), "--prompt", "x = ", "--regex", "[a-z]{40}",
                 "--max-new-tokens", "3", "--tree", "chain:2"]) == 0
    assert "-- finish: length: grammar incomplete" in capsys.readouterr().out
    (tmp_path / "yn.ebnf").write_text('root ::= "yes" | "no"')
    assert main(["generate", "--model", str(BUNDLED_MODEL), "--prompt", "Is it? ", "--ebnf", str(tmp_path / "yn.ebnf"),
                 "--tree", "chain:2"]) == 0
    assert "-- finish: grammar_complete" in capsys.readouterr().out


def test_the_observer_sees_the_grammar_masked_draft(random_models):
    """A batch policy reads the drafter through the observer; under grammar drafting it must see the same
    masked distribution as each request's StepView (whose draft entropy is taken after the mask)."""
    from entmtp_sglang.policy.signals import entropy_nats

    target, drafters = random_models
    engine = Engine(target, "hydra", drafters["hydra"])
    seen: list[list[float]] = []
    res = engine.generate([[5, 6, 7], [8, 9]], 12, static_chooser(Tree.chain(2)),
                          observer=lambda state, lens, drafting, active: seen.append(
                              entropy_nats(state.root_logits).tolist()),
                          grammars=[_tiny_grammar('root ::= [a-c]+'), None])
    steps = res[0].steps
    assert len(steps) >= 2
    assert all(s.draft_entropy <= math.log(4) + 1e-5 for s in steps)  # a, b, c or the stop token
    assert [round(h[0], 4) for h in seen[:len(steps)]] == [round(s.draft_entropy, 4) for s in steps]
