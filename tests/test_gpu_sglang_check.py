"""bench/gpu_sglang_check.sh as far as it goes without a GPU: the dry run's launch lines (SGLang's default
flags: nothing for the device, the overlap scheduler or the attention backend) and requests, and the helper's
measuring and verdict on canned /generate responses."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from entmtp_sglang.bench.sglang_benchmark import generate_payload, measure

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_sglang_check.sh"


def load_helper():
    spec = importlib.util.spec_from_file_location("gpu_sglang_check", REPO / "bench" / "gpu_sglang_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_check(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_prints_default_flag_launch_lines_and_the_requests(tmp_path):
    res = run_check("--dry-run", "--python", sys.executable, str(tmp_path / "out"), "--", "--prompts", "10")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    launches = dict(re.findall(r"^launch (\S+): (.*)$", out, re.M))
    assert list(launches) == ["plain", "eagle-s3-k1-n4", "entmtp"]
    for line in launches.values():
        assert " -m sglang.launch_server --model-path " in line and "smollm2-135m-instruct" in line
        for flag in ("--device", "--disable-overlap-schedule", "--attention-backend", "--disable-cuda-graph",
                     "--speculative-draft-attention-backend", "--dtype"):
            assert flag not in line   # SGLang's defaults on the GPU
    assert "--speculative" not in launches["plain"]
    assert ("--speculative-algorithm EAGLE --speculative-draft-model-path " in launches["eagle-s3-k1-n4"]
            and "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
            in launches["eagle-s3-k1-n4"])
    entmtp = launches["entmtp"]
    assert "--speculative-algorithm ENTMTP --speculative-draft-model-path " in entmtp
    assert re.search(r"--speculative-draft-model-path \S+/eagle --speculative-token-map \S+/eagle/draft_vocab\.pt"
                     r" --port \d+$", entmtp)
    assert "--speculative-num-steps" not in entmtp   # the tree set sizes ENTMTP's buffers
    assert ('requests: 10 greedy POST /generate per server and batch size, e.g. {"text": "<prompt 1, '
            in out and '"sampling_params": {"temperature": 0.0, "max_new_tokens": 64}}' in out)
    assert "batches: 1, 8, 32 requests in flight" in out
    assert "model path smollm2" in out and "model token-map smollm2" in out
    assert not (tmp_path / "out").exists()   # nothing written, nothing started


@pytest.mark.parametrize("args,message", [
    ([], "usage: bash bench/gpu_sglang_check.sh"),
    (["--bogus", "x"], "unknown option --bogus"),
    (["a", "b"], "usage:"),
    (["--python", "/nonexistent/python", "out"], "no python at /nonexistent/python"),
])
def test_bad_arguments(args, message):
    res = run_check(*args, timeout=30)
    assert res.returncode == 2 and message in res.stderr


class CannedServer:
    """Answers /generate with the token ids of `outputs` (one list per prompt, in order of the prompts)."""

    def __init__(self, outputs: dict[str, list[int]], speculative: bool = False, trees=("b0n3d2",)):
        self.outputs, self.speculative, self.trees = outputs, speculative, list(trees)

    def post(self, path, payload):
        assert path == "/generate" and payload["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 4}
        ids = self.outputs[payload["text"]]
        meta = {"completion_tokens": len(ids)}
        if self.speculative:
            meta.update(spec_verify_ct=2, spec_accept_length=2.0, entmtp_trees=self.trees)
        return {"output_ids": ids, "meta_info": meta}


def test_measure_and_verdict_on_canned_responses():
    helper = load_helper()
    plain_ids = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    reference: dict[tuple[str, int], list] = {}
    rows = []
    payloads = [generate_payload(p, 4) for p in ("a", "b")]
    for b in (1, 2):
        rows.append(measure(CannedServer(plain_ids), helper.PLAIN, payloads, b, reference))
        rows.append(measure(CannedServer({"a": [1, 2, 3, 4], "b": [5, 6, 7, 9]}, True), helper.EAGLE_STATIC,
                            payloads, b, reference))
        rows.append(measure(CannedServer(plain_ids if b == 1 else {"a": [1, 2, 0, 0], "b": [5, 6, 7, 9]}, True),
                            helper.ENTMTP, payloads, b, reference))
    assert reference == {("", 1): [[1, 2, 3, 4], [5, 6, 7, 8]], ("", 2): [[1, 2, 3, 4], [5, 6, 7, 8]]}
    by = {(r.system, r.batch): r for r in rows}
    assert [by[("entmtp", 1)].equal_to_plain, by[("eagle-s3-k1-n4", 1)].equal_to_plain] == [2, 1]
    assert by[("entmtp", 2)].equal_to_plain == 0 and by[("plain", 1)].equal_to_plain is None
    assert by[("entmtp", 1)].tokens == 8 and by[("entmtp", 1)].trees == {"b0n3d2": 2}
    assert by[("entmtp", 1)].mean_accept == 2.0 and by[("plain", 1)].mean_accept is None
    assert by[("entmtp", 1)].tokens_per_s > 0
    # batch 1: ENTMTP 2/2 >= EAGLE 1/2; batch 2: 0/2 < 1/2; a server that did not start fails the check too
    found = helper.problems(rows, {"plain": None, "eagle-s3-k1-n4": "failed: SGLang exited"})
    assert found == ["eagle-s3-k1-n4: failed: SGLang exited",
                     "batch 2: ENTMTP's greedy output equals plain decoding's for 0/2 prompts (EAGLE 1/2)"]
    assert helper.problems([r for r in rows if r.batch == 1], {}) == []
    assert helper.problems([r for r in rows if r.batch == 1 and r.system != "entmtp"], {}) == []
    strict = helper.problems([r for r in rows if r.batch == 1], {}, strict=True)
    assert strict == []   # ENTMTP's outputs all equal plain's at batch 1
    by[("entmtp", 1)].equal_to_plain = 1
    assert helper.problems([r for r in rows if r.batch == 1], {}, strict=True) == [
        "batch 1: ENTMTP's greedy output equals plain decoding's for 1/2 prompts (EAGLE 1/2)"]


def test_gpu_args_only_add_the_speculative_flags(tmp_path):
    helper = load_helper()
    model = tmp_path / "m"
    assert helper.gpu_args(helper.PLAIN, model, None) == ["--model-path", str(model), "--log-level", "info"]
    assert helper.gpu_args(helper.ENTMTP, model, None, ("--dtype", "float32"))[-4:] == [
        "--speculative-draft-model-path", str(model / "eagle"), "--dtype", "float32"]
