"""Ragged node counts inside SGLang's batch (issue 36, item 2), through real CPU servers of the bundled model: each
request verifies its own number of tokens, down to a resting row (its root alone) inside a speculating step, the
target running only the real tokens; greedy output stays plain decoding's token for token for a mixed batch of
four (and, marked slow, eight) at once (JSON under a schema, a tool call, code, chat), and a penalised request rests
as a row beside drafting ones instead of making its whole batch rest.

SGLang is imported only when the servers start (not at collection)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
from helpers.testing import import_sglang_or_skip, plain_and_entmtp, started

pytestmark = pytest.mark.sglang
F32 = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    import_sglang_or_skip()
    tmp = tmp_path_factory.mktemp("ragged")
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_TRACE": str(tmp / "trace"), "ENTMTP_ONLINE_COSTS": "0"})
    with started(plain, ent):
        yield plain, ent


def _jobs(batch: int) -> list[dict]:
    from test_sglang_per_row import mixed_jobs  # (imports SGLang: only once the servers run)

    return [j for k in range(batch // 4) for j in mixed_jobs(k)]


def _run(plain, ent, jobs):
    reference = [plain.post("/generate", j)["output_ids"] for j in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: ent.post("/generate", j), jobs))
    wrong = [k for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, [(k, outs[k]["output_ids"], reference[k]) for k in wrong]
    rids = {o["meta_info"]["id"] for o in outs}
    trace = ent.log_path.parent / "trace"
    steps = [s for f in trace.glob("trees-*.jsonl") for s in map(json.loads, f.read_text().splitlines())
             if set(s["rids"]) & rids]
    return outs, steps


def _ragged_steps(steps):
    """Speculating steps with a resting row (1 node) beside a drafting one, and different trees in the step."""
    return [s for s in steps if s["state"] is not None and "nodes" in s and 1 in s["nodes"]
            and max(s["nodes"]) > 1 and len(set(s["trees"])) > 1]


@pytest.mark.parametrize("batch", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_mixed_batch_rests_rows_inside_speculating_steps_and_equals_plain(servers, batch):
    plain, ent = servers
    assert "ragged verify on" in ent.log_text(), ent.log_tail()
    jobs = _jobs(batch)
    # the chat rows rest (pinned to chain:0) from the start, while the others pick their own trees and node counts:
    # the rest of the batch speculates around them
    for j in jobs[3::4]:
        j["sampling_params"] = {**j["sampling_params"], "custom_params": {"entmtp_tree": "chain:0"}}
    outs, steps = _run(plain, ent, jobs)
    ragged = _ragged_steps(steps)
    assert ragged, [(s["trees"], s.get("nodes")) for s in steps][:20]
    for s in steps:
        if "nodes" in s:   # a row's node count is its tree's; the step's shape holds the widest
            assert len(s["nodes"]) == len(s["rids"]) and max(s["nodes"]) <= s["state"][1]
            assert all((n == 1) == (t == "chain:0") for n, t in zip(s["nodes"], s["trees"]))
    print(f"{len(ragged)} of {len(steps)} steps speculated with resting rows, e.g. {ragged[0]['trees']} "
          f"{ragged[0]['nodes']}")
    assert "Traceback" not in ent.log_text(), ent.log_tail()


def test_a_penalised_request_rests_beside_drafting_ones_and_equals_plain(servers):
    plain, ent = servers
    jobs = _jobs(4)
    jobs[2]["sampling_params"] = {**jobs[2]["sampling_params"], "frequency_penalty": 0.8, "repetition_penalty": 1.3}
    outs, steps = _run(plain, ent, jobs)
    rid = outs[2]["meta_info"]["id"]
    mine = [s for s in steps if rid in s["rids"]]
    assert mine and all(s["trees"][s["rids"].index(rid)] in ("chain:0", "rest") for s in mine)
    beside = [s for s in mine if s["state"] is not None]   # speculating steps it rested in
    assert beside, [(s["trees"], s.get("nodes")) for s in mine]
    assert all(s["nodes"][s["rids"].index(rid)] == 1 for s in beside)
    assert "Traceback" not in ent.log_text(), ent.log_tail()
