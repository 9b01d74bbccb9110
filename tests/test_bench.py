"""`entmtp bench`: the harness on the bundled model with tiny settings (rows, table, JSON lines, plots),
greedy losslessness of every speculative system, the registry, and EntMTP's back-off; the SGLang systems
against a fake server (request grouping, counts, skipping, servers always stopped) and, marked `sglang`
and `slow`, against real SGLang servers. No timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entmtp_sglang.bench.config import SGLANG_SYSTEMS, BenchConfig
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


def in_process_systems() -> tuple[str, ...]:
    """Every registered system that runs in this process (the SGLang ones start servers) on the bundled model: the
    eagle3 systems need tree sets of the EAGLE-3 drafter, which only SmolLM2 ships."""
    return tuple(n for n, spec in registry().items() if spec.engine != "sglang" and "-eagle3" not in n)


@pytest.fixture(scope="module")
def small_run():
    """Every registered system on the three-turn mixed session, batch 1 and 2 (a few tokens each)."""
    cfg = BenchConfig(tasks=TASKS, systems=in_process_systems(), batch_sizes=BATCHES, repeats=1, max_new_tokens=6,
                      prompts=1, cost_steps=1, cost_rounds=1, warmup=False, max_prompt_tokens=48, name="test",
                      threads=1)
    return run_bench(cfg, progress=False, log=lambda *a: None)


def test_rows_cover_every_task_system_and_batch(small_run):
    rows = {(r["task"], r["system"], r["batch"]): r for r in small_run.rows}
    for name in in_process_systems():
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
    for name in in_process_systems():
        assert f" {name} |" in md
    for b in BATCHES:
        assert f"### Batch {b}, reference engine: speedup over `plain`" in md
    assert "### Batch 1, transformers: speedup over `hf-greedy`" in md
    assert "### Overall (all tasks pooled)" in md and "| entmtp-hydra | reference | " in md
    assert "| hf-prompt-lookup | transformers | " in md and md.count(" tok/s |") >= 2
    assert "### Batch 2, transformers" not in md  # every transformers system is n/a at batch 2
    assert "batch 1 only" in md
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


def test_the_report_names_the_processor_and_compares_outputs_across_engines(small_run):
    """The header names the processor with its AVX/AMX flags; at batch 1 every system stands beside transformers'
    generate, and every output is compared with both engines' plain decoding (same prompt token ids)."""
    from entmtp_sglang.bench.processor import describe, processor_info

    md = markdown(small_run)
    cpu = processor_info()
    assert small_run.meta["machine"]["processor"] == describe(cpu)
    assert f"Processor: {describe(cpu)}, " in md
    assert "### Side by side at batch 1 on the bundled entmtp-tiny: tokens/s across engines" in md
    assert "| vs `hf-greedy` (same repeat) | outputs = `plain` | outputs = `hf-greedy` |" in md
    rows = {(r["task"], r["system"], r["batch"]): r for r in small_run.rows}
    for name in ("entmtp-hydra", "hf-prompt-lookup", "hf-greedy", "plain"):
        r = rows[(OVERALL, name, 1)]
        n = sum(len(m.outcomes) for m in small_run.measurements if m.system == name and m.batch_size == 1
                and m.repeat == 0)
        own = r["baseline"]
        assert set(r["equal_to"]) == {"plain", "hf-greedy"} - {name}, r["equal_to"]
        for ref, (eq, total) in r["equal_to"].items():
            assert total == n and 0 <= eq <= total
            if ref == own:      # its own engine's plain decoding: lossless
                assert eq == total
    plain_row = next(ln for ln in md.splitlines() if ln.startswith("| plain | reference | "))
    hf = rows[(OVERALL, "hf-greedy", 1)]["equal_to"]["plain"]
    assert plain_row.endswith(f"| - | {hf[0]}/{hf[1]} |"), plain_row
    assert "The reference engine's plain decoding runs at " in md


def test_the_side_by_side_divides_by_transformers_in_the_same_repeat():
    """Reference plain at 20 and 40 tok/s beside hf-greedy at 10 and 40 in the same repeats: 1.50x (the median of 2.0
    and 1.0), not the 1.20x of the medians; output counts come from each row's `equal_to`."""
    from entmtp_sglang.bench.report import side_by_side
    from entmtp_sglang.bench.runner import BenchResult

    cfg = BenchConfig(tasks=("code",), systems=("plain", "hf-greedy"), batch_sizes=(1,), name="test")
    meta = {"systems": {"plain": {"engine": "reference", "baseline": "plain"},
                        "hf-greedy": {"engine": "transformers", "baseline": "hf-greedy"}}}

    def row(task, system, tps, eq):
        return {"task": task, "system": system, "batch": 1, "tokens_per_s": sum(tps) / 2,
                "repeats_tokens_per_s": list(tps), "equal_to": eq}

    rows = [row(t, "plain", (20.0, 40.0), {"hf-greedy": [3, 4]}) for t in ("code", OVERALL)]
    rows += [row(t, "hf-greedy", (10.0, 40.0), {"plain": [3, 4]}) for t in ("code", OVERALL)]
    lines = side_by_side(BenchResult(cfg, meta, rows))
    assert "| plain | reference | 30.0 | 30.0 | 1.50x | - | 3/4 |" in lines, lines
    assert "| hf-greedy | transformers | 25.0 | 25.0 | 1.00x | 3/4 | - |" in lines, lines
    assert any(ln.startswith("The reference engine's plain decoding runs at 1.50x") for ln in lines)
    one_engine = {"systems": {"plain": meta["systems"]["plain"]}}
    assert side_by_side(BenchResult(cfg, one_engine, rows[:2])) == []


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


# -- SGLang systems ------------------------------------------------------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from entmtp_sglang.bench import sglang_systems  # noqa: E402
from entmtp_sglang.bench.cli import add_parser, config_from_args  # noqa: E402
from entmtp_sglang.bench.sglang_benchmark import (  # noqa: E402
    ADAPTIVE,
    ENTMTP,
    PLAIN,
    ServerPool,
    SystemSpec,
    spec_counts,
)
from entmtp_sglang.bench.systems import Stream, TaskStreams  # noqa: E402
from entmtp_sglang.calibrate.server import ServerError, SGLangServer  # noqa: E402

EAGLE = sglang_systems.EAGLE_STATIC


def test_spec_counts_reads_each_kind_of_response():
    plain = spec_counts({"meta_info": {"completion_tokens": 9}}, PLAIN)
    assert (plain.steps, plain.accepted_drafts, plain.verified_tokens, plain.trees) == (8, 0, 8, {})
    # EAGLE static chain of 3 (4 tokens verified per step): 3 steps, 5 drafts accepted
    m = {"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 5, "spec_accept_length": 3.0}
    eagle = spec_counts({"meta_info": m}, EAGLE)
    assert (eagle.steps, eagle.accepted_drafts, eagle.verified_tokens, eagle.trees) == (3, 5, 12, {EAGLE.name: 3})
    # adaptive: the depth of each step is internal to SGLang, so verified tokens are not known
    adaptive = spec_counts({"meta_info": m}, ADAPTIVE)
    assert (adaptive.steps, adaptive.accepted_drafts, adaptive.verified_tokens) == (3, 5, None)
    # ENTMTP: its per-step trees (with plain-decoding steps) and accepted drafts
    m = {"completion_tokens": 7, "spec_verify_ct": 3, "entmtp_trees": ["b0n4d3", "plain", "b0n4d3", "chain:0"],
         "entmtp_accepted": [2, 0, 1, 0]}
    ent = spec_counts({"meta_info": m}, ENTMTP, {"b0n4d3": 4, "chain:0": 1})
    assert (ent.steps, ent.accepted_drafts, ent.verified_tokens) == (4, 3, 10)
    assert ent.trees == {"b0n4d3": 2, "plain": 1, "chain:0": 1} and ent.accepted_per_step == [2, 0, 1, 0]
    assert spec_counts({"meta_info": m}, ENTMTP, {}).verified_tokens is None  # a tree it does not know
    # a request that the prefill already finished (one token, e.g. EOS): no steps, nothing verified
    for spec in (EAGLE, ADAPTIVE, ENTMTP):
        c = spec_counts({"meta_info": {"completion_tokens": 1}}, spec, {"b0n4d3": 4})
        assert (c.steps, c.accepted_drafts, c.verified_tokens) == (0, 0, 0), spec.name


class FakeServer:
    """Answers /generate like SGLang: echoes the last prompt token `max_new_tokens` times; counts requests
    in flight; ENTMTP-style meta_info when asked to."""

    def __init__(self, entmtp: bool = False, delay_s: float = 0.02):
        self.entmtp, self.delay_s = entmtp, delay_s
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.flushes = 0
        self.running = True
        self.stopped = False

    def post(self, path, payload=None, timeout_s=600.0):
        if path == "/flush_cache":
            self.flushes += 1
            return {}
        assert path == "/generate" and payload["sampling_params"]["temperature"] == 0.0
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.requests.append(payload)
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
        n = payload["sampling_params"]["max_new_tokens"]
        meta = {"completion_tokens": n}
        if self.entmtp:
            meta.update(entmtp_trees=["b0n4d3"] * (n // 2), entmtp_accepted=[1] * (n // 2),
                        spec_verify_ct=n // 2, spec_num_correct_drafts=n // 2)
        return {"output_ids": [payload["input_ids"][-1]] * n, "meta_info": meta}

    def flush_cache(self):
        self.post("/flush_cache")

    def stop(self):
        self.stopped, self.running = True, False


class FakePool:
    def __init__(self, servers):
        self.servers, self.added, self.stopped = servers, [], 0
        self.start_seconds, self.log_dir = 1.0, __import__("pathlib").Path("/tmp")

    def add(self, spec):
        self.added.append(spec.name)

    def __getitem__(self, name):
        return self.servers[name]

    def stop(self):
        self.stopped += 1
        for s in self.servers.values():
            s.stop()


def _streams(n: int, segments: int = 1) -> TaskStreams:
    return TaskStreams("t", tuple(Stream(tuple((i, 100 + 10 * i + j) for j in range(segments)),
                                         ("",) * segments, (f"s{i}",)) for i in range(n)))


def test_sglang_system_sends_b_concurrent_requests_per_segment(monkeypatch):
    monkeypatch.setattr(sglang_systems, "sglang_missing", lambda: None)
    ctx = BenchContext()
    srv = FakeServer(entmtp=True)
    ctx.cache["sglang"] = FakePool({ENTMTP.name: srv})
    system = make_system("sglang-entmtp", ctx)
    assert (system.engine, system.baseline) == ("sglang", "sglang-plain")
    system.prepare(_streams(5, 3), (1, 4), 6)
    assert ctx.cache["sglang"].added == [ENTMTP.name]
    out = system.run(_streams(5, 3), 4, 6)  # streams 0-3 together, then stream 4; three segments each
    assert srv.flushes == 1 and srv.max_in_flight == 4
    # segment j of the first four streams is one call, then segment j + 1, ...; then stream 4 alone
    assert [(o.stream, o.segment) for o in out] == [(i, j) for j in range(3) for i in range(4)] + [
        (4, 0), (4, 1), (4, 2)]
    assert [r["input_ids"] for r in srv.requests[:4]] == [[i, 100 + 10 * i] for i in range(4)]  # token ids
    for o in out:
        assert o.output_ids == [100 + 10 * o.stream + o.segment] * 6
        assert (o.steps, o.accepted_drafts, o.verified_tokens, o.trees) == (3, 3, 12, {"b0n4d3": 3})
        assert o.policy_seconds is None and 0 < o.seconds <= o.call_seconds
    first = [o for o in out if o.stream < 4 and o.segment == 0]
    assert len({o.call_seconds for o in first}) == 1  # one batched call
    assert first[0].seconds == pytest.approx(first[0].call_seconds / 4)
    rec = system.record()
    assert rec["server"]["algorithm"] == "ENTMTP" and rec["tree_set"].endswith(".json")
    system.close()
    assert srv.stopped


def test_sglang_systems_are_skipped_with_a_message_without_sglang(monkeypatch):
    monkeypatch.setattr(sglang_systems.importlib.util, "find_spec", lambda name: None)
    assert "make sglang" in sglang_systems.sglang_missing()
    logs = []
    cfg = BenchConfig(tasks=("code",), systems=("plain",) + SGLANG_SYSTEMS, batch_sizes=(1,), repeats=1,
                      max_new_tokens=3, prompts=1, cost_steps=1, cost_rounds=1, warmup=False, max_prompt_tokens=32,
                      name="test")
    res = run_bench(cfg, progress=False, log=logs.append)
    for name in SGLANG_SYSTEMS:
        assert any(line.startswith(f"skipping {name}: SGLang is not installed") for line in logs), logs
        row = next(r for r in res.rows if r["system"] == name)
        assert "make sglang" in row["skipped"]
    md = markdown(res)
    assert "SGLang is not installed" in md and "| sglang-entmtp |" not in md
    assert any(r["system"] == "plain" and r.get("tokens_per_s") for r in res.rows)


class _Boom(System):
    baseline = "plain"

    def __init__(self, exc):
        self.exc, self.closed = exc, 0

    def run(self, streams, batch_size, max_new_tokens):
        raise self.exc

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("exc", [RuntimeError("server died"), KeyboardInterrupt()])
def test_every_system_is_closed_when_a_run_fails(monkeypatch, exc):
    """A failing system (or Ctrl-C) still closes every system, so SGLang servers are always stopped."""
    made = {}
    monkeypatch.setattr(sglang_systems, "sglang_missing", lambda: None)
    register_system("test-boom", "test", "raises")(lambda c: made.setdefault("boom", _Boom(exc)))
    srv = FakeServer()
    pools = []

    def pool(ctx):
        if "sglang" not in ctx.cache:
            ctx.cache["sglang"] = FakePool({PLAIN.name: srv})
            pools.append(ctx.cache["sglang"])
        return ctx.cache["sglang"]

    monkeypatch.setattr(sglang_systems, "server_pool", pool)
    try:
        cfg = BenchConfig(tasks=("code",), systems=("sglang-plain", "test-boom"), batch_sizes=(1,), repeats=1,
                          max_new_tokens=3, prompts=1, cost_steps=1, cost_rounds=1, warmup=False,
                          max_prompt_tokens=32, name="test")
        with pytest.raises(type(exc)):
            run_bench(cfg, progress=False, log=lambda *a: None)
    finally:
        from entmtp_sglang.bench import systems

        systems._REGISTRY.pop("test-boom", None)
    assert made["boom"].closed == 1
    assert pools and pools[0].stopped >= 1 and srv.stopped


class _FakeSpec:
    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail

    def server(self, log_dir, device_args):
        outer = self

        class S(FakeServer):
            log_path = log_dir / f"{outer.name}.log"

            def start(self, wait=True):
                return self

            def wait_ready(self):
                if outer.fail:
                    raise ServerError(f"{outer.name} exited during start-up")

            def generate(self, text, n):
                return {}

        srv = S()
        started.append(srv)
        return srv


started: list = []


def test_server_pool_starts_all_and_stops_all_also_when_one_fails(tmp_path):
    started.clear()
    pool = ServerPool(tmp_path, progress=lambda *a: None)
    for spec in (_FakeSpec("a"), _FakeSpec("b")):
        pool.add(spec)
    with pool:
        assert set(pool.servers) == {"a", "b"} and pool["a"] is started[0]
    assert all(s.stopped for s in started) and not pool.servers
    started.clear()
    pool = ServerPool(tmp_path, progress=lambda *a: None)
    for spec in (_FakeSpec("a"), _FakeSpec("b", fail=True), _FakeSpec("c")):
        pool.add(spec)
    with pytest.raises(ServerError, match="b exited"):
        pool.start()
    assert len(started) == 3 and all(s.stopped for s in started)
    with pytest.raises(ValueError, match="both named"):
        pool.add(SystemSpec("x", None))
        pool.add(SystemSpec("x", "EAGLE"))


def test_server_stop_kills_the_whole_process_group(tmp_path):
    """SGLang forks a scheduler and a detokenizer; stop() must not leave them behind."""
    pid_file = tmp_path / "child.pid"
    script = ("import os, subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(300)\n")

    class Fake(SGLangServer):
        def command(self):
            return [sys.executable, "-c", script]

    srv = Fake(["--device", "cpu"], port=1, log_path=tmp_path / "log")
    srv.start(wait=False)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert srv.running
    srv.stop()
    assert not srv.running
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    srv.stop()  # a second stop is harmless


def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    return p.parse_args(["bench", *argv])


def test_engines_choose_the_systems_that_run():
    full = config_from_args(_args())
    assert full.name == "full" and set(SGLANG_SYSTEMS) <= set(full.run_systems())
    quick = config_from_args(_args("--quick"))
    assert quick.name == "quick" and not set(SGLANG_SYSTEMS) & set(quick.run_systems())
    # the full run measures SmolLM2; the quick one the bundled model (minutes), unless --model says otherwise
    assert full.model_dir == "smollm2" and quick.model_dir is None
    assert config_from_args(_args("--quick", "--model", "smollm2")).model_dir == "smollm2"
    q_sgl = config_from_args(_args("--quick", "--engines", "sglang"))
    assert q_sgl.name == "quick_sglang" and q_sgl.run_systems() == SGLANG_SYSTEMS
    ref = config_from_args(_args("--engines", "reference,transformers"))
    assert ref.name == "full_reference_transformers" and not set(SGLANG_SYSTEMS) & set(ref.run_systems())
    named = config_from_args(_args("--quick", "--systems", "sglang-entmtp"))
    assert named.name == "custom" and named.run_systems() == ("sglang-entmtp",)
    with pytest.raises(ValueError, match="unknown engine"):
        config_from_args(_args("--engines", "warp"))
    with pytest.raises(ValueError, match="no system of engine"):
        config_from_args(_args("--systems", "plain", "--engines", "sglang"))


def test_the_quick_run_adds_a_side_by_side_on_smollm2_against_transformers():
    """--quick (on the bundled model) adds a batch-1 run on SmolLM2: the reference engine's plain and EntMTP beside
    transformers' greedy and prompt lookup; not when told `none`, when the quick run is already on SmolLM2, when
    only SGLang runs, or outside --quick."""
    from entmtp_sglang.bench.cli import side_by_side_from_args

    def side(*argv):
        args = _args(*argv)
        return side_by_side_from_args(args, config_from_args(args))

    cfg = side("--quick")
    assert cfg.model_dir == "smollm2" and cfg.batch_sizes == (1,) and cfg.name == "quick_side_by_side"
    assert cfg.run_systems() == ("plain", "entmtp-hydra", "hf-greedy", "hf-prompt-lookup")
    assert "mixed" in cfg.tasks and cfg.threads == 1
    assert side("--quick", "--threads", "2").threads == 2
    assert side("--quick", "--side-by-side", "entmtp-tiny", "--model", "smollm2").model_dir is None
    assert side("--quick", "--side-by-side", "none") is None
    assert side("--quick", "--model", "smollm2") is None
    assert side("--quick", "--engines", "sglang") is None
    assert side("--quick", "--engines", "transformers") is not None
    assert side() is None and side("--tasks", "code") is None


# -- real SGLang servers (slow) ------------------------------------------------------------------------
@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_systems_in_the_harness_are_lossless_and_leave_no_server():
    """The four SGLang systems through `run_bench` on real servers: rows, greedy equality with
    sglang-plain at batch 1 and 4, ENTMTP's trees, and every server process gone afterwards."""
    if sglang_systems.sglang_missing():
        if os.environ.get("ENTMTP_REQUIRE_SGLANG") == "1":
            pytest.fail(sglang_systems.sglang_missing())
        pytest.skip(sglang_systems.sglang_missing())
    cfg = BenchConfig(tasks=("code", "mixed"), systems=SGLANG_SYSTEMS, batch_sizes=(1, 4), repeats=1,
                      max_new_tokens=12, prompts=2, cost_steps=1, cost_rounds=1, max_prompt_tokens=96, name="test")
    ctxs = []
    real_pool = sglang_systems.server_pool

    def spy(ctx):
        if ctx not in ctxs:
            ctxs.append(ctx)
        return real_pool(ctx)

    sglang_systems.server_pool = spy
    try:
        res = run_bench(cfg, progress=False, log=lambda *a: None)
    finally:
        sglang_systems.server_pool = real_pool
    rows = {(r["task"], r["system"], r["batch"]): r for r in res.rows}
    for b in (1, 4):
        for name in SGLANG_SYSTEMS:
            r = rows[("overall", name, b)]
            assert r["engine"] == "sglang" and r["tokens_per_s"] > 0 and r["baseline"] == "sglang-plain"
            if name != "sglang-plain":
                assert r["lossless"] == 1.0, (name, b)
                assert r["mean_accepted"] > 0
        assert sum(rows[("overall", "sglang-entmtp", b)]["trees_chosen"].values()) == \
            rows[("overall", "sglang-entmtp", b)]["steps"]
    assert res.meta["systems"]["sglang-entmtp"]["server"]["algorithm"] == "ENTMTP"
    pool = ctxs[0].cache["sglang"]
    assert not pool.servers and len(pool.started) == 4  # all four started once, all stopped
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for name, pid, port in pool.started:
        with pytest.raises(ProcessLookupError):  # nothing of the server's process group is left
            os.killpg(pid, 0)
        assert f"--port {port}" not in out, name


def test_tool_calls_build_each_call_schema_and_name_an_undefined_tool(tmp_path):
    from entmtp_sglang.bench.workload import tool_calls

    spec = {"tools": {"get_weather": {"description": "Weather for a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            "requests": [{"tool": "get_weather", "user": "Rain in Oslo?"}, {"tool": "get_weather", "user": "Paris?"}]}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(spec))
    calls = tool_calls(path, limit=1)
    assert [c.user for c in calls] == ["Rain in Oslo?"]
    schema = calls[0].schema
    assert schema["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert schema["properties"]["arguments"] == spec["tools"]["get_weather"]["parameters"]
    assert schema["required"] == ["name", "arguments"] and "get_weather" in calls[0].system
    assert len(tool_calls(path)) == 2
    spec["requests"].append({"tool": "send_mail", "user": "Mail Bob."})
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="send_mail"):
        tool_calls(path)
    shipped = tool_calls(Path(__file__).parents[1] / "bench" / "workloads" / "tool_calls.json")
    assert shipped and all(c.schema["properties"]["name"]["enum"] == [c.tool] for c in shipped)
