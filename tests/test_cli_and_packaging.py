"""The command line (errors name the problem, --help explains) and what an installed wheel carries."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from entmtp_sglang.cli import main
from entmtp_sglang.model.load import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", str(BUNDLED_MODEL)]  # the bundled toy model (`entmtp generate` defaults to SmolLM2)


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--prompt", "--drafter", "--tree", "--max-new-tokens", "--temperature", "--top-p",
                 "--top-k", "--seed", "--model", "--no-speculation"):
        assert flag in text
    assert "chain:N" in text and "parent array" in text


@pytest.mark.parametrize("argv, message", [
    (["--tree=-1,0,2,1"], "node 2 is its own parent (a cycle)"),
    (["--tree=-1,1"], "node 1 is its own parent (a cycle)"),
    (["--tree=-1,2,0"], "node 1 has parent 2, which comes after it"),
    (["--tree", "0,0"], "node 0 is the root"),
    (["--tree", "chain:x"], "bad chain spec"),
    (["--tree", "chain:6"], "depth 6, beyond the 5 draft positions"),
    (["--max-new-tokens", "600"], "exceeds the model context of 512"),
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_bad_input_gets_a_clear_error(capsys, argv, message):
    code = main(["generate", *TINY, "--prompt", "def f(x):", "--drafter", "hydra"] + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, name", [
    (["--tree-set", "code"], "tree=entmtp"),
    (["--tree-set", "code", "--policy", "entmtp-bins"], "tree=entmtp:entmtp-tiny-hydra-code"),
    (["--tree-set", "math", "--policy", "entmtp-paper"], "tree=entmtp:entmtp-tiny-hydra-math"),
    (["--policy", "adaptive"], "tree=adaptive-ema"),
    (["--policy", "eagle2", "--tree", "chain:3", "--keep", "3"], "tree=eagle2[4->3]"),
    (["--tree-set", "code", "--policy", "static", "--tree", "chain:0"], "tree=chain:0"),
])
def test_every_policy_runs_from_the_cli(capsys, argv, name):
    assert main(["generate", *TINY, "--prompt", "def f(x):", "--drafter", "hydra", "--max-new-tokens", "8"] + argv) == 0
    assert name in capsys.readouterr().out


def test_tree_by_name_from_the_set_and_policy_errors(capsys, tmp_path):
    import json

    from entmtp_sglang.tree.treeset import shipped_tree_set

    data = json.loads(shipped_tree_set("hydra", "code").read_text())
    named = data["trees"][-1]["name"]
    assert main(["generate", *TINY, "--prompt", "x", "--drafter", "hydra", "--max-new-tokens", "4",
                 "--tree-set", "code", "--policy", "static", "--tree", named]) == 0
    assert f"tree={named}" in capsys.readouterr().out
    data.pop("predictor", None)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    for argv, message in [
        (["--policy", "entmtp"], "give --tree-set"),
        (["--tree-set", "code", "--tree", "chain:2"], "--tree fixes one tree"),
        (["--tree-set", str(bare), "--policy", "entmtp-predictor"], "carries no acceptance predictor"),
        (["--tree-set", str(bare), "--policy", "entmtp-paper"], "bare.records.jsonl does not exist"),
        (["--tree-set", "code", "--policy", "static", "--tree", "nope"], "the set's trees: chain:0"),
    ]:
        assert main(["generate", *TINY, "--prompt", "x", "--drafter", "hydra"] + argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_empty_prompt_is_refused(capsys):
    assert main(["generate", *TINY, "--prompt", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err


def test_generate_prints_text_and_stats(capsys):
    assert main(["generate", *TINY, "--prompt", '{"name": ', "--drafter", "medusa", "--tree=-1,0,0,1",
                 "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('{"name": ')
    assert "tokens/s=" in out and "mean_accepted=" in out and "tokens_per_target_pass=" in out


def test_wheel_carries_kernels_trees_model_and_shadows_nothing(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("entmtp_sglang-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"entmtp_sglang", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "kernels" not in tops and "trees" not in tops
    assert "entmtp_sglang/kernels/__init__.py" in names
    assert "entmtp_sglang/kernels/fewrow_linear.cpp" in names  # built on the machine that installs it
    assert any(n.startswith("entmtp_sglang/trees/") and n.endswith(".json") for n in names)
    assert "entmtp_sglang/models/entmtp-tiny/model.safetensors" in names
    assert "entmtp_sglang/models/entmtp-tiny/eagle/model.safetensors" in names
    assert "entmtp_sglang/data/prompts/code.jsonl" in names
    # test-only code stays next to the tests (tests/helpers/)
    assert not any(n.endswith(("/testing.py", "/tiny_checkpoints.py")) for n in names)


def test_public_entry_runs_entmtp_end_to_end():
    import entmtp_sglang as em

    assert set(em.__all__) >= {"Engine", "load_bundle", "load_tree_set", "entmtp_policy", "TreeController"}
    bundle = em.load_bundle(None, "hydra")
    ts = em.load_tree_set(em.shipped_tree_set("hydra", "code"))
    assert any(t.tree.num_nodes == 1 for t in ts.trees)  # chain:0 in every set
    engine = em.Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    policy = em.entmtp_policy(ts)
    prompt = bundle.text_ids("def add(a, b):")
    out = engine.generate([prompt], 16, policy, observer=policy.observe)[0]
    plain = engine.generate([prompt], 16, lambda view: em.Tree.chain(0))[0]
    assert out.output_ids == plain.output_ids
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        em.nope


def test_tracked_files_fit_what_a_gpu_check_can_carry():
    """A device run carries at most 64 MiB of the working tree: every tracked file together stays under."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    total = sum((ROOT / f).stat().st_size for f in out.stdout.split("\0") if f and (ROOT / f).is_file())
    assert total < 64 * 2**20, f"tracked files total {total / 2**20:.1f} MiB"


def test_every_committed_result_is_in_the_results_index():
    """bench/results/README.md names every result file committed beside it (one line per run)."""
    out = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    files = [Path(f).relative_to("bench/results").as_posix() for f in out.stdout.split()]
    missing = [f for f in files if f != "README.md" and f not in index]
    assert not missing, f"not in bench/results/README.md: {missing}"


def test_kernels_builds_and_names_the_path_this_machine_takes(tmp_path):
    env = {**os.environ, "ENTMTP_CACHE": str(tmp_path)}
    env.pop("ENTMTP_LINEAR", None)
    env.pop("ENTMTP_ONEDNN", None)
    out = subprocess.run([sys.executable, "-m", "entmtp_sglang.cli", "kernels"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("fewrow", "onednn", "torch")
    assert "few-row kernel: built for" in out.stderr and "batch-invariant" in out.stderr
    assert (tmp_path / "linear_path.json").exists() and list((tmp_path / "kernels").glob("fewrow-*"))


def test_without_a_compiler_the_kernel_falls_back_with_one_clear_line(tmp_path):
    env = {**os.environ, "ENTMTP_CACHE": str(tmp_path), "CXX": "/bin/false"}
    env.pop("ENTMTP_LINEAR", None)
    env.pop("ENTMTP_ONEDNN", None)
    out = subprocess.run([sys.executable, "-m", "entmtp_sglang.cli", "kernels"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("onednn", "torch")
    warnings = [line for line in out.stderr.splitlines() if "could not be built" in line]
    assert len(warnings) == 1, out.stderr
    assert "unavailable" in out.stderr


def test_generate_with_forced_spans_prints_the_same_text_and_their_stats(capsys):
    """`--forced-spans` drafts the grammar's decided text: the output is the one without it, and a line reports the
    spans; without a grammar its spans are the request's own text repeating (lookup spans), the output again the
    one without them."""
    base = ["generate", *TINY, "--prompt", "Give the record:", "--drafter", "eagle", "--max-new-tokens", "24",
            "--regex", r'\{"person": "[a-z]{1,6}", "age": [0-9]{1,2}\}']
    assert main(base) == 0
    plain = capsys.readouterr().out.split("[stats]")[0]
    assert main(base + ["--forced-spans", "--max-span", "8"]) == 0
    out = capsys.readouterr().out
    assert out.split("[stats]")[0] == plain
    assert "[forced] spans=" in out and "[forced] spans=0 " not in out and "share_of_output=" in out
    free = ["generate", *TINY, "--prompt", "def f(x): return x\ndef g(x): return x\ndef h(x): return x\ndef",
            "--drafter", "eagle", "--max-new-tokens", "24"]
    assert main(free) == 0
    plain = capsys.readouterr().out.split("[stats]")[0]
    assert main(free + ["--forced-spans"]) == 0
    out = capsys.readouterr().out
    assert out.split("[stats]")[0] == plain
    assert "[forced] spans=" in out


def test_the_readme_stays_a_front_page():
    """README.md is the product's front page (issue 58): at most 300 lines; the details live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
