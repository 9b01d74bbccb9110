"""ENTMTP under SGLang's tensor parallelism (--tp-size 2) and data parallelism (--dp-size 2) on this CPU.

Plain SGLang 0.5.23 runs both on CPU (gloo) given two settings (docs/parallelism.md):
`SGLANG_CPU_OMP_THREADS_BIND` (one core set per rank: SGLang refuses more ranks than NUMA nodes without it) and
`SGLANG_NCCL_SO_PATH` naming no library (a CUDA build of torch ships libnccl, and SGLang's PyNcclCommunicator
then binds the CPU device with `torch.cuda.device` and fails). Each rank of an ENTMTP server chooses its
own tree from its own logits; `ENTMTP_TREE_TRACE` makes every rank write its choices, compared here.
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
CPU_RANKS_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ps = [it["prompt"][-600:] for task in ("code", "chat", "math", "prose", "json")
          for it in load_prompts(task, "test", 1)]
    srv = SGLangServer.cpu(None, attention="torch_native", extra=("--dtype", "float32"),
                           log_path=tmp_path_factory.mktemp("plain") / "plain.log")
    with srv:
        return {p: srv.generate(p, MAX_NEW)["output_ids"] for p in ps}


def traces(trace_dir: Path) -> dict[str, list[dict]]:
    return {f.name: [json.loads(ln) for ln in f.read_text().splitlines()]
            for f in sorted(trace_dir.glob("trees-*.jsonl"))}


@pytest.mark.parametrize("parallel", [("--tp-size", "2"), ("--dp-size", "2")], ids=["tp2", "dp2"])
def test_entmtp_with_two_ranks_equals_plain_decoding(reference, tmp_path, parallel):
    trace_dir = tmp_path / "trees"
    srv = SGLangServer.cpu("ENTMTP", extra=("--dtype", "float32", *parallel), log_path=tmp_path / "entmtp.log",
                           env={**CPU_RANKS_ENV, "ENTMTP_TREE_TRACE": str(trace_dir)})
    with srv:
        outs = {p: srv.generate(p, MAX_NEW) for p in reference}
        with cf.ThreadPoolExecutor(8) as pool:       # batches of several requests, too
            burst = list(pool.map(lambda p: srv.generate(p, MAX_NEW), list(reference) * 2))
    assert {p: o["output_ids"] for p, o in outs.items()} == reference
    assert [o["output_ids"] for o in burst] == [reference[p] for p in list(reference) * 2]
    assert any(t != "chain:0" for o in outs.values() for t in o["meta_info"]["entmtp_trees"])   # it speculated
    files = traces(trace_dir)
    assert len(files) == 2 and all(files.values()), list(files)
    if parallel[0] == "--tp-size":   # both ranks ran the same batches and chose the same tree every step
        (a_name, a), (b_name, b) = files.items()
        assert {a_name.split("-")[1], b_name.split("-")[1]} == {"tp0", "tp1"}
        assert a == b
        assert len(a) >= sum(o["meta_info"]["spec_verify_ct"] for o in outs.values())
    else:                            # two replicas, each with its own requests
        rids = [{r for step in steps for r in step["rids"]} for steps in files.values()]
        assert not rids[0] & rids[1]
