"""ENTMTP on a model the user serves (issue 14, items 1 and 2), through real SGLang servers on this CPU.

* `entmtp calibrate --engine sglang` with only a model directory and a drafter directory (the bundled model
  and its EAGLE drafter) writes a tree set; `sglang.launch_server ... --speculative-algorithm ENTMTP` serves
  it, chooses among its trees, and its greedy output equals the non-speculative server's.
* With no tree set for the served model (the bundled model under another directory name), ENTMTP starts with
  the generic set, logs that it is uncalibrated, refits its estimates as it serves (the log shows them), and
  its greedy output equals the non-speculative server's. Started without `--dtype`, it serves float32 on CPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import subprocess
import sys

import pytest
from helpers.testing import import_sglang_or_skip

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer, cpu_args, free_port  # noqa: E402
from entmtp_sglang.model.load import BUNDLED_MODEL  # noqa: E402
from entmtp_sglang.tasks import load_prompts  # noqa: E402
from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

pytestmark = pytest.mark.sglang
F32 = ("--dtype", "float32")
MAX_NEW = 32


def prompts(n: int = 4) -> list[str]:
    return [it["prompt"][-400:] for task in ("code", "prose") for it in load_prompts(task, "test", n)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    srv = SGLangServer.cpu(None, attention="torch_native", log_path=tmp_path_factory.mktemp("plain") / "plain.log",
                           extra=F32)
    with srv:
        yield {p: srv.generate(p, MAX_NEW)["output_ids"] for p in prompts()}


def greedy_outputs(server: SGLangServer, texts: list[str], concurrency: int) -> dict:
    with cf.ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: server.generate(p, MAX_NEW), texts))
    return dict(zip(texts, outs))


@pytest.mark.slow   # a whole calibration through SGLang (about 140 s here); the online calibration below runs in CI
def test_calibrate_through_sglang_then_serve(plain, tmp_path):
    out = tmp_path / "entmtp-tiny-eagle-code.json"
    cmd = [sys.executable, "-m", "entmtp_sglang.cli", "calibrate", "--engine", "sglang",
           "--model-path", str(BUNDLED_MODEL), "--speculative-draft-model-path", str(BUNDLED_MODEL / "eagle"),
           "--task", "code", "--prompts", "8", "--max-new-tokens", "48", "--batch-sizes", "1,4", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "serve it: ENTMTP_TREE_SET=" in run.stdout
    ts = load_tree_set(out, model="entmtp-tiny", drafter="eagle")
    assert ts.trees[0].tree.name == "chain:0" and len(ts.trees) >= 2 and ts.predictor is not None
    assert "SGLang" in ts.hardware and set(ts.trees[-1].cost_seconds) == {1, 4}
    assert ts.provenance["positions"] > 50 and out.with_suffix(".records.jsonl").exists()
    names = {e.tree.name for e in ts.trees}

    deepest = max(ts.trees, key=lambda e: (e.tree.max_depth, e.tree.num_nodes)).tree.name
    assert deepest != "chain:0"
    server = SGLangServer(cpu_args("ENTMTP", extra=F32), free_port(), {"ENTMTP_TREE_SET": str(out)},
                          tmp_path / "entmtp.log")
    with server:
        outs = greedy_outputs(server, list(plain), 4)
        # Whether the policy speculates on its own depends on the step costs timed on this (shared) machine;
        # a request that pins one of the set's trees must be served with it, whatever the timing.
        pinned = {p: server.generate(p, MAX_NEW, custom_params={"entmtp_tree": deepest}) for p in list(plain)[:2]}
    chosen = [t for o in outs.values() for t in o["meta_info"].get("entmtp_trees", [])]
    # "rest": chain:0 chosen and served as a plain decode step (no draft pass); "plain": a penalised step
    assert chosen and set(chosen) <= names | {"plain", "rest"}, set(chosen) - names
    pinned_trees = [t for o in pinned.values() for t in o["meta_info"].get("entmtp_trees", [])]
    assert deepest in pinned_trees, (deepest, pinned_trees)
    mismatches = [p[:40] for p, o in [*outs.items(), *pinned.items()] if o["output_ids"] != plain[p]]
    assert not mismatches, mismatches


def test_zero_setup_start_calibrates_online(plain, tmp_path):
    model = tmp_path / "my-model"          # the bundled model under a name no tree set was calibrated for
    model.symlink_to(BUNDLED_MODEL, target_is_directory=True)
    args = cpu_args("ENTMTP", model=model)   # no --dtype: ENTMTP serves float32 on CPU by default
    server = SGLangServer(args, free_port(), {}, tmp_path / "zero-setup.log")
    texts = list(plain) * 6
    with server:
        outs = greedy_outputs(server, texts, 4)
        log = server.log_text()
        dtype = server.server_info().get("dtype")
    assert dtype == "float32", dtype
    assert "starting uncalibrated with a generic set" in log
    refits = re.findall(r"ENTMTP online calibration \(refit (\d+), (\d+) steps\): (\d+) positions", log)
    assert len(refits) >= 2, log[-3000:]
    positions = [int(p) for _, _, p in refits]
    assert positions == sorted(positions) and positions[-1] > positions[0]
    mismatches = [p[:40] for p, o in outs.items() if o["output_ids"] != plain[p]]
    assert not mismatches, mismatches
    trees = {t for o in outs.values() for t in o["meta_info"].get("entmtp_trees", [])}
    assert len(trees) >= 2, trees
    print(json.dumps({"refits": refits[-3:], "trees": sorted(trees)}))
