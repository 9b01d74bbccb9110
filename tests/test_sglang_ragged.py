"""Ragged node counts inside SGLang's batch (issue 36, item 2), through real CPU servers of the bundled model: each
request verifies its own number of tokens, down to a resting row (its root alone) inside a speculating step, the
target running only the real tokens; greedy output stays plain decoding's token for token for a mixed batch of
four (and, marked slow, eight) at once (JSON under a schema, a tool call, code, chat), and a penalised request rests
as a row beside drafting ones instead of making its whole batch rest. Requests joining and leaving mid-run (the
batch changing size from step to step) and a request whose prefix comes from SGLang's radix cache, beside other
requests, give plain decoding's output too.

SGLang is imported only when the servers start (not at collection)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import uuid

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
    _equal(outs, reference)
    return outs, _steps(ent, {o["meta_info"]["id"] for o in outs})


def _equal(outs, reference):
    wrong = [k for k, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not wrong, [(k, outs[k]["output_ids"], reference[k]) for k in wrong]


def _steps(ent, rids) -> list[dict]:
    """The trace's decode steps (in order) in which any of `rids` took part."""
    trace = ent.log_path.parent / "trace"
    return [s for f in trace.glob("trees-*.jsonl") for s in map(json.loads, f.read_text().splitlines())
            if set(s["rids"]) & rids]


def _wait_until_decoding(ent, running: dict, timeout_s: float = 300) -> None:
    """Until the trace shows a decode step of any of `running` (rid -> its request's future), so that a request
    sent next joins a running batch; fails if none is traced in time or one finished first."""
    trace = ent.log_path.parent / "trace"
    deadline = time.monotonic() + timeout_s
    while not any(rid in f.read_text() for f in trace.glob("trees-*.jsonl") for rid in running):
        assert time.monotonic() < deadline and not any(f.done() for f in running.values()), "no step traced"
        time.sleep(0.02)


def _short(job: dict, max_new_tokens: int, rid: str | None = None) -> dict:
    out = {**job, "sampling_params": {**job["sampling_params"], "max_new_tokens": max_new_tokens}}
    return {**out, "rid": rid} if rid else out


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


def test_requests_joining_and_leaving_mid_run_equal_plain(servers):
    """A stream of six requests of different lengths: three are sent together; the other three once the trace
    shows the longest of the first decoding, so they join a running batch; the short ones leave while the rest
    decode on. The batch changes size from step to step, every row keeps its own tree and node count. (The
    trigger is the longest request, not any: on a slow machine the first three may reach the scheduler one by
    one, and the 8-token one can be prefilled, decoded and gone before the others start.)"""
    plain, ent = servers
    tag = uuid.uuid4().hex[:8]
    every = _jobs(8)   # JSON, tool call, code, chat; twice
    first = [(0, 40), (2, 8), (3, 20)]         # (job, max_new_tokens): the code request leaves early
    second = [(1, 16), (4, 24), (7, 12)]
    jobs = {f"{tag}-{k}": _short(every[k], n, f"{tag}-{k}") for k, n in first + second}
    reference = {rid: plain.post("/generate", {k: v for k, v in j.items() if k != "rid"})["output_ids"]
                 for rid, j in jobs.items()}
    firsts = [f"{tag}-{k}" for k, _ in first]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        running = {rid: pool.submit(ent.post, "/generate", jobs[rid]) for rid in firsts}
        longest = f"{tag}-0"   # decodes long enough for the second three to join it
        _wait_until_decoding(ent, {longest: running[longest]})
        running |= {f"{tag}-{k}": pool.submit(ent.post, "/generate", jobs[f"{tag}-{k}"]) for k, _ in second}
        outs = {rid: f.result() for rid, f in running.items()}
    _equal([outs[r] for r in jobs], [reference[r] for r in jobs])

    steps = _steps(ent, set(jobs))
    sizes = [len(s["rids"]) for s in steps]
    print(f"{len(steps)} steps, batch size per step {sizes}")
    seen: set = set()
    joined = []     # requests whose first decode step ran beside a request that had decoded before
    for s in steps:
        joined += [r for r in s["rids"] if r not in seen and set(s["rids"]) & seen]
        seen |= set(s["rids"])
    assert set(joined) - set(firsts), (joined, sizes)
    early = f"{tag}-2"    # the code request, 8 tokens: it left while others decoded on
    last = max(i for i, s in enumerate(steps) if early in s["rids"])
    assert last < len(steps) - 1, sizes
    assert len(set(sizes)) >= 3, sizes     # grew with the joiners and shrank as requests left
    assert all("nodes" in s and len(s["nodes"]) == len(s["rids"]) for s in steps if s["state"] is not None)
    assert any(len(set(s["trees"])) > 1 for s in steps), [s["trees"] for s in steps]
    assert "Traceback" not in ent.log_text(), ent.log_tail()


def test_a_radix_cache_hit_beside_other_requests_equals_plain(servers):
    """The same long prefix twice, each time joining two other requests already decoding: the second time its
    prefill comes from SGLang's radix cache (`cached_tokens`), and it decodes in a batch beside the others. (It is
    sent once the trace shows the others decoding, and they run a fixed 64 tokens (`ignore_eos`), so on a slow or
    busy machine they cannot be prefilled, decoded and gone before it reaches the scheduler.)"""
    from entmtp_sglang.tasks import load_prompts

    plain, ent = servers
    tag = uuid.uuid4().hex[:8]
    # a prefix of some 400 tokens, text no other test here sends
    prefix = "\n\n".join(it["prompt"] for task in ("prose", "math") for it in load_prompts(task, "test", 3))
    asks = ("\nIn one sentence, the text above says", "\nThe main point of the text above is")
    every = _jobs(8)   # JSON, tool call, code, chat; twice: the others are the free-text ones
    got = []
    for n, (ask, others) in enumerate(zip(asks, ((2, 3), (6, 7)))):
        head = {"text": prefix + ask, "sampling_params": {"temperature": 0, "max_new_tokens": 20},
                "rid": f"{tag}-{n}-prefix"}
        beside = {f"{tag}-{n}-{k}": {"text": every[k]["text"], "rid": f"{tag}-{n}-{k}",
                                     "sampling_params": {**every[k]["sampling_params"], "max_new_tokens": 64,
                                                         "ignore_eos": True}} for k in others}
        jobs = {**beside, head["rid"]: head}
        reference = {rid: plain.post("/generate", {k: v for k, v in j.items() if k != "rid"})["output_ids"]
                     for rid, j in jobs.items()}
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            running = {rid: pool.submit(ent.post, "/generate", j) for rid, j in beside.items()}
            _wait_until_decoding(ent, running)
            running[head["rid"]] = pool.submit(ent.post, "/generate", head)
            outs = {rid: f.result() for rid, f in running.items()}
        _equal([outs[r] for r in jobs], [reference[r] for r in jobs])
        got.append(outs[head["rid"]]["meta_info"])
    (once, twice) = got
    print(f"prefix request: {once['prompt_tokens']} prompt tokens, cached {once['cached_tokens']} the first "
          f"time, {twice['cached_tokens']} the second")
    assert twice["cached_tokens"] > once["cached_tokens"] and twice["cached_tokens"] >= once["prompt_tokens"] // 2
    steps = _steps(ent, {twice["id"]})
    assert steps and any(len(s["rids"]) > 1 for s in steps), [s["rids"] for s in steps]
    assert "Traceback" not in ent.log_text(), ent.log_tail()
