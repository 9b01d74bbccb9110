"""ENTMTP resting inside a real SGLang server (bundled model, CPU): a chain:0 step runs no draft model, the
rested positions are caught up in one draft-extend pass when speculation resumes, and greedy output stays
plain decoding's, token for token.

The served set is the bundled model's shipped EAGLE set cut to chain:0 and one deep chain, with its table
saying "speculate" for predictable text (low draft entropy) and "rest" otherwise, so a request alternates
between rests and speculation on its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
from helpers.testing import import_sglang_or_skip, plain_and_entmtp, started

from entmtp_sglang.tasks import load_prompts

import_sglang_or_skip()

from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 40
DEEP = "b0n4d3"
F32 = ("--dtype", "float32")


def alternating_set(out: Path) -> Path:
    """chain:0 and the deep chain of the bundled model's set: speculate in the two predictable bins, rest in
    the two others (no predictor: the bins decide)."""
    data = json.loads((ROOT / "trees" / "entmtp-tiny-eagle-mixed.json").read_text())
    keep = {t["name"]: t for t in data["trees"] if t["name"] in ("chain:0", DEEP)}
    keep[DEEP] = {**keep[DEEP], "expected_accepted": [3.0, 3.0, 0.0, 0.0]}
    data["trees"] = [keep["chain:0"], keep[DEEP]]
    data.pop("predictor", None)
    out.write_text(json.dumps(data))
    load_tree_set(out)
    return out


def prompts() -> list[str]:
    return [it["prompt"][-600:] for task in ("code", "chat", "prose", "json") for it in load_prompts(task, "test", 3)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rest")
    # the set's step costs as they are (ENTMTP_ONLINE_COSTS=0): refitted from this server's wall times, which
    # other load on the machine moves, they would make when a request rests a matter of timing
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_SET": str(alternating_set(tmp / "alternating.json")),
                                             "ENTMTP_PROFILE": str(tmp / "steps.jsonl"),   # stages per step
                                             "ENTMTP_ONLINE_COSTS": "0"})
    with started(plain, ent):
        yield plain, ent


@pytest.fixture(scope="module")
def reference(servers):
    plain, _ = servers
    return {p: plain.generate(p, MAX_NEW)["output_ids"] for p in prompts()}


def resumed(trees: list[str]) -> bool:
    """Whether a speculative step follows a rest."""
    return any(a == "rest" and b == DEEP for a, b in zip(trees, trees[1:]))


def test_rest_and_resume_equal_plain_decoding_at_batch_1(servers, reference):
    _, ent = servers
    all_trees = []
    for p, want in reference.items():
        out = ent.generate(p, MAX_NEW)
        assert out["output_ids"] == want, p[:60]
        all_trees.append(out["meta_info"]["entmtp_trees"])
    flat = [t for trees in all_trees for t in trees]
    assert "rest" in flat and DEEP in flat, flat
    assert sum(resumed(t) for t in all_trees) >= 2, all_trees     # rests end in a catch-up, then speculation
    assert max(_longest_rest(t) for t in all_trees) >= 3, all_trees  # rests of several steps


def test_rest_at_the_first_decode_step(servers, reference):
    """A request whose first decode step already rests (chain:0 chosen on its prefill's draft signal)."""
    _, ent = servers
    firsts = []
    for p, want in reference.items():
        out = ent.generate(p, MAX_NEW)
        assert out["output_ids"] == want
        firsts.append(out["meta_info"]["entmtp_trees"][:1])
    assert ["chain:0"] in firsts, firsts


def test_rest_and_resume_with_requests_joining_and_leaving(servers, reference):
    """8 requests in flight with different lengths: requests join a resting batch (their prefill drafted, no
    rested positions owed) and leave it while others owe positions."""
    _, ent = servers
    items = list(reference.items())
    lengths = [MAX_NEW - 3 * (i % 5) for i in range(len(items))]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda a: ent.generate(a[0][0], a[1]), zip(items, lengths)))
    for (p, want), n, out in zip(items, lengths, outs):
        assert out["output_ids"] == want[:n], p[:60]
    assert any("rest" in o["meta_info"]["entmtp_trees"] for o in outs)


def test_rest_across_a_radix_cache_hit(servers):
    """A second request continues the first one's tokens (its prompt and output, some of them rested through):
    that prefix comes from SGLang's radix cache, and the output is still plain decoding's."""
    from transformers import AutoTokenizer

    from entmtp_sglang.model.load import BUNDLED_MODEL

    plain, ent = servers
    ids = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL)).encode(prompts()[3])
    first = ent.generate_ids(ids, MAX_NEW)
    assert "rest" in first["meta_info"]["entmtp_trees"]
    cont = ids + first["output_ids"]
    got, want = ent.generate_ids(cont, MAX_NEW), plain.generate_ids(cont, MAX_NEW)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["cached_tokens"] >= len(ids), got["meta_info"]   # the prefix came from the cache


def test_a_pinned_tree_is_served_without_rests(servers, reference):
    _, ent = servers
    for p, want in list(reference.items())[:3]:
        out = ent.post("/generate", {"text": p, "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_NEW, "custom_params": {"entmtp_tree": DEEP}}})
        assert out["output_ids"] == want
        assert set(out["meta_info"]["entmtp_trees"]) == {DEEP}


def test_a_request_pinning_chain0_rests_to_its_end_without_catch_ups(servers, reference):
    """chain:0 pinned: every step rests, and since the request never drafts, its rested positions are never
    caught up (without the pin a rest of 16 steps or more ends in a catch-up pass; MAX_NEW is past that)."""
    _, ent = servers
    steps = Path(ent.env["ENTMTP_PROFILE"])
    for p, want in list(reference.items())[:2]:
        seen = len(steps.read_text().splitlines()) if steps.exists() else 0
        out = ent.post("/generate", {"text": p, "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_NEW, "custom_params": {"entmtp_tree": "chain:0"}}})
        assert out["output_ids"] == want
        assert set(out["meta_info"]["entmtp_trees"]) <= {"rest", "chain:0"}, out["meta_info"]["entmtp_trees"]
        rows = [json.loads(x) for x in steps.read_text().splitlines()[seen:]]
        assert len(rows) >= MAX_NEW - 1 and not any(r.get("catch_up", 0.0) for r in rows), rows


def _longest_rest(trees: list[str]) -> int:
    best = run = 0
    for t in trees:
        run = run + 1 if t in ("rest", "chain:0") else 0
        best = max(best, run)
    return best


def test_after_a_catch_up_the_drafter_drafts_what_it_drafts_without_rests(servers):
    """The catch-up writes the draft KV a never-resting drafter would have: a speculative step that starts at
    the same position as a step of the same request pinned to the deep chain (never resting) accepts as many
    drafts. (Greedy equality alone cannot see a wrong catch-up: verification would only accept less. With the
    caught-up hidden states zeroed, 2 of 5 such steps accepted fewer drafts.)"""
    _, ent = servers
    n = 64

    def steps(out):   # (start position in the output, tree, accepted drafts) per decode step
        pos, rows = 1, []
        for tree, acc in zip(out["meta_info"]["entmtp_trees"], out["meta_info"]["entmtp_accepted"]):
            rows.append((pos, tree, int(acc)))
            pos += int(acc) + 1
        return rows

    matched = []   # (accepted after a catch-up, accepted at the same position never resting)
    for p in prompts():
        free = steps(ent.generate(p, n))
        pinned = {pos: acc for pos, _, acc in steps(ent.post("/generate", {"text": p, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "custom_params": {"entmtp_tree": DEEP}}}))}
        matched += [(acc, pinned[pos]) for (pos, tree, acc), prev in zip(free[1:], free)
                    if tree == DEEP and prev[1] == "rest" and pinned.get(pos, 0) > 0]
    assert len(matched) >= 3, matched
    assert 4 * sum(a != b for a, b in matched) <= len(matched), matched


def test_a_step_where_every_request_rests_runs_no_draft_pass_and_no_draft_extend(servers, reference):
    """A request pinning chain:0 rests every step: the server's own step record (ENTMTP_PROFILE: how many times each
    stage ran, counted, not timed) shows no draft (`draft`, `draft_forward`) and no draft-model pass at all in those
    steps; the output is plain decoding's."""
    _, ent = servers
    steps = Path(ent.env["ENTMTP_PROFILE"])
    p, want = next(iter(reference.items()))
    seen = len(steps.read_text().splitlines()) if steps.exists() else 0
    out = ent.post("/generate", {"text": p, "sampling_params": {
        "temperature": 0, "max_new_tokens": MAX_NEW, "custom_params": {"entmtp_tree": "chain:0"}}})
    assert out["output_ids"] == want
    rows = [json.loads(x) for x in steps.read_text().splitlines()[seen:]]
    resting = [r for r in rows if r["tree"] == "rest"]
    assert len(resting) >= MAX_NEW - 1, rows
    for r in resting:
        calls = r["calls"]
        assert calls.get("draft", 0) == calls.get("draft_forward", 0) == calls.get("catch_up", 0) == 0, r
        assert calls.get("verify") == 1 and calls.get("target_forward") == 1, r


def test_finished_and_aborted_requests_leave_no_state_behind(servers, reference):
    """200 requests: 24 one at a time (the alternating set rests about half the steps, so some end in a resting step
    owing the drafter positions: at batch 1 which ones is decided by the logits alone, so the count does not depend on
    timing), then 176 eight at a time with every 20th aborted mid-generation: afterwards the worker's per-request
    table, the policy's feedback and the owed positions hold nothing (read from the worker through /server_info, not
    from memory figures). Then a request repeating a finished request's rid, with a one-token prompt, inherits nothing
    and equals plain decoding."""
    plain, ent = servers
    items = list(reference.items())

    def run(i: int) -> dict:
        text = items[i % len(items)][0]
        if i % 20 == 7:   # long enough to be aborted while it runs: abort until the request comes back
            done = cf.Future()

            def abort():
                while not done.done():
                    with contextlib.suppress(Exception):
                        ent.post("/abort_request", {"rid": f"leak-{i}"})
                    done_wait(done)

            pool_abort = threading.Thread(target=abort)
            pool_abort.start()
            try:
                out = ent.post("/generate", {"text": text, "rid": f"leak-{i}", "sampling_params": {
                    "temperature": 0, "max_new_tokens": 250, "ignore_eos": True}})
            except Exception as e:   # an aborted request may come back as an error
                out = {"error": str(e)}
            finally:
                done.set_result(True)
                pool_abort.join()
            return out
        return ent.post("/generate", {"text": text, "rid": f"leak-{i}", "sampling_params": {
            "temperature": 0, "max_new_tokens": 6 + i % 11}})

    alone = [run(i) for i in range(24)]
    ended = [o["meta_info"]["entmtp_trees"] for i, o in enumerate(alone) if i % 20 != 7]
    assert sum(trees[-1:] == ["rest"] for trees in ended) > 0, ended
    with cf.ThreadPoolExecutor(8) as pool:
        outs = alone + list(pool.map(run, range(24, 200)))
    aborted = [o for i, o in enumerate(outs) if i % 20 == 7]
    assert len(outs) == 200 and len(aborted) == 10
    assert all(len(o.get("output_ids", ())) < 250 for o in aborted), [len(o.get("output_ids", ())) for o in aborted]
    census = ent.server_info()["entmtp_requests"]
    deadline = time.monotonic() + 30   # (SGLang releases a request before it answers; this only waits out a slow one)
    while census["requests"] and time.monotonic() < deadline:
        time.sleep(0.2)
        census = ent.server_info()["entmtp_requests"]
    assert census == {"requests": 0, "owed_positions": 0, "owed_bytes": 0, "policy_requests": 0}, census

    ids = [items[0][1][0]]   # a one-token prompt under a finished request's rid
    got = ent.post("/generate", {"input_ids": ids, "rid": "leak-3", "sampling_params": {
        "temperature": 0, "max_new_tokens": MAX_NEW}})
    assert got["output_ids"] == plain.generate_ids(ids, MAX_NEW)["output_ids"]


def done_wait(done, seconds: float = 0.2) -> None:
    with contextlib.suppress(cf.TimeoutError):
        done.result(timeout=seconds)
