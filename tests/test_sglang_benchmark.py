"""The SGLang side-by-side benchmark's bookkeeping (entmtp_sglang/bench/sglang_benchmark.py), without servers:
medians over repeats, ratios to plain, the Markdown table. (The servers themselves are exercised by
tests/test_sglang_server.py and by `bench/sglang_cpu.py`.)"""

from __future__ import annotations

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
    med = b._medians(runs, [b.PLAIN, b.ENTMTP], [("", 1)])
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
    table = b.to_markdown(b._medians(runs, [b.PLAIN, b.ENTMTP], [("code", 1), ("json", 1)]))
    assert "| code | entmtp | 1 | 20.0 | 2.00x | 2.00x |  | 4/4 |" in table, table
    assert "| json | entmtp | 1 | 20.0 | 0.50x | 0.50x |  | 3/4 |" in table, table


def test_the_paired_ratio_follows_each_repeat_and_the_table_can_be_drawn_again(tmp_path):
    """A drifting machine: plain's fast third repeat meets ENTMTP's slow one. The ratio of medians says 0.75x;
    ENTMTP is 1.5x plain within two repeats of three, which the paired column says. `write` then `rows_from_jsonl`
    gives the same table."""
    runs = {("plain", "", 8): rows("plain", 8, [10, 40, 50]),
            ("entmtp", "", 8): rows("entmtp", 8, [15, 60, 30], equal=20)}
    med = b._medians(runs, [b.PLAIN, b.ENTMTP], [("", 8)])
    by = {r.system: r for r in med}
    assert by["entmtp"].repeat_tokens_per_s == [15, 60, 30]
    assert b.paired_ratio(by["entmtp"], by["plain"]) == 1.5
    table = b.to_markdown(med)
    assert "| entmtp | 8 | 30.0 | 0.75x | 1.50x |" in table, table
    by["plain"].repeat_tokens_per_s = [10, 40]      # repeats missing on one side: no paired ratio
    assert b.paired_ratio(by["entmtp"], by["plain"]) is None
    by["plain"].repeat_tokens_per_s = [10, 40, 50]
    b.write(med, tmp_path, {"model": "test"}, name="run")
    assert b.to_markdown(b.rows_from_jsonl(tmp_path / "run.jsonl")) == table


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
        ids = [1, 2, 3] if not self.differ else [1, 2, 4]
        return {"output_ids": ids, "meta_info": {"completion_tokens": 3}}

    def stop(self):
        self.running = False
        _Server.up.discard(self.name)


class _Spec:
    def __init__(self, name, speculative=None, differ=False):
        self.name, self.speculative, self.differ = name, speculative, differ

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
