"""ENTMTP under SGLang's tensor parallelism (--tp-size 2) and data parallelism (--dp-size 2) on this CPU.

Plain SGLang 0.5.23 runs both on CPU (gloo) given two settings (docs/parallelism.md):
`SGLANG_CPU_OMP_THREADS_BIND` (one core set per rank: SGLang refuses more ranks than NUMA nodes without it) and
`SGLANG_NCCL_SO_PATH` naming no library (a CUDA build of torch ships libnccl, and SGLang's PyNcclCommunicator
then binds the CPU device with `torch.cuda.device` and fails). Each rank of an ENTMTP server chooses its
own tree from its own logits; `ENTMTP_TREE_TRACE` makes every rank write its choices, compared here: under
`--tp-size 2` both ranks give every request of a mixed batch (JSON under a schema, a tool call, code, a resting chat
row) the same tree and node count in every step (issue 36).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest
from helpers.testing import import_sglang_or_skip

from entmtp_sglang.tasks import load_prompts

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
MAX_NEW = 32
F32 = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")
CPU_RANKS_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


def mixed_batch() -> list[dict]:
    """test_sglang_per_row's mixed batch, 24 tokens each, the chat request pinned to rest (chain:0) so the rows
    verify different node counts, down to 1."""
    from test_sglang_per_row import mixed_jobs

    jobs = [{**j, "sampling_params": {**j["sampling_params"], "max_new_tokens": 24}} for j in mixed_jobs(0)]
    jobs[3]["sampling_params"]["custom_params"] = {"entmtp_tree": "chain:0"}
    return jobs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain decoding's output ids: {prompt: ids} for the prompts, and under "mixed" the mixed batch's."""
    ps = [it["prompt"][-600:] for task in ("code", "chat", "math", "prose", "json")
          for it in load_prompts(task, "test", 1)]
    srv = SGLangServer.cpu(None, attention="torch_native", extra=F32,
                           log_path=tmp_path_factory.mktemp("plain") / "plain.log")
    with srv:
        return ({p: srv.generate(p, MAX_NEW)["output_ids"] for p in ps},
                [srv.post("/generate", j)["output_ids"] for j in mixed_batch()])


def traces(trace_dir: Path) -> dict[str, list[dict]]:
    return {f.name: [json.loads(ln) for ln in f.read_text().splitlines()]
            for f in sorted(trace_dir.glob("trees-*.jsonl"))}


@pytest.mark.parametrize("parallel", [("--tp-size", "2"), ("--dp-size", "2")], ids=["tp2", "dp2"])
def test_entmtp_with_two_ranks_equals_plain_decoding(reference, tmp_path, parallel):
    reference, mixed_reference = reference
    trace_dir = tmp_path / "trees"
    srv = SGLangServer.cpu("ENTMTP", extra=(*F32, *parallel), log_path=tmp_path / "entmtp.log",
                           env={**CPU_RANKS_ENV, "ENTMTP_TREE_TRACE": str(trace_dir)})
    with srv:
        outs = {p: srv.generate(p, MAX_NEW) for p in reference}
        with cf.ThreadPoolExecutor(8) as pool:       # batches of several requests, too
            burst = list(pool.map(lambda p: srv.generate(p, MAX_NEW), list(reference) * 2))
            mixed = list(pool.map(lambda j: srv.post("/generate", j), mixed_batch()))
    assert {p: o["output_ids"] for p, o in outs.items()} == reference
    assert [o["output_ids"] for o in burst] == [reference[p] for p in list(reference) * 2]
    assert [o["output_ids"] for o in mixed] == mixed_reference
    assert any(t != "chain:0" for o in outs.values() for t in o["meta_info"]["entmtp_trees"])   # it speculated
    files = traces(trace_dir)
    assert len(files) == 2 and all(files.values()), list(files)
    if parallel[0] == "--tp-size":   # both ranks ran the same batches and chose the same tree every step
        (a_name, a), (b_name, b) = files.items()
        assert {a_name.split("-")[1], b_name.split("-")[1]} == {"tp0", "tp1"}
        assert a == b
        assert len(a) >= sum(o["meta_info"]["spec_verify_ct"] for o in outs.values())
        # the mixed batch: steps whose rows drafted different trees and verified different node counts (a resting
        # row among speculating ones), the same on both ranks (a == b)
        rids = {o["meta_info"]["id"] for o in mixed}
        per_row = [s for s in a if set(s["rids"]) & rids and len(set(s["trees"])) > 1
                   and s["state"] is not None and 1 in s.get("nodes", []) and max(s["nodes"]) > 1]
        assert per_row, [(s["trees"], s.get("nodes")) for s in a if set(s["rids"]) & rids][:20]
        print(f"tp2: {len(a)} steps on each rank, identical; {len(per_row)} mixed-batch steps with per-row trees "
              f"and node counts, e.g. {per_row[0]['trees']} {per_row[0]['nodes']}")
    else:                            # two replicas, each with its own requests
        rids = [{r for step in steps for r in step["rids"]} for steps in files.values()]
        assert not rids[0] & rids[1]
