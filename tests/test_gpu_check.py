"""bench/gpu_check.sh as far as it goes without a GPU: its arguments, the wheel install from a local folder
(a tiny wheel built here) into a temporary target, the GPU test selections (collected, not run), and the
cost-table writer on CPU tensors with a tiny shape, whose JSON calibration can read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from entmtp_sglang.calibrate.cost_table import DRAFTERS, load_cost_table

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"


def run_check(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory) -> Path:
    """A wheel of a one-module package, built here with pip (no index)."""
    root = tmp_path_factory.mktemp("tinywheel")
    src = root / "src"
    (src / "tinywheel").mkdir(parents=True)
    (src / "tinywheel" / "__init__.py").write_text("VALUE = 42\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tinywheel"\nversion = "0.0.1"\n[tool.setuptools]\npackages = ["tinywheel"]\n')
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=120)
    assert [p.name for p in wheels.iterdir()] == ["tinywheel-0.0.1-py3-none-any.whl"]
    return wheels


def test_dry_run(tiny_wheel, tmp_path):
    out = tmp_path / "out"
    res = run_check("--dry-run", "--wheels", str(tiny_wheel), "--python", sys.executable, str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary[:4]] == [["install", "ok"], ["kernels", "ok"], ["costs", "ok"],
                                                          ["engine", "ok"]]
    assert "0 step(s) failed" in summary[-1]
    # the tiny wheel went into the temporary target, this package too, and they were imported from there
    env = (out / "env.txt").read_text()
    assert "tinywheel 0.0.1 (brought as a wheel)" in env and "entmtp-sglang 0.1.0" in env
    install = (out / "install.log").read_text()
    assert "installed 1 wheel(s)" in install and "entmtp_sglang from /" in install and "/site/" in install
    # the GPU selections exist and import from the installed package
    kernels, engine = (out / "kernels.log").read_text(), (out / "engine.log").read_text()
    assert "test_kernels.py::test_entropy_triton_vs_torch_sweep" in kernels
    assert "test_tree_attention.py::test_flashinfer_tree_attention_matches_torch" in kernels
    assert "test_greedy_speculation_equals_plain_quick[cuda-flashinfer-eagle]" in engine
    assert "test_sampled_speculation_keeps_the_bundled_models_distribution[cuda-sdpa]" in engine
    assert "[cpu" not in engine  # -m gpu: the CPU variants are not part of the GPU step
    # the cost table: CPU tensors, tiny shape, every size, batch and drafter, readable by calibration
    raw = json.loads((out / "gpu_costs.json").read_text())
    assert raw["complete"] and raw["timer"] == "perf_counter" and raw["versions"]["torch"]
    table = load_cost_table(out / "gpu_costs.json")
    assert [m.name for m in table.models] == ["tiny"] and table.context_tokens == 16
    target = {(r.batch, r.size) for r in table.rows if r.what == "target_forward"}
    assert target == {(b, n) for b in (1, 2) for n in (1, 2, 4)}
    assert {r.drafter for r in table.rows if r.what == "drafter_level"} == set(DRAFTERS)
    assert "| tiny | torch | 2 |" in (out / "costs.log").read_text()


@pytest.mark.parametrize("args,message", [
    ([], "usage: bash bench/gpu_check.sh"),
    (["--bogus", "x"], "unknown option --bogus"),
    (["a", "b"], "usage:"),
    (["--wheels", "/nonexistent/wheels", "out"], "no wheel folder /nonexistent/wheels"),
    (["--python", "/nonexistent/python", "--wheels", "bench", "out"], "no python at /nonexistent/python"),
])
def test_bad_arguments(args, message):
    res = run_check(*args, timeout=30)
    assert res.returncode == 2 and message in res.stderr
