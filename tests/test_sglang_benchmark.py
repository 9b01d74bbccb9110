"""The SGLang side-by-side benchmark's bookkeeping (entmtp_sglang/bench/sglang_benchmark.py), without servers:
medians over repeats, ratios to plain or to stock SGLang, the Markdown table; then what a stock SGLang process
loads of this package, and a stock server beside plain SGLang with the package (real servers, marked sglang).
(The other servers are exercised by tests/test_sglang_server.py and by `bench/experiments/sglang_cpu.py`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from entmtp_sglang.bench import sglang_benchmark as b


def rows(name, batch, tps, accept=None, equal=None):
    out = []
    for t in tps:
        r = b.Row(name, batch, int(t * 10), 10.0, requests=4, equal_to_plain=equal)
        if accept:
            r.accept_lengths.append(accept)
        out.append(r)
    return out


def test_medians_ratios_and_table():
    runs = {("plain", "", 1): rows("plain", 1, [10, 30, 20]),
            ("entmtp", "", 1): rows("entmtp", 1, [15, 45, 30], accept=2.5, equal=4)}
    med = b.medians(runs, [b.PLAIN, b.ENTMTP], [("", 1)])
    by = {r.system: r for r in med}
    assert by["plain"].tokens_per_s == 20 and by["entmtp"].tokens_per_s == 30
    table = b.to_markdown(med)
    assert "| entmtp | 1 | 30.0 | 1.50x | 1.50x | 2.50 | 4/4 |" in table, table


def test_ratios_are_taken_per_task():
    def tagged(rs, task):
        for r in rs:
            r.task = task
        return rs

    runs = {("plain", "code", 1): tagged(rows("plain", 1, [10, 10, 10]), "code"),
            ("entmtp", "code", 1): tagged(rows("entmtp", 1, [20, 20, 20], equal=4), "code"),
            ("plain", "json", 1): tagged(rows("plain", 1, [40, 40, 40]), "json"),
            ("entmtp", "json", 1): tagged(rows("entmtp", 1, [20, 20, 20], equal=3), "json")}
    table = b.to_markdown(b.medians(runs, [b.PLAIN, b.ENTMTP], [("code", 1), ("json", 1)]))
    assert "| code | entmtp | 1 | 20.0 | 2.00x | 2.00x |  | 4/4 |" in table, table
    assert "| json | entmtp | 1 | 20.0 | 0.50x | 0.50x |  | 3/4 |" in table, table


def test_the_paired_ratio_follows_each_repeat_and_the_table_can_be_drawn_again(tmp_path):
    """A drifting machine: plain's fast third repeat meets ENTMTP's slow one. The ratio of medians says 0.75x;
    ENTMTP is 1.5x plain within two repeats of three, which the paired column says. `write` then `rows_from_jsonl`
    gives the same table."""
    runs = {("plain", "", 8): rows("plain", 8, [10, 40, 50]),
            ("entmtp", "", 8): rows("entmtp", 8, [15, 60, 30], equal=20)}
    med = b.medians(runs, [b.PLAIN, b.ENTMTP], [("", 8)])
    by = {r.system: r for r in med}
    assert by["entmtp"].repeat_tokens_per_s == [15, 60, 30]
    assert b.paired_ratio(by["entmtp"], by["plain"]) == 1.5
    table = b.to_markdown(med)
    assert "| entmtp | 8 | 30.0 | 0.75x | 1.50x |" in table, table
    by["plain"].repeat_tokens_per_s = [10, 40]      # repeats missing on one side: no paired ratio
    assert b.paired_ratio(by["entmtp"], by["plain"]) is None
    by["plain"].repeat_tokens_per_s = [10, 40, 50]
    b.write(med, tmp_path, {"model": "test"}, name="run")
    assert b.to_markdown(b.rows_from_jsonl(tmp_path / "run.jsonl.gz")) == table


class _Server:
    """Answers /generate like SGLang (token ids equal to plain's unless told otherwise) and says which servers were
    up at each request: the bookkeeping of waves, without model servers (those run in bench/sglang_speed.py)."""

    up: set = set()
    seen: list = []

    def __init__(self, name, differ=False):
        self.name, self.differ, self.running, self.log_path = name, differ, False, None

    def start(self, wait=True):
        self.running = True
        _Server.up.add(self.name)
        return self

    def wait_ready(self):
        pass

    def generate(self, text, n):
        return {}

    def post(self, path, payload):
        _Server.seen.append((self.name, frozenset(_Server.up)))
        ids = [1, 2, 3] if not self.differ else [1, 2, 4] if self.differ is True else self.differ
        return {"output_ids": ids, "meta_info": {"completion_tokens": 3}}

    def stop(self):
        self.running = False
        _Server.up.discard(self.name)

    def flush_cache(self):
        _Server.seen.append((self.name, "flush"))


class _Spec:
    def __init__(self, name, speculative=None, differ=False, stock=False):
        self.name, self.speculative, self.differ, self.stock = name, speculative, differ, stock

    def server(self, log_dir, device_args, *model):
        return _Server(self.name, self.differ)


def test_waves_keep_plain_up_and_pair_each_system_with_the_plain_run_beside_it(tmp_path):
    """Seven systems, four servers at once: two waves, plain in both, never more than four up; each system's paired
    ratio divides by plain's runs of its own wave; outputs are compared with plain's in every wave."""
    plain, *others = [_Spec("plain")] + [_Spec(f"s{i}", "EAGLE", differ=(i == 5)) for i in range(6)]
    plan = b.waves([plain, *others], 4)
    assert [[s.name for s in w] for w in plan] == [["plain", "s0", "s1", "s2"], ["plain", "s3", "s4", "s5"]]
    assert b.waves([plain, *others], None) == [[plain, *others]]
    with pytest.raises(ValueError, match="at_once"):
        b.waves([plain, *others], 1)
    with pytest.raises(ValueError, match="none without speculation"):
        b.waves(others, 3)

    _Server.up.clear()
    _Server.seen.clear()
    work = {"code": ([{"text": "a"}, {"text": "b"}], (1, 2))}
    done = []
    rows = b.run_workloads([plain, *others], work, repeats=2, log_dir=tmp_path, progress=lambda *a: None,
                           on_repeat=lambda rows, n: done.append(n), at_once=4)
    assert max(len(up) for _, up in _Server.seen) == 4 and not _Server.up      # all stopped at the end
    assert {n for n, up in _Server.seen if "s3" in up} == {"plain", "s3", "s4", "s5"}
    assert done == [1, 2, 3, 4]
    by = {(r.system, r.batch): r for r in rows}
    assert len(by[("plain", 1)].repeat_tokens_per_s) == 4                     # 2 waves x 2 repeats
    assert by[("s4", 1)].plain_repeat_tokens_per_s == by[("plain", 1)].repeat_tokens_per_s[2:]
    assert by[("s0", 2)].plain_repeat_tokens_per_s == by[("plain", 2)].repeat_tokens_per_s[:2]
    assert by[("s4", 1)].equal_to_plain == 2 and by[("s5", 1)].equal_to_plain == 0
    assert by[("plain", 1)].plain_repeat_tokens_per_s == []


def test_the_versus_table_divides_paired_ratios_and_names_the_best():
    def row(system, tps, beside=()):
        return b.Row(system, 1, 10, 1.0, requests=1, repeat_tokens_per_s=list(tps), task="code",
                     plain_repeat_tokens_per_s=list(beside))

    rows = [row("plain", [10, 10, 20, 20]),
            row("entmtp", [15, 15], [10, 10]),             # 1.5x plain beside it
            row("eagle-adaptive", [12, 12], [10, 10]),     # 1.2x
            row("eagle-s1", [26, 26], [20, 20]),           # 1.3x, measured in the second wave
            row("eagle-s3", [22, 22], [20, 20])]           # 1.1x
    table = b.versus(rows, "entmtp", {"best static EAGLE": ["eagle-s1", "eagle-s3"], "adaptive": ["eagle-adaptive"]})
    assert "| code | 1 | 1.15x (eagle-s1) | 1.25x (eagle-adaptive) |" in table, table


def test_the_stock_spec_leaves_the_general_plugin_out_and_the_eagle_stand_ins_keep_sglang_layers(tmp_path):
    """STOCK starts SGLang with SGLANG_PLUGINS naming only the CPU-ops platform plugin, on torch_native; plain
    keeps the plugin; `sglang_layers` puts a spec on SGLang's own layers (linear, RMSNorm, SiLU, rotary) without
    touching the rest."""
    assert b.STOCK.stock and b.STOCK.speculative is None and b.STOCK.attention == "torch_native"
    assert not b.PLAIN.stock and not b.ENTMTP.stock and not b.ADAPTIVE.stock
    assert (b.STOCK.layers, b.PLAIN.layers, b.ENTMTP.layers) == ("sglang", "package", "package")
    srv = b.STOCK.server(tmp_path, b.FLOAT32)
    assert srv.env["SGLANG_PLUGINS"] == "entmtp_cpu_ops" and srv.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert srv.args[srv.args.index("--attention-backend") + 1] == "torch_native"
    assert b.PLAIN.server(tmp_path, b.FLOAT32).env.get("SGLANG_PLUGINS") == os.environ.get("SGLANG_PLUGINS")
    # a whitelist that names the general plugin is not stock
    assert not b.SystemSpec("x", env=(("SGLANG_PLUGINS", "entmtp_cpu_ops, entmtp"),)).stock
    adaptive = b.sglang_layers(b.ADAPTIVE)
    assert adaptive.layers == "sglang" and not adaptive.stock
    assert dict(adaptive.env) == {"ENTMTP_LINEAR": "torch", "ENTMTP_ONEDNN": "0", "ENTMTP_ROWWISE": "0"}
    assert (adaptive.name, adaptive.speculative, adaptive.adaptive, adaptive.attention, adaptive.draft_tokens) == \
        (b.ADAPTIVE.name, "EAGLE", True, "entmtp_torch", b.ADAPTIVE.draft_tokens)
    env = dict(b.sglang_layers(b.SystemSpec("y", "EAGLE", env=(("ENTMTP_TREE_SET", "f.json"),))).env)
    assert env["ENTMTP_TREE_SET"] == "f.json" and env["ENTMTP_LINEAR"] == "torch"


def test_measure_compares_every_output_with_plain_and_with_stock():
    """Stock's outputs and plain's (with the package) are kept apart: each speculative system is counted against
    both, plain against stock and stock against plain."""
    class Canned:
        def __init__(self, outputs):
            self.outputs = outputs

        def post(self, path, payload):
            ids = self.outputs[payload["text"]]
            return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}}

    payloads = [{"text": t} for t in ("a", "b", "c")]
    stock_ids = {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    plain_ids = {"a": [1, 2], "b": [3, 4], "c": [5, 7]}          # a near-tie rounds the other way on c
    reference, stock = {}, {}
    s_row = b.measure(Canned(stock_ids), b.STOCK, payloads, 1, reference, "code", stock)
    p_row = b.measure(Canned(plain_ids), b.PLAIN, payloads, 1, reference, "code", stock)
    e_row = b.measure(Canned({**plain_ids, "a": [1, 9]}), b.ENTMTP, payloads, 1, reference, "code", stock)
    assert stock == {("code", 1): [[1, 2], [3, 4], [5, 6]]} and reference == {("code", 1): [[1, 2], [3, 4], [5, 7]]}
    assert (s_row.equal_to_plain, s_row.equal_to_stock) == (None, None)    # plain was not measured yet
    assert (p_row.equal_to_plain, p_row.equal_to_stock) == (None, 2)
    assert (e_row.equal_to_plain, e_row.equal_to_stock) == (2, 1)
    again = b.measure(Canned(stock_ids), b.STOCK, payloads, 1, reference, "code", stock)
    assert (again.equal_to_plain, again.equal_to_stock) == (2, None)
    # a server in a dtype of its own (stock in bfloat16) is compared with its own first run only
    bf16 = {**stock_ids, "c": [5, 8]}
    first = b.measure(Canned(bf16), b.STOCK_BF16, payloads, 1, reference, "code", stock)
    assert (first.equal_to_plain, first.equal_to_stock) == (None, None) and stock[("code", 1)][2] == [5, 6]
    assert b.measure(Canned(bf16), b.STOCK_BF16, payloads, 1, reference, "code", stock).equal_to_plain == 3
    assert b.measure(Canned(stock_ids), b.STOCK_BF16, payloads, 1, reference, "code", stock).equal_to_plain == 2
    assert reference[("code", 1)] == [[1, 2], [3, 4], [5, 7]]
    # without a stock dict (the older callers), a stock server is compared with plain like any other system
    assert b.measure(Canned(stock_ids), b.STOCK, payloads, 1, {("code", 1): reference[("code", 1)]}, "code"
                     ).equal_to_plain == 2


def test_with_a_stock_run_every_ratio_divides_by_stock():
    """Stock 10 tok/s, plain with the package 20, ENTMTP 30: the table says 2.00x and 3.00x (over stock), not 1.50x
    (over plain), says so in its header, and counts outputs equal to each; the versus table goes through stock."""
    def row(system, tps, beside=(), eq=None, eq_stock=None):
        return b.Row(system, 1, int(10 * tps[0]), 10.0, requests=4, repeat_tokens_per_s=list(tps), task="code",
                     plain_repeat_tokens_per_s=list(beside), equal_to_plain=eq, equal_to_stock=eq_stock)

    rows = [row("plain-stock", [10.0, 10.0], eq=4), row("plain", [20.0, 20.0], [10.0, 10.0], eq_stock=4),
            row("entmtp", [30.0, 30.0], [10.0, 10.0], eq=4, eq_stock=3),
            row("eagle-s1", [15.0, 15.0], [10.0, 10.0], eq=2, eq_stock=4)]
    assert b.baseline_of(rows) == "plain-stock" and b.baseline_of(rows[1:]) == "plain"
    table = b.to_markdown(rows)
    assert "| vs stock | vs stock, paired | mean accepted length | greedy = plain | greedy = stock |" in table
    assert "| code | plain | 1 | 20.0 | 2.00x | 2.00x |  |  | 4/4 |" in table, table
    assert "| code | entmtp | 1 | 30.0 | 3.00x | 3.00x |  | 4/4 | 3/4 |" in table, table
    assert "| code | plain-stock | 1 | 10.0 | 1.00x | 1.00x |  | 4/4 |  |" in table, table
    # a run without stock (older runs, bench/experiments/sglang_cpu.py): plain the denominator, no stock column
    old = b.to_markdown([row("plain", [20.0, 20.0]), row("entmtp", [30.0, 30.0], [20.0, 20.0], eq=4)])
    assert "| code | entmtp | 1 | 30.0 | 1.50x | 1.50x |  | 4/4 |  |" in old and "greedy = stock" not in old, old
    assert "| code | 1 | 2.00x (eagle-s1) |" in b.versus(rows, "entmtp", {"static": ["eagle-s1"]})


FAKE_WORK = {"code": ([{"text": "a"}, {"text": "b"}], (1,))}   # two code prompts at batch 1


def _run_fake(systems, every, tmp_path):
    """`run_workloads` over the fake servers: `FAKE_WORK`, two repeats, four servers at once."""
    _Server.up.clear()
    _Server.seen.clear()
    return b.run_workloads(systems, FAKE_WORK, repeats=2, log_dir=tmp_path, progress=lambda *a: None, at_once=4,
                           every=every)


def test_stock_and_plain_stay_up_in_every_wave_and_stock_is_measured_first(tmp_path):
    """Stock, plain and six systems, four servers at once: three waves with stock and plain in each; in every
    (task, batch) stock runs first and every other system's paired ratio divides by the stock run of its own wave;
    outputs are counted against plain's and stock's."""
    stock, plain = _Spec("plain-stock", stock=True), _Spec("plain", differ=[1, 2, 5])
    others = [_Spec(f"s{i}", "EAGLE", differ=(i == 5)) for i in range(6)]
    systems = [stock, plain, *others]
    assert b.default_baseline(systems) == "plain-stock" and b.default_baseline([plain, *others]) == "plain"
    plan = b.waves(systems, 4, ("plain-stock", "plain"))
    assert [[s.name for s in w] for w in plan] == [["plain-stock", "plain", "s0", "s1"],
                                                   ["plain-stock", "plain", "s2", "s3"],
                                                   ["plain-stock", "plain", "s4", "s5"]]
    # by default only the baseline (stock) is in every wave
    assert [[s.name for s in w] for w in b.waves(systems, 4)][1] == ["plain-stock", "s2", "s3", "s4"]
    with pytest.raises(ValueError, match="at_once must be >= 3"):
        b.waves(systems, 2, ("plain-stock", "plain"))
    with pytest.raises(ValueError, match="not in the run: nope"):
        b.waves(systems, 4, ("plain-stock", "nope"))

    rows = _run_fake(systems, ("plain-stock", "plain"), tmp_path)
    assert max(len(up) for _, up in _Server.seen) == 4 and not _Server.up
    runs = [n for n, _ in _Server.seen][::2]          # one run = two requests, one at a time at batch 1
    assert [runs[i:i + 2] for i in range(0, len(runs), 4)] == [["plain-stock", "plain"]] * 6  # 3 waves x 2 repeats
    by = {r.system: r for r in rows}
    stock_runs = by["plain-stock"].repeat_tokens_per_s
    assert len(stock_runs) == 6 and len(by["plain"].repeat_tokens_per_s) == 6
    assert by["plain"].plain_repeat_tokens_per_s == stock_runs                  # beside stock in every wave
    assert by["s2"].plain_repeat_tokens_per_s == stock_runs[2:4]                # the second wave's stock runs
    assert by["plain-stock"].plain_repeat_tokens_per_s == []
    assert (by["plain-stock"].equal_to_plain, by["plain-stock"].equal_to_stock) == (0, None)
    assert (by["plain"].equal_to_plain, by["plain"].equal_to_stock) == (None, 0)
    assert (by["s0"].equal_to_plain, by["s0"].equal_to_stock) == (0, 2)
    with pytest.raises(ValueError, match="baseline 'nope'"):
        b.run_workloads(systems, FAKE_WORK, repeats=1, log_dir=tmp_path, progress=lambda *a: None, baseline="nope")


def test_a_shuffled_run_measures_each_round_in_a_new_order_from_an_empty_cache_and_still_compares_every_output(
        tmp_path):
    """shuffle_seed: the servers of a wave run in a seeded random order per repeat and workload (the same order for
    the same seed); flush: each measured pass starts from an empty radix cache; outputs are compared once the
    round has run, so a system measured before plain in its round is still compared with plain's outputs, and the
    paired ratios pair runs of the same round."""
    stock, plain = _Spec("plain-stock", stock=True), _Spec("plain")
    others = [_Spec("s0", "EAGLE"), _Spec("s1", "EAGLE", differ=True)]

    def run(seed):
        _Server.up.clear()
        _Server.seen.clear()
        rows = b.run_workloads([stock, plain, *others], FAKE_WORK, repeats=4, log_dir=tmp_path,
                               progress=lambda *a: None, at_once=4, every=("plain-stock", "plain"), flush=True,
                               shuffle_seed=seed)
        events = list(_Server.seen)
        return rows, events

    rows, events = run(3)
    flushes = [i for i, (_, what) in enumerate(events) if what == "flush"]
    assert len(flushes) == 4 * 4                                   # 4 servers x 4 repeats, one pass each
    assert all(events[i + 1][0] == events[i][0] and events[i + 1][1] != "flush" for i in flushes)
    orders = [tuple(events[i][0] for i in flushes[r * 4:(r + 1) * 4]) for r in range(4)]
    assert len(set(orders)) > 1 and all(sorted(o) == ["plain", "plain-stock", "s0", "s1"] for o in orders)
    assert orders == [tuple(events[i][0] for i in [j for j, (_, w) in enumerate(run(3)[1]) if w == "flush"]
                            [r * 4:(r + 1) * 4]) for r in range(4)]   # seeded: the same orders again
    assert any(o.index("s0") < o.index("plain") for o in orders)   # some round measured s0 before plain
    by = {r.system: r for r in rows}
    assert (by["s0"].equal_to_plain, by["s0"].equal_to_stock) == (2, 2)
    assert (by["s1"].equal_to_plain, by["plain"].equal_to_stock) == (0, 2)
    assert by["s0"].plain_repeat_tokens_per_s == by["plain-stock"].repeat_tokens_per_s   # stock of each round
    assert by["s0"].beside["plain"] == by["plain"].repeat_tokens_per_s


# -- stock SGLang itself -------------------------------------------------------------------------------
_LOADS = """
import json, sys
from sglang.srt.platforms import current_platform   # runs the platform plugins, as every SGLang process does
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups import choices
from sglang.srt.plugins.hook_registry import HookRegistry
print(json.dumps({"hooks": sorted(str(k) for k in getattr(HookRegistry, "_hooks", {})),
                  "entmtp_torch": "entmtp_torch" in choices.ATTENTION_BACKEND_CHOICES,
                  "stub": bool(getattr(sys.modules.get("sgl_kernel"), "__entmtp_sglang_stub__", False))}))
"""


def _loads(env_of_spec: tuple[tuple[str, str], ...]) -> dict:
    """What an SGLang process started with a spec's environment loads of this package."""
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip("sglang.srt.plugins")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    for key in ("SGLANG_PLUGINS", "ENTMTP_LINEAR", "ENTMTP_ONEDNN"):
        env.pop(key, None)
    env.update(dict(env_of_spec))
    out = subprocess.run([sys.executable, "-c", _LOADS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
@pytest.mark.slow   # the benchmark's stock baseline (not the product): with the benchmark's own checks
def test_a_stock_process_loads_only_the_cpu_ops_of_this_package():
    """SGLANG_PLUGINS=entmtp_cpu_ops (STOCK's environment): no hook of this package and no entmtp_torch backend in
    SGLang, only the sgl_kernel CPU ops. Plain with the package: every hook, the linear layers' among them (unless
    the machine's path is F.linear itself). EAGLE's stand-in (`sglang_layers`): entmtp_torch and the other hooks, not
    the linear layers'. Each in a fresh process: SGLang loads plugins once per process."""
    from entmtp_sglang.sglang.cpu import rowwise as cpu_rowwise
    from entmtp_sglang.sglang.cpu.linear import LINEAR_APPLY, LM_HEAD

    stock = _loads(b.STOCK.env)
    assert stock == {"hooks": [], "entmtp_torch": False, "stub": True}
    full = _loads(b.PLAIN.env)
    assert full["entmtp_torch"] and full["stub"] and len(full["hooks"]) > 2
    stand_in = _loads(b.sglang_layers(b.ADAPTIVE).env)
    assert stand_in["entmtp_torch"] and LINEAR_APPLY not in stand_in["hooks"] and LM_HEAD not in stand_in["hooks"]
    rowwise_hooks = {cpu_rowwise.RMSNORM, cpu_rowwise.SILU_AND_MUL, cpu_rowwise.ROPE}
    assert (rowwise_hooks <= set(full["hooks"])) == cpu_rowwise.ops.available()
    assert set(stand_in["hooks"]) == set(full["hooks"]) - {LINEAR_APPLY, LM_HEAD, *rowwise_hooks}


@pytest.mark.sglang
@pytest.mark.slow   # the benchmark's stock baseline (not the product): with the benchmark's own checks
def test_stock_sglang_serves_beside_plain_sglang_with_the_package(tmp_path):
    """Real servers of the bundled model: stock SGLang (the baseline, measured first) and plain SGLang with the
    package through `run_workloads`; both serve, every ratio divides by stock, and their greedy outputs are
    compared (equal here: float32, short outputs)."""
    from helpers.testing import import_sglang_or_skip

    import_sglang_or_skip()
    payloads = [b.generate_payload(p, 6) for p in ("def add(a, b):", "The capital of France is")]
    rows = b.run_workloads([b.PLAIN, b.STOCK], {"code": (payloads, (1,))}, repeats=1, log_dir=tmp_path,
                           progress=lambda *a: None)
    by = {r.system: r for r in rows}
    assert by["plain-stock"].tokens > 0 and by["plain"].tokens > 0
    assert by["plain"].plain_repeat_tokens_per_s == by["plain-stock"].repeat_tokens_per_s
    assert by["plain"].equal_to_stock == 2 and by["plain-stock"].equal_to_plain is None   # stock ran first
    assert "vs stock" in b.to_markdown(rows)


class _TreeServer(_Server):
    """Answers like ENTMTP: each request's own trees (from its text) in meta_info.entmtp_trees."""

    def post(self, path, payload):
        trees = {"j": ["b3n3d2", "b3n3d2"], "c": ["rest", "b0n2d1"]}[payload["text"][0]]
        return {"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3, "entmtp_trees": trees}}


class _TreeSpec(_Spec):
    def server(self, log_dir, device_args, *model):
        return _TreeServer(self.name) if self.speculative else _Server(self.name)


def test_a_labelled_workload_keeps_each_labels_trees(tmp_path):
    """A workload given as (payloads, batches, labels), as the mixed batch is: each row counts the trees of each
    label's requests apart (`Row.trees_by_label`), an unlabelled workload none; labels must match the payloads."""
    systems = [_TreeSpec("plain"), _TreeSpec("entmtp", "ENTMTP")]
    work = {"mixed-batch": ([{"text": "j1"}, {"text": "c1"}, {"text": "j2"}], (2,), ["json", "chat", "json"]),
            "code": ([{"text": "c2"}], (1,))}
    rows = {(r.system, r.task): r for r in b.run_workloads(systems, work, repeats=1, log_dir=tmp_path,
                                                           progress=lambda *a: None)}
    ent = rows[("entmtp", "mixed-batch")]
    assert ent.trees_by_label == {"json": {"b3n3d2": 4}, "chat": {"rest": 1, "b0n2d1": 1}}
    assert ent.trees == {"b3n3d2": 4, "rest": 1, "b0n2d1": 1}
    assert rows[("entmtp", "code")].trees_by_label == {} and rows[("plain", "mixed-batch")].trees_by_label == {}
    with pytest.raises(ValueError, match="2 labels for 3 payloads"):
        b.measure(_TreeServer("entmtp"), systems[1], work["mixed-batch"][0], 1, {}, labels=["json", "chat"])


def test_plain_on_entmtp_torch_in_every_wave_leaves_its_runs_beside_every_other_system(tmp_path):
    """Stock, plain on entmtp_torch (plain-entmtp), plain on torch_native and four others, four servers at once, the
    two baselines in every wave: never more than four up; in each (task, batch) stock runs first and plain-entmtp
    second; every later row carries plain-entmtp's runs of its own wave and repeat (`Row.beside`), which the paired
    ratio over plain-entmtp divides by; plain-entmtp's outputs are the reference and plain's are compared with them
    (the two plain servers must agree), each plain once."""
    stock, pe = _Spec("plain-stock", stock=True), _Spec("plain-entmtp")
    plain = _Spec("plain", differ=[1, 2, 5])          # disagrees with plain-entmtp on every output
    others = [_Spec(f"s{i}", "EAGLE") for i in range(4)]
    systems = [stock, pe, *others, plain]
    plan = b.waves(systems, 4, ("plain-stock", "plain-entmtp"))
    assert [[s.name for s in w] for w in plan] == [["plain-stock", "plain-entmtp", "s0", "s1"],
                                                   ["plain-stock", "plain-entmtp", "s2", "s3"],
                                                   ["plain-stock", "plain-entmtp", "plain"]]
    rows = _run_fake(systems, ("plain-stock", "plain-entmtp"), tmp_path)
    assert max(len(up) for _, up in _Server.seen) == 4 and not _Server.up
    runs = [n for n, _ in _Server.seen][::2]          # one run = two requests, one at a time at batch 1
    assert runs[:4] == ["plain-stock", "plain-entmtp", "s0", "s1"] and runs[-3:] == ["plain-stock", "plain-entmtp",
                                                                                      "plain"]
    by = {r.system: r for r in rows}
    pe_runs = by["plain-entmtp"].repeat_tokens_per_s
    assert len(pe_runs) == 6 and by["plain-entmtp"].plain_repeat_tokens_per_s == by["plain-stock"].repeat_tokens_per_s
    assert by["s0"].beside == {"plain-entmtp": pe_runs[:2]} and by["s3"].beside == {"plain-entmtp": pe_runs[2:4]}
    assert by["plain"].beside == {"plain-entmtp": pe_runs[4:]}
    assert by["plain-entmtp"].beside == {} and by["plain-stock"].beside == {}
    assert b.paired_ratio(by["s2"], by["plain-entmtp"]) == b.paired_over(rows, by["s2"], "plain-entmtp")
    assert (by["plain-entmtp"].equal_to_plain, by["plain"].equal_to_plain, by["s0"].equal_to_plain) == (None, 0, 2)
    assert by["plain-stock"].equal_to_plain == 2      # measured first in every wave after the first
    # plain with the package alone (no second plain server): never compared with itself
    _Server.up.clear()
    one = {r.system: r for r in b.run_workloads([stock, pe, others[0]], FAKE_WORK, repeats=2, log_dir=tmp_path,
                                                progress=lambda *a: None, every=("plain-stock", "plain-entmtp"))}
    assert one["plain-entmtp"].equal_to_plain is None and one["s0"].beside["plain-entmtp"] == \
        one["plain-entmtp"].repeat_tokens_per_s


def test_measure_compares_the_second_plain_server_with_the_first():
    """With `owners` (run_workloads'), a plain server with the package other than the one whose outputs became the
    reference is compared with it; the reference's own later runs are not; without `owners` no plain server is."""
    class Canned:
        def __init__(self, outputs):
            self.outputs = outputs

        def post(self, path, payload):
            ids = self.outputs[payload["text"]]
            return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}}

    payloads = [{"text": t} for t in ("a", "b")]
    ids = {"a": [1, 2], "b": [3, 4]}
    reference, owners = {}, {}
    first = b.measure(Canned(ids), b.PLAIN_ENTMTP, payloads, 1, reference, "code", {}, owners=owners)
    again = b.measure(Canned(ids), b.PLAIN_ENTMTP, payloads, 1, reference, "code", {}, owners=owners)
    other = b.measure(Canned({**ids, "b": [3, 5]}), b.PLAIN, payloads, 1, reference, "code", {}, owners=owners)
    assert owners == {("code", 1): "plain-entmtp"} and reference == {("code", 1): [[1, 2], [3, 4]]}
    assert (first.equal_to_plain, again.equal_to_plain, other.equal_to_plain) == (None, None, 1)
    assert b.measure(Canned(ids), b.PLAIN, payloads, 1, reference, "code", {}).equal_to_plain is None


def test_the_speculation_baseline_is_plain_on_entmtp_torch_when_the_run_has_it():
    def row(system, tps, stock=(), pe=None):
        return b.Row(system, 1, 10, 1.0, requests=1, repeat_tokens_per_s=list(tps), task="code",
                     plain_repeat_tokens_per_s=list(stock), beside={} if pe is None else {"plain-entmtp": list(pe)})

    rows = [row("plain-stock", [10, 10, 10, 10]), row("plain-entmtp", [20, 20, 30, 30], [10, 10, 10, 10]),
            row("entmtp", [30, 36], [10, 10], [20, 20]),        # 1.5x, 1.8x the plain-entmtp run beside it
            row("eagle-s1", [45, 45], [10, 10], [30, 30]),      # 1.5x, in the second wave
            row("plain", [15, 15], [10, 10])]                   # without plain-entmtp beside it: through stock
    assert b.speculation_baseline(rows) == "plain-entmtp"
    assert b.speculation_baseline([r for r in rows if r.system != "plain-entmtp"]) == "plain"
    assert b.speculation_baseline(rows[:1]) is None
    by = {r.system: r for r in rows}
    assert b.paired_over(rows, by["entmtp"], "plain-entmtp") == pytest.approx(1.65)
    assert b.paired_over(rows, by["plain"], "plain-entmtp") == pytest.approx(1.5 / 2.5)   # 1.5x stock / 2.5x stock
    assert b.paired_over(rows, by["entmtp"], "nope") is None
    assert b.best_paired(rows, ["eagle-s1"], "code", 1, "plain-entmtp") == (1.5, "eagle-s1")
    assert "| code | 1 | 1.10x (eagle-s1) |" in b.versus(rows, "entmtp", {"static": ["eagle-s1"]}, "plain-entmtp")
    table = b.to_markdown(rows)
    assert "| code | entmtp | 1 | 10.0 | 1.00x | 3.30x | 1.65x |" in table, table
    assert "| code | plain-entmtp | 1 | 10.0 | 1.00x | 2.50x | 1.00x |" in table, table
    # plain-entmtp as the table's baseline: one column over it, each row paired with its run beside it
    table = b.to_markdown(rows, "plain-entmtp")
    assert table.splitlines()[0].count("vs plain-entmtp, paired") == 1
    assert "| code | entmtp | 1 | 10.0 | 1.00x | 1.65x |" in table and "| code | plain | 1 | 10.0 | 1.00x | 0.60x |" \
        in table, table
