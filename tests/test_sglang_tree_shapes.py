"""Every tree shape through a real SGLang server (bundled model, CPU): a set holding trees of depth 0-4 and
widths 1-3, each tree's indices built once at start-up (sglang/tree_index.py) and one runtime state per tree
shape (sglang/shapes.py, upstream's adaptive machinery), switched per step by tree id; every request pins one
tree, and greedy output equals plain decoding's at batch 1 and 8."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest
from helpers.testing import import_sglang_or_skip, plain_and_entmtp, started

from entmtp_sglang.tasks import load_prompts
from entmtp_sglang.tree import Tree

import_sglang_or_skip()

from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 24
F32 = ("--dtype", "float32")
# name -> parent array: depth 0-4, widths 1-3 (the widest level of "w3d3" has three nodes, two of them expanded)
SHAPES = {
    "chain:0": [-1],
    "w3d1": [-1, 0, 0, 0],
    "chain:2": [-1, 0, 1],
    "w2d2": [-1, 0, 0, 1, 2],
    "w3d3": [-1, 0, 0, 0, 1, 1, 2, 4],
    "chain:4": [-1, 0, 1, 2, 3],
    "w2d4": [-1, 0, 0, 1, 1, 3, 5],
}


def shapes_set(out: Path) -> Path:
    data = json.loads((ROOT / "trees" / "entmtp-tiny-eagle-mixed.json").read_text())
    costs = data["trees"][0]["cost_seconds"]
    trees = [Tree(tuple(parents), name=name) for name, parents in SHAPES.items()]
    data["trees"] = [{"name": t.name, "parents": list(t.parents), "expected_accepted": [0.4 * t.max_depth] * 4,
                      "cost_seconds": {b: c * (1 + 0.1 * (t.num_nodes - 1)) for b, c in costs.items()}}
                     for t in trees]
    data.pop("predictor", None)
    out.write_text(json.dumps(data))
    ts = load_tree_set(out)
    assert [t.tree.max_depth for t in ts.trees] == [0, 1, 2, 2, 3, 4, 4]
    return out


def prompts() -> list[str]:
    return [it["prompt"][-600:] for task in ("code", "chat", "prose", "json") for it in load_prompts(task, "test", 2)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shapes")
    plain, ent = plain_and_entmtp(tmp, F32, {"ENTMTP_TREE_SET": str(shapes_set(tmp / "shapes.json")),
                                             "ENTMTP_TREE_TRACE": str(tmp / "trace")})
    with started(plain, ent):
        yield plain, ent


@pytest.fixture(scope="module")
def reference(servers):
    plain, _ = servers
    return {p: plain.generate(p, MAX_NEW)["output_ids"] for p in prompts()}


def pinned(ent, prompt: str, name: str) -> dict:
    return ent.generate(prompt, MAX_NEW, custom_params={"entmtp_tree": name})


def test_every_shape_serves_greedy_plain_output_at_batch_1(servers, reference):
    _, ent = servers
    names = list(SHAPES)
    used, wrong = set(), []
    for k, p in enumerate(reference):
        for name in (names[k % len(names)], names[(k + 3) % len(names)]):
            out = pinned(ent, p, name)
            trees = out["meta_info"].get("entmtp_trees", [])
            used.update(trees)
            if out["output_ids"] != reference[p]:
                wrong.append((name, p[:40]))
    assert not wrong, wrong
    # every shape served, chain:0 included: a chain:0 pin asks for no drafts for its whole life, so its steps
    # run as chain:0 (nothing kept for a catch-up pass), not as rests awaiting one
    assert set(names) <= used, used


def test_every_shape_serves_greedy_plain_output_at_batch_8(servers, reference):
    _, ent = servers
    names = list(SHAPES)
    items = list(reference)
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda kp: pinned(ent, kp[1], names[kp[0] % len(names)]), enumerate(items)))
    used = {t for o in outs for t in o["meta_info"].get("entmtp_trees", [])}
    assert len(used - {"rest", "plain"}) >= 2, used   # one tree per batch step: several shapes over the run
    wrong = [p[:40] for p, o in zip(items, outs) if o["output_ids"] != reference[p]]
    assert not wrong, wrong


def test_each_step_runs_in_its_trees_runtime_state(servers, reference):
    """Six shapes for seven trees (chain:0 rests without one), built at start-up; every speculative step ran in the
    state of its tree's shape (draft levels = depth, tokens verified = nodes), chain:0 and resting steps in none."""
    _, ent = servers
    for name in SHAPES:
        pinned(ent, next(iter(reference)), name)
    log = ent.log_path.read_text()
    assert "ENTMTP: 6 runtime states for the 7 trees of the set" in log, log[-2000:]
    shape = {name: [Tree(tuple(p)).max_depth, len(p)] if len(p) > 1 else None for name, p in SHAPES.items()}
    shape["rest"] = shape["plain"] = None
    trace = ent.log_path.parent / "trace"
    steps = [json.loads(line) for f in trace.glob("trees-*.jsonl") for line in f.read_text().splitlines()]
    seen = {s["tree"] for s in steps}
    assert set(SHAPES) <= seen, seen
    wrong = [s for s in steps if s["state"] != shape[s["tree"]]]
    assert not wrong, wrong[:5]
