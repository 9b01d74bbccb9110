"""Each request its own tree inside SGLang's batch (issue 36, items 1 and 5), through real CPU servers of the
bundled model: a mixed batch of four at once (JSON under a schema, a tool call under its schema, code, chat) gives
plain decoding's greedy output token for token, while the tree trace shows requests of one step drafting
different trees (of the node count the step shares) and `meta_info.entmtp_trees` each request's own."""

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


def mixed_jobs() -> list[dict]:
    item = next(it for it in load_prompts("json", "test") if it["id"] == "002873801e56")
    code = load_prompts("code", "test", 1)[0]["prompt"][-600:]
    chat = load_prompts("chat", "test", 1)[0]["prompt"][-600:]
    tool = ("You can call tools. Reply with one JSON tool call.\nUser: what is the weather in Lisbon for the "
            "next three days?\nAssistant: ")
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    return [{"text": item["prompt"], "sampling_params": {**greedy, "json_schema": json.dumps(load_schema(item))}},
            {"text": tool, "sampling_params": {**greedy, "json_schema": json.dumps(TOOL)}},
            {"text": code, "sampling_params": greedy},
            {"text": chat, "sampling_params": greedy}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("per-row")
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_TRACE": str(tmp / "trace")})
    with started(plain, ent):
        yield plain, ent


def test_a_mixed_batch_of_4_drafts_a_tree_per_request_and_equals_plain(servers):
    plain, ent = servers
    jobs = mixed_jobs()
    reference = [plain.post("/generate", j)["output_ids"] for j in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: ent.post("/generate", j), jobs))
    wrong = [k for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, [(k, outs[k]["output_ids"], reference[k]) for k in wrong]
    assert outs[1]["text"].startswith('{"name":'), outs[1]["text"]   # the tool call follows its schema

    trace = ent.log_path.parent / "trace"
    steps = [json.loads(line) for f in trace.glob("trees-*.jsonl") for line in f.read_text().splitlines()]
    assert steps and all(len(s["trees"]) == len(s["rids"]) for s in steps)
    mixed = [s for s in steps if len(s["rids"]) >= 2 and len(set(s["trees"])) > 1]
    assert mixed, [s["trees"] for s in steps][:20]
    print(f"{len(mixed)} of {len(steps)} steps drafted different trees per request, e.g. {mixed[0]['trees']}")
    for s in mixed:   # one step shape: the tree that set it is among the rows', every row its node count
        assert s["tree"] in s["trees"] and s["state"] is not None
    # meta_info: each request its own tree per step, in the trace's order for that request
    for job, out in zip(jobs, outs):
        rid = out["meta_info"]["id"]
        mine = [s["trees"][s["rids"].index(rid)] for s in steps if rid in s["rids"]]
        assert out["meta_info"]["entmtp_trees"] == mine, (rid, out["meta_info"]["entmtp_trees"][:8], mine[:8])
