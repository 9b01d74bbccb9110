"""`entmtp bench`: the harness on the bundled model with tiny settings (rows, table, JSON lines, plots),
greedy losslessness of every speculative system, the registry, and EntMTP's back-off. No timing asserts."""

from __future__ import annotations

import json

import pytest

from entmtp_sglang.bench.config import BenchConfig
from entmtp_sglang.bench.reference import with_measured_costs
from entmtp_sglang.bench.report import markdown, write_all
from entmtp_sglang.bench.runner import OVERALL, run_bench
from entmtp_sglang.bench.systems import RequestOutcome, System, SystemError_, make_system, register_system, registry
from entmtp_sglang.bench.workload import BenchContext, build_streams
from entmtp_sglang.cli import main as cli_main
from entmtp_sglang.policy.selector import select_tree
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import TreeEntry, TreeSet

TASKS = ("mixed",)  # three turns: prose, JSON, code
BATCHES = (1, 2)


@pytest.fixture(scope="module")
def small_run():
    """Every registered system on the three-turn mixed session, batch 1 and 2 (a few tokens each)."""
    cfg = BenchConfig(tasks=TASKS, systems=tuple(registry()), batch_sizes=BATCHES, repeats=1, max_new_tokens=6,
                      prompts=1, cost_steps=1, cost_rounds=1, warmup=False, max_prompt_tokens=48, name="test", threads=1)
    return run_bench(cfg, progress=False, log=lambda *a: None)


def test_rows_cover_every_task_system_and_batch(small_run):
    rows = {(r["task"], r["system"], r["batch"]): r for r in small_run.rows}
    for name in registry():
        for b in BATCHES:
            if name.startswith("hf-") and b > 1:
                assert "batch 1 only" in rows[(OVERALL, name, b)]["skipped"]
                continue
            for task in TASKS + (OVERALL,):
                r = rows[(task, name, b)]
                assert r["tokens_per_s"] > 0 and r["tokens"] > 0
                assert r["baseline"] in ("plain", "hf-greedy")
                if name == r["baseline"]:
                    assert r["speedup"] == pytest.approx(1.0)
                    assert r["mean_accepted"] == 0
                else:
                    assert r["speedup"] > 0
                assert r["verified_per_token"] >= 1.0 - 1e-9
                if r["engine"] == "reference":
                    assert r["policy_us_per_step"] is not None and r["policy_us_per_step"] >= 0
                    assert sum(r["trees_chosen"].values()) == r["steps"]
    assert rows[("mixed", "plain", 1)]["streams"] == 1 and rows[("mixed", "plain", 2)]["streams"] == 2
    assert rows[("mixed", "plain", 1)]["max_new_tokens"] == 6


def test_every_speculative_system_is_lossless(small_run):
    """Greedy: each system's tokens equal its engine's plain decoding on every request, batch 1 and 2."""
    for r in small_run.rows:
        if "skipped" in r or r["system"] == r["baseline"]:
            continue
        assert r["lossless"] == 1.0, f"{r['system']} {r['task']} b{r['batch']}"
    # and directly: the same (task, batch, stream, segment) gives the same tokens in every reference system
    outs: dict[tuple, dict[str, list[int]]] = {}
    for m in small_run.measurements:
        for o in m.outcomes:
            outs.setdefault((m.task, m.batch_size, o.stream, o.segment), {})[m.system] = o.output_ids
    for key, by_system in outs.items():
        plain = by_system["plain"]
        assert len(plain) > 0
        for name, ids in by_system.items():
            if not name.startswith("hf-"):
                assert ids == plain, (key, name)
        if "hf-prompt-lookup" in by_system:
            assert by_system["hf-prompt-lookup"] == by_system["hf-greedy"], key
    assert {k[3] for k in outs if k[0] == "mixed"} == {0, 1, 2}  # three turns per mixed stream


def test_table_jsonl_and_plots(small_run, tmp_path):
    files = write_all(small_run, tmp_path)
    md = files["md"].read_text()
    assert md == markdown(small_run)
    for name in registry():
        assert f" {name} |" in md
    for b in BATCHES:
        assert f"### Batch {b}: speedup over plain decoding" in md
    assert "### entmtp-hydra: ratios, cost and choices" in md and "vs oracle-hydra" in md
    lines = [json.loads(x) for x in files["jsonl"].read_text().splitlines()]
    run, results = lines[0], lines[1:]
    assert run["kind"] == "run" and run["commit"] and run["machine"]["cpu_count"] >= 1
    assert run["config"]["tasks"] == list(TASKS) and run["config"]["batch_sizes"] == list(BATCHES)
    assert run["step_costs"] and run["tree_sets"]
    assert all(any(e["nodes"] == 1 for e in entries) for entries in run["tree_sets"].values())
    need = {"task", "system", "engine", "baseline", "batch", "tokens_per_s", "speedup", "mean_accepted",
            "verified_per_token", "policy_us_per_step", "trees_chosen", "lossless", "repeats_tokens_per_s",
            "commit", "config", "machine"}
    assert results and all(r["kind"] == "result" for r in results)
    for r in results:
        if "skipped" not in r:
            assert need <= set(r), need - set(r)
    for k in ("speedup", "entropy_trace", "accepted_vs_entropy"):
        assert files[k].exists() and files[k].stat().st_size > 1000


def test_streams_come_from_the_test_split_and_fit_the_context():
    from tokenizers import Tokenizer

    from entmtp_sglang.model.load import BUNDLED_MODEL
    from entmtp_sglang.tasks import load_prompts

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    prose = build_streams("prose", 25, tok, 512, 64)  # prose has 20 test prompts: reused in order
    assert len(prose) == 25 and all(len(s.segments) == 1 for s in prose)
    test_ids = [it["id"] for it in load_prompts("prose", "test")]
    assert [s.source_ids[0] for s in prose] == [test_ids[i % len(test_ids)] for i in range(25)]
    assert all(0 < len(s.segments[0]) <= 512 - 64 - 8 for s in prose)
    with pytest.raises(ValueError, match="plain_generate"):
        build_streams("mixed", 1, tok, 512, 64)
    with pytest.raises(ValueError, match="unknown task"):
        build_streams("poetry", 1, tok, 512, 64)


def test_with_measured_costs_backs_off_to_plain_when_verification_is_dear():
    deep = Tree.chain(4)
    ts = TreeSet("m", "hydra", "code", "draft_entropy", (1.0,),
                 (TreeEntry(deep, (2.0, 0.1), {1: 0.01}),))
    # batch 1: the deep chain costs 1.2x plain; batch 32: 3.4x plain
    costs = {1: lambda t: 0.010 * (1 + 0.05 * (t.num_nodes - 1)), 32: lambda t: 0.030 * (1 + 0.6 * (t.num_nodes - 1))}
    out = with_measured_costs(ts, costs)
    assert [e.tree.num_nodes for e in out.trees] == [1, 5]
    assert out.trees[0].expected_accepted == (0.0, 0.0)
    assert out.trees[1].cost(32) == pytest.approx(0.030 * 3.4)
    names = lambda h, b: out.trees[select_tree(out, h, b)].tree.name  # noqa: E731
    assert names(0.5, 1) == deep.name  # predictable text, small batch: speculate deep
    assert names(2.0, 1) == "chain:0"  # 1.1 / 1.2 < 1: not worth it even at batch 1
    assert names(0.5, 32) == "chain:0"  # 3.0 / 3.4 < 1: plain decoding at batch 32
    assert with_measured_costs(out, costs).trees == out.trees  # chain:0 is not added twice


class _Echo(System):
    baseline = "plain"

    def run(self, streams, batch_size, max_new_tokens):
        return [RequestOutcome(i, j, list(seg[:1]), 0, 0, 0, 0.0, 0.0) for i, s in enumerate(streams)
                for j, seg in enumerate(s.segments)]


def test_registry_adds_a_system_in_one_place_and_checks_it():
    ctx = BenchContext()
    register_system("test-echo", engine="test", description="echo the first prompt token")(lambda c: _Echo())
    try:
        s = make_system("test-echo", ctx)
        assert (s.name, s.engine, s.baseline) == ("test-echo", "test", "plain")
        assert "test-echo" in registry()
        with pytest.raises(SystemError_, match="twice"):
            register_system("test-echo", "test", "again")(lambda c: _Echo())
    finally:
        from entmtp_sglang.bench import systems

        systems._REGISTRY.pop("test-echo", None)
    register_system("test-bad", "test", "not a system")(lambda c: object())
    try:
        with pytest.raises(SystemError_, match="not a System"):
            make_system("test-bad", ctx)
    finally:
        from entmtp_sglang.bench import systems

        systems._REGISTRY.pop("test-bad", None)
    with pytest.raises(SystemError_, match="unknown system"):
        make_system("no-such-system", ctx)


def test_cli_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--quick", "--tasks", "--systems", "--batch-sizes", "--repeats", "--max-new-tokens", "--out"):
        assert opt in text
    assert cli_main(["bench", "--tasks", "poetry"]) == 2
    assert "unknown task(s) poetry" in capsys.readouterr().err
    assert cli_main(["bench", "--systems", "plain,warp-drive"]) == 2
    assert "unknown system(s) warp-drive" in capsys.readouterr().err
    assert cli_main(["bench", "--list-systems"]) == 0
    assert "entmtp-hydra" in capsys.readouterr().out
