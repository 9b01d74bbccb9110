"""The SGLang side-by-side benchmark's bookkeeping (entmtp_sglang/bench/sglang_benchmark.py), without servers:
medians over repeats, ratios to plain, the Markdown table. (The servers themselves are exercised by
tests/test_sglang_server.py and by `bench/sglang_cpu.py`.)"""

from __future__ import annotations

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
