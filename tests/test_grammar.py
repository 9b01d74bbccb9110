"""Structured generation through xgrammar on the bundled model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.plain import generate_plain
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
        if out.finish_reason == "eos":  # complete documents must parse and validate
            text = bundle.tokenizer.decode(out.output_ids[:-1])
            jsonschema.validate(json.loads(text), schema)
        else:
            assert out.finish_reason == "length", out.finish_reason


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
    assert out.finish_reason == "eos"


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
