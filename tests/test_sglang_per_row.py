"""Each request its own tree inside SGLang's batch (issue 36, items 1 and 5), through real CPU servers of the
bundled model: a mixed batch of four (and, marked slow, eight) at once (JSON under a schema, a tool call under its
schema, code, chat) gives plain decoding's greedy output token for token, while the tree trace shows requests of
one step drafting different trees (of the node count the step shares) and `meta_info.entmtp_trees` each
request's own."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
from helpers.testing import import_sglang_or_skip, plain_and_entmtp, started

from entmtp_sglang.tasks import load_prompts, load_schema

import_sglang_or_skip()

pytestmark = pytest.mark.sglang
F32 = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")
MAX_NEW = 40
TOOL = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
    "name": {"enum": ["get_weather", "search_flights"]},
    "arguments": {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}


SCHEMAS = ("002873801e56", "0301d17f3a24")   # held-out schemas SGLang's xgrammar serves (test_sglang_server)
CITIES = ("Lisbon", "Osaka")


def mixed_jobs(k: int = 0) -> list[dict]:
    """Four requests of four kinds; `k` picks another prompt of each kind."""
    item = next(it for it in load_prompts("json", "test") if it["id"] == SCHEMAS[k])
    code = load_prompts("code", "test", k + 1)[k]["prompt"][-600:]
    chat = load_prompts("chat", "test", k + 1)[k]["prompt"][-600:]
    tool = (f"You can call tools. Reply with one JSON tool call.\nUser: what is the weather in {CITIES[k]} for the "
            "next three days?\nAssistant: ")
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    return [{"text": item["prompt"], "sampling_params": {**greedy, "json_schema": json.dumps(load_schema(item))}},
            {"text": tool, "sampling_params": {**greedy, "json_schema": json.dumps(TOOL)}},
            {"text": code, "sampling_params": greedy},
            {"text": chat, "sampling_params": greedy}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("per-row")
    # the set's step costs as they are (ENTMTP_ONLINE_COSTS=0): refitted from wall times, the choices would
    # depend on the machine's other load; so they depend on the logits alone
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_TRACE": str(tmp / "trace"), "ENTMTP_ONLINE_COSTS": "0"})
    with started(plain, ent):
        yield plain, ent


@pytest.mark.parametrize("batch", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_mixed_batch_drafts_a_tree_per_request_and_equals_plain(servers, batch):
    plain, ent = servers
    jobs = [j for k in range(batch // 4) for j in mixed_jobs(k)]
    reference = [plain.post("/generate", j)["output_ids"] for j in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: ent.post("/generate", j), jobs))
    wrong = [k for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, [(k, outs[k]["output_ids"], reference[k]) for k in wrong]
    assert all(o["text"].startswith('{"name":') for o in outs[1::4]), outs[1]["text"]   # tool calls follow TOOL

    trace = ent.log_path.parent / "trace"
    rids = {o["meta_info"]["id"] for o in outs}
    steps = [s for f in trace.glob("trees-*.jsonl") for s in map(json.loads, f.read_text().splitlines())
             if set(s["rids"]) & rids]
    assert steps and all(len(s["trees"]) == len(s["rids"]) for s in steps)
    mixed = [s for s in steps if len(s["rids"]) >= 2 and len(set(s["trees"])) > 1]
    assert mixed, [s["trees"] for s in steps][:20]
    print(f"{len(mixed)} of {len(steps)} steps drafted different trees per request, e.g. {mixed[0]['trees']}")
    for s in mixed:   # one step shape: the tree that set it is among the rows', every row its node count
        assert s["tree"] in s["trees"] and s["state"] is not None
    # grammar-aware drafting followed each constrained row's own tree without falling back (it logs a traceback)
    assert "Traceback" not in ent.log_text(), ent.log_tail()
    # meta_info: each request its own tree per step, in the trace's order for that request
    for job, out in zip(jobs, outs):
        rid = out["meta_info"]["id"]
        mine = [s["trees"][s["rids"].index(rid)] for s in steps if rid in s["rids"]]
        assert out["meta_info"]["entmtp_trees"] == mine, (rid, out["meta_info"]["entmtp_trees"][:8], mine[:8])
