"""Forced spans inside SGLang (issue 37, item 3), through real CPU servers of the bundled model: below the leaves of a
constrained request's tree the worker hangs the text its grammar decides (sglang/forced_draft.py), verified by the
target like any draft. Greedy output stays plain SGLang's token for token under a JSON schema, a regex and an EBNF
grammar, at batch 1 and in a mixed batch (constrained and unconstrained requests together), while `meta_info`
shows forced tokens drafted and accepted; a span the model spells otherwise is rejected part-way and the output is
still plain's; a grammar that forces nothing gets no span.

SGLang is imported only when the servers start (not at collection)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
from helpers.testing import import_sglang_or_skip, plain_and_entmtp, started

pytestmark = pytest.mark.sglang
F32 = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")
GREEDY = {"temperature": 0, "max_new_tokens": 40}
EBNF = 'root ::= "Answer: " ("yes" | "no") ", and the reason is that " [a-z ]{1,24} "."'
REGEX = r'\{"city": "(Lisbon|Osaka|Paris)", "population_millions": [0-9]{1,2}, "country": "[A-Za-z]{2,12}"\}'


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    import_sglang_or_skip()
    tmp = tmp_path_factory.mktemp("forced")
    # ENTMTP_CROSS_SPANS: lookup spans also from what earlier requests wrote (the last test here)
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_TRACE": str(tmp / "trace"), "ENTMTP_ONLINE_COSTS": "0",
                                             "ENTMTP_CROSS_SPANS": "1"})
    with started(plain, ent):
        yield plain, ent


def _schema_job() -> dict:
    from entmtp_sglang.tasks import load_prompts, load_schema

    item = next(it for it in load_prompts("json", "test") if it["id"] == "002873801e56")
    return {"text": item["prompt"], "sampling_params": {**GREEDY, "json_schema": json.dumps(load_schema(item))}}


def _jobs() -> dict[str, dict]:
    ask = "User: {q}\nAssistant: "
    return {"json_schema": _schema_job(),
            "regex": {"text": ask.format(q="Give the city, its population and country as JSON."),
                      "sampling_params": {**GREEDY, "regex": REGEX}},
            "ebnf": {"text": ask.format(q="Is the sky blue? Answer and say why."),
                     "sampling_params": {**GREEDY, "ebnf": EBNF}}}


def _forced(out) -> tuple[int, int]:
    """(forced tokens verified, accepted) over a request's steps."""
    steps = out["meta_info"].get("entmtp_forced") or []
    return sum(s[0] for s in steps), sum(s[1] for s in steps)


def _equal(plain, outs, jobs):
    reference = [plain.post("/generate", j)["output_ids"] for j in jobs]
    wrong = [k for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, [(k, outs[k]["output_ids"], reference[k]) for k in wrong]
    return reference


def test_forced_spans_are_announced_at_start_up(servers):
    _, ent = servers
    assert "forced spans on" in ent.log_text(), ent.log_tail()


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_batch_1_equals_plain_and_takes_the_grammars_text_from_forced_spans(servers, kind):
    plain, ent = servers
    job = _jobs()[kind]
    out = ent.post("/generate", job)
    _equal(plain, [out], [job])
    verified, accepted = _forced(out)
    drafted = sum(out["meta_info"]["entmtp_accepted"])
    print(f"{kind}: {len(out['output_ids'])} tokens, {drafted} drafts accepted, forced {accepted} of {verified} "
          f"verified accepted")
    assert accepted > 0 and verified >= accepted, out["meta_info"]
    assert drafted >= accepted


def test_a_mixed_batch_equals_plain_with_forced_spans_on_its_constrained_rows(servers):
    from test_sglang_per_row import mixed_jobs  # (imports SGLang: only once the servers run)

    plain, ent = servers
    jobs = mixed_jobs(0) + [_jobs()["ebnf"]]   # JSON schema, tool call, code, chat, EBNF
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: ent.post("/generate", j), jobs))
    _equal(plain, outs, jobs)
    counts = [_forced(o) for o in outs]
    print("forced (verified, accepted) per request:", counts)
    assert all(a > 0 for _, a in (counts[0], counts[1], counts[4])), counts
    assert counts[2] == counts[3] == (0, 0), counts   # unconstrained rows: no spans
    assert "Traceback" not in ent.log_text(), ent.log_tail()


def test_a_span_the_model_spells_otherwise_is_rejected_part_way_and_the_output_is_still_plain(servers):
    plain, ent = servers
    # "Supercalifragilistic" is forced text; the tokenizer spells it one way, the model under the grammar's mask
    # (any tokens that spell the text are legal) may take another: such a span is cut where the spelling differs
    text = "Supercalifragilisticexpialidocious"
    job = {"text": "User: Say a long word.\nAssistant: ",
           "sampling_params": {**GREEDY, "ebnf": f'root ::= "{text}, " [a-z]{{1,8}} "!"'}}
    out = ent.post("/generate", job)
    _equal(plain, [out], [job])
    steps = out["meta_info"].get("entmtp_forced") or []
    print("forced (verified, accepted) per step:", steps)
    assert any(0 < a < v for v, a in steps), steps   # a span entered and cut where the spellings part


def test_a_grammar_that_forces_nothing_gets_no_span_and_equals_plain(servers):
    """No token of the grammar's (its length limit out of reach: at 60 characters `[a-z ]{1,60}` forces the stop
    token); the model's own repeats may still come as lookup spans (`entmtp_lookup`, counted apart)."""
    plain, ent = servers
    job = {"text": "User: Write some lowercase words.\nAssistant: ",
           "sampling_params": {**GREEDY, "max_new_tokens": 24, "regex": "[a-z ]{1,400}"}}
    out = ent.post("/generate", job)
    _equal(plain, [out], [job])
    assert _forced(out) == (0, 0), out["meta_info"].get("entmtp_forced")
    print("lookup (verified, accepted) per step:", out["meta_info"].get("entmtp_lookup"))


def test_a_span_that_completes_the_grammar_ends_the_output(servers):
    """After the first word everything is the grammar's, to its end: the output finishes inside a forced span (the
    grammar complete, the request stopped by it, not by max_new_tokens), equal to plain's, at batch 1 and beside an
    unconstrained request."""
    plain, ent = servers
    ask = "User: Is the sky blue?\nAssistant: "
    job = {"text": ask, "sampling_params": {**GREEDY, "ebnf": 'root ::= ("yes" | "no") ", the sky is blue today."'}}
    free = {"text": ask, "sampling_params": {**GREEDY, "max_new_tokens": 16}}
    for jobs in ([job], [job, free]):
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda j: ent.post("/generate", j), jobs))
        _equal(plain, outs, jobs)
        out = outs[0]
        assert out["text"].endswith("the sky is blue today."), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
        verified, accepted = _forced(out)
        assert accepted > 0 and len(out["output_ids"]) < GREEDY["max_new_tokens"], (verified, accepted, out)


def test_a_resting_step_still_verifies_the_spans_below_its_roots(servers):
    """Where the policy rests the drafter (chain:0: no draft levels), a constrained row still takes its span below
    the root (the grammar's text, its repeats), verified as a chain; the positions it accepts are owed to the
    drafter and caught up when it drafts again. The output stays plain's."""
    plain, ent = servers
    jobs = list(_jobs().values())
    ent.flush_cache()   # what the tests before wrote out of the shared index (ENTMTP_CROSS_SPANS)
    outs = [ent.post("/generate", j) for j in jobs]
    _equal(plain, outs, jobs)
    rested = [n for o in outs for name, n in zip(o["meta_info"]["entmtp_trees"], o["meta_info"]["entmtp_accepted"])
              if name in ("rest", "chain:0")]
    print("drafts accepted on resting steps:", rested)
    assert any(n > 0 for n in rested), rested


def _lookup(out) -> tuple[int, int]:
    """(lookup-span tokens verified, accepted) over a request's steps."""
    steps = out["meta_info"].get("entmtp_lookup") or []
    return sum(st[0] for st in steps), sum(st[1] for st in steps)


def test_a_second_request_drafts_what_the_first_wrote_as_spans_and_equals_plain(servers):
    """ENTMTP_CROSS_SPANS=1: the first request's output, indexed when it finished, is drafted as lookup spans for a
    second request that writes it again (its own history has only the prompt); after flush_cache (the index emptied
    with the radix cache) a third writes it without them. Every output equals plain's."""
    plain, ent = servers
    job = {"text": "User: Tell me a short story about a robot who learns to paint.\nAssistant: ",
           "sampling_params": {**GREEDY, "max_new_tokens": 48}}
    ent.flush_cache()
    first = ent.post("/generate", job)
    second = ent.post("/generate", job)
    ent.flush_cache()
    third = ent.post("/generate", job)
    _equal(plain, [first, second, third], [job, job, job])
    (_, a1), (_, a2), (_, a3) = _lookup(first), _lookup(second), _lookup(third)
    n = len(second["output_ids"])
    assert a2 >= n // 2 and a2 > a1 and a2 > a3, (_lookup(first), _lookup(second), _lookup(third), n)
    census = ent.server_info().get("entmtp_requests") or {}
    assert census.get("shared_ngrams", 0) > 0, census   # the third request's output, indexed

