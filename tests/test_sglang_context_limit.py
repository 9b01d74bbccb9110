"""At the context limit ENTMTP admits, serves and refuses exactly what plain SGLang does (issue 35).

Three CPU servers of the bundled model with `--context-length 256`: plain SGLang (the reference), ENTMTP on the
shipped tree set, and ENTMTP on a wide set built here (a root fan-out of 5 beside trees of depth 4, so SGLang's
per-step decode allocation, 2 x max(topk 5 x depth 4, 7 nodes) = 40 slots past a request's committed tokens, is
far wider than the req_to_token row's default headroom of 4 + 7; every speculative tree has at least 5 nodes, so
the last steps before the limit must rest). ENTMTP used to charge that allocation to every request's input (9
tokens on SmolLM2's set, 28 on this one), refusing requests plain SGLang serves and naming a prompt longer than
the one sent. Each request below is compared with plain SGLang's answer at batch 1: the HTTP status, the output
tokens and the finish reason, or the refusal's message; at batch 1 and beside other requests in flight. Every
decode step's tree must fit the room the request had left before the context limit.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.testing import FIXED_COSTS, import_sglang_or_skip, plain_and_entmtp, started

from entmtp_sglang.tasks import load_prompts

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer  # noqa: E402
from entmtp_sglang.tree import Tree  # noqa: E402
from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "trees" / "entmtp-tiny-eagle-mixed.json"
CTX = 256
ARGS = ("--dtype", "float32", "--context-length", str(CTX))
REPEATS = [313, 273, 945] * 200   # the bundled model continues this pattern: drafts are accepted up to the limit
# name -> parent array: topk 5 (w5d1), depth 4; the smallest speculative tree has 5 nodes
WIDE = {
    "chain:0": [-1],
    "chain:4": [-1, 0, 1, 2, 3],
    "w5d1": [-1, 0, 0, 0, 0, 0],
    "w2d4": [-1, 0, 0, 1, 1, 3, 5],
}
# (what, prompt tokens, max_new_tokens): SGLang serves prompt + max_new_tokens <= context, cuts the output to
# context - 2 - prompt tokens, and refuses a prompt of context - 6 tokens or more in the scheduler
CASES = [
    ("at the limit", CTX - 12, 12),
    ("one under", CTX - 13, 12),
    ("one over", CTX - 11, 12),
    ("long prompt, large max_new_tokens, at the limit", CTX // 2, CTX - CTX // 2),
    ("long prompt, large max_new_tokens, past the limit", CTX // 2, CTX),
    ("longest prompt served", CTX - 7, 1),
    ("prompt past the scheduler's limit", CTX - 6, 1),
]


def wide_set(out: Path) -> Path:
    data = json.loads(SHIPPED.read_text())
    costs = data["trees"][0]["cost_seconds"]
    trees = [Tree(tuple(parents), name=name) for name, parents in WIDE.items()]
    data["trees"] = [{"name": t.name, "parents": list(t.parents), "expected_accepted": [0.6 * t.max_depth] * 4,
                      "cost_seconds": {b: c * (1 + 0.05 * (t.num_nodes - 1)) for b, c in costs.items()}}
                     for t in trees]
    data.pop("predictor", None)
    out.write_text(json.dumps(data))
    return out


def node_counts(path: Path) -> dict[str, int]:
    return {"rest": 1, "plain": 1, **{t.tree.name: t.tree.num_nodes for t in load_tree_set(path).trees}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("context-limit")
    wide_path = wide_set(logs / "wide.json")
    plain, ent = plain_and_entmtp(logs, ARGS)
    wide = SGLangServer.cpu("ENTMTP", log_path=logs / "wide.log", extra=ARGS,
                            env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", **FIXED_COSTS,
                                 "ENTMTP_TREE_SET": str(wide_path)})
    with started(plain, ent, wide):
        yield plain, {"shipped": (ent, node_counts(SHIPPED)), "wide": (wide, node_counts(wide_path))}


def ask(server, ids: list[int], max_new: int, **params) -> dict:
    """/generate on token ids: the HTTP status, and the output, finish reason and meta_info, or the error."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, **params}}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": json.loads(e.read())["error"]["message"]}
    meta = out["meta_info"]
    return {"status": 200, "output_ids": out["output_ids"], "finish_reason": meta["finish_reason"], "meta": meta}


def answer(got: dict) -> dict:
    """What a user sees: the status and the output and finish reason, or the refusal."""
    return {k: v for k, v in got.items() if k != "meta"}


def requests() -> list[tuple[str, list[int], int]]:
    return [(what, REPEATS[:n], m) for what, n, m in CASES]


def others() -> list[tuple[str, list[int], int]]:
    """Ordinary requests far from the limit, in flight beside the edge ones."""
    from tokenizers import Tokenizer

    from entmtp_sglang.model.load import BUNDLED_MODEL

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    items = [it["prompt"] for task in ("code", "prose") for it in load_prompts(task, "test", 2)]
    return [(f"other {k}", tok.encode(p).ids[-100:], 96) for k, p in enumerate(items)]


@pytest.fixture(scope="module")
def reference(servers):
    plain, _ = servers
    return {what: answer(ask(plain, ids, m)) for what, ids, m in requests() + others()}


def test_the_reference_is_what_the_cases_say(reference):
    """Plain SGLang serves up to prompt + max_new_tokens = context, with at most context - 2 - prompt tokens."""
    for what, n, m in CASES:
        ref = reference[what]
        if n + m > CTX or n >= CTX - 6:
            assert ref["status"] == 400, (what, ref)
        else:
            assert ref["status"] == 200, (what, ref)
            assert len(ref["output_ids"]) == min(m, CTX - 2 - n), (what, ref)
            assert ref["finish_reason"] == {"type": "length", "length": len(ref["output_ids"])}, (what, ref)


def check_rooms(name: str, n_prompt: int, got: dict, nodes: dict[str, int]) -> list[tuple[int, str]]:
    """(room, tree) per decode step; every tree fits the room left before the context limit."""
    meta = got["meta"]
    trees, accepted = meta.get("entmtp_trees", []), meta.get("entmtp_accepted", [])
    assert len(trees) == len(accepted), (name, trees, accepted)
    seq, steps = n_prompt + 1, []           # the prefill gives the first token
    for tree, acc in zip(trees, accepted):
        room = CTX - seq
        assert nodes[tree] <= room, (name, n_prompt, seq, tree, trees)
        steps.append((room, tree))
        seq += acc + 1
    return steps


@pytest.mark.parametrize("name", ["shipped", "wide"])
def test_at_the_limit_entmtp_answers_as_plain_sglang_at_batch_1(servers, reference, name):
    """The issue's case scaled down (context - 12 prompt + 12 new: plain's 10 tokens), one token under and over,
    a long prompt with a large max_new_tokens (served cut to context - 2, or refused), the longest prompt and one
    past it: the same status, tokens and finish reason, or the same refusal naming the user's own numbers."""
    _, ents = servers
    ent, nodes = ents[name]
    steps = []
    for what, ids, m in requests():
        got = ask(ent, ids, m)
        assert answer(got) == reference[what], (name, what)
        if got["status"] == 200:
            steps += check_rooms(what, len(ids), got, nodes)
        elif "input messages" in got["error"]:
            assert (f"maximum context length of {CTX} tokens" in got["error"]
                    and f"{len(ids)} tokens from the input messages and {m} tokens for the completion"
                    in got["error"]), got["error"]
    spoke = [t for _, t in steps if nodes[t] > 1]
    assert len(spoke) >= 5, steps                  # speculation really ran up to the limit
    assert ent.proc.poll() is None, ent.log_tail()


@pytest.mark.parametrize("name", ["shipped", "wide"])
def test_at_the_limit_entmtp_answers_as_plain_sglang_beside_other_requests(servers, reference, name):
    """The same requests and four ordinary ones, all in flight at once, twice over: one tree per batch, capped by
    the least room of any request in it."""
    _, ents = servers
    ent, nodes = ents[name]
    jobs = (others() + requests()) * 2
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: ask(ent, job[1], job[2]), jobs))
    wrong = [what for (what, _, _), got in zip(jobs, outs) if answer(got) != reference[what]]
    assert not wrong, wrong
    for (what, ids, _), got in zip(jobs, outs):
        if got["status"] == 200:
            check_rooms(what, len(ids), got, nodes)
    assert ent.proc.poll() is None, ent.log_tail()


@pytest.mark.parametrize(("name", "pin"), [("shipped", "b3n4d2"), ("wide", "w2d4")])
def test_near_the_limit_the_tree_shrinks_to_the_room_down_to_resting(servers, name, pin):
    """Requests pinning the set's largest tree run it while it fits, then smaller trees (the wide set: rests, its
    smallest speculative tree having 5 nodes, more than the last steps' room), and end as plain decoding ends
    them. Five prompt lengths, so that the steps land on every room near the limit."""
    plain, ents = servers
    ent, nodes = ents[name]
    steps = []
    for n in range(CTX - 40, CTX - 35):
        ids, m = REPEATS[:n], CTX - n
        got = ask(ent, ids, m, custom_params={"entmtp_tree": pin})
        assert answer(got) == answer(ask(plain, ids, m)), n
        steps += check_rooms(f"pinned, {n} + {m}", n, got, nodes)
    assert any(t == pin for _, t in steps), steps
    tight = {(r, t) for r, t in steps if r < nodes[pin]}
    assert tight and all(t != pin for _, t in tight), steps
    smallest = min(v for v in nodes.values() if v > 1)
    resting = {t for r, t in steps if r < smallest}   # chain:0 (the policy's choice), then rests
    assert (resting and resting <= {"chain:0", "rest"}) if smallest > 3 else not resting, steps
