"""Calibration from a measured cost table (`entmtp calibrate --cost-table`): the set's costs come from the
table, not from timing this machine; bad tables give one clear error."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from entmtp_sglang.calibrate.cost_table import (
    CostTableError,
    level_widths,
    load_cost_table,
    step_cost_models_from_table,
)
from entmtp_sglang.calibrate.costs import COST_BATCHES, cost_grid, fit_step_cost
from entmtp_sglang.cli import main
from entmtp_sglang.model.llama import LlamaShape
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import load_tree_set

REPO = Path(__file__).resolve().parents[1]
TINY_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=4)  # the bundled model's
SIZES = (1, 2, 4, 8, 16, 32, 64)


def target_ms(batch: int, n: int) -> float:
    return (2.0 + 0.1 * n) * (1 + batch / 8)  # a hand-made curve: 2 ms + 0.1 ms per node, scaled by batch


def level_ms(batch: int, w: int) -> float:
    return (0.5 + 0.01 * w) * (1 + batch / 8)


def hand_table(scale: float = 1.0) -> dict:
    rows = []
    for b in COST_BATCHES:
        rows += [{"model": "tiny-gpu", "what": "target_forward", "attention": "flashinfer", "batch": b, "nodes": n,
                  "median_ms": scale * target_ms(b, n)} for n in SIZES]
        rows += [{"model": "tiny-gpu", "what": "target_forward", "attention": "torch", "batch": b, "nodes": n,
                  "median_ms": 50.0} for n in SIZES]  # SDPA rows: ignored while flashinfer rows exist
        rows += [{"model": "tiny-gpu", "what": "drafter_level", "drafter": "hydra", "attention": "", "batch": b,
                  "width": w, "median_ms": scale * level_ms(b, w)} for w in SIZES]
    return {"format": "entmtp-cost-table", "version": 1, "device": "TEST GPU 9000", "context_tokens": 1024,
            "models": {"tiny-gpu": {"shape": TINY_SHAPE, "dtype": "float16"},
                       "other": {"shape": {**TINY_SHAPE, "hidden_size": 512}, "dtype": "bfloat16"}},
            "rows": rows}


def write(tmp_path: Path, table: dict, name: str = "tbl.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(table))
    return path


def shape() -> LlamaShape:
    return LlamaShape.from_json(BUNDLED_MODEL / "config.json")


#        0           level widths: the root (begin), then depth 1: nodes 1 and 2 have children -> 2
#      /   \         step = target(5 nodes) + level(1) + level(2)
#     1     2
#     |     |
#     3     4
def test_step_seconds_by_hand(tmp_path):
    table = load_cost_table(write(tmp_path, hand_table()))
    tree = Tree((-1, 0, 0, 1, 2))
    assert level_widths(tree) == [1, 2]
    assert level_widths(Tree.chain(0)) == [1] and level_widths(Tree.chain(3)) == [1, 1, 1]
    want = (2.0 + 0.1 * 5) * 2 + (0.51 + 0.52) * 2  # batch 8: scale 2; target(5) interpolated 4..8
    assert table.step_seconds(tree, "tiny-gpu", "hydra", 8, "flashinfer") == pytest.approx(want / 1000)


def test_models_fit_the_tables_step_times_and_scale_with_it(tmp_path):
    table = load_cost_table(write(tmp_path, hand_table()))
    models, source = step_cost_models_from_table(table, shape(), "hydra", COST_BATCHES, 5, log=lambda m: None)
    assert source == {"table": "tbl.json", "device": "TEST GPU 9000", "model": "tiny-gpu", "dtype": "float16",
                      "attention": "flashinfer", "context_tokens": 1024}
    grid = cost_grid(5)
    for b in COST_BATCHES:
        want = fit_step_cost(grid, [table.step_seconds(t, "tiny-gpu", "hydra", b, "flashinfer") for t in grid])
        assert models[b] == want
        # the hand-made curve: ~0.1 ms per node and ~0.51 ms per level, times the batch scale
        assert models[b].per_node == pytest.approx(0.1e-3 * (1 + b / 8), rel=0.1)
        assert models[b].per_depth == pytest.approx(0.51e-3 * (1 + b / 8), rel=0.2)
    ten = load_cost_table(write(tmp_path, hand_table(scale=10.0), "ten.json"))
    models10, _ = step_cost_models_from_table(ten, shape(), "hydra", COST_BATCHES, 5, log=lambda m: None)
    for b in COST_BATCHES:  # metamorphic: ten times the table, ten times every cost
        for t in grid:
            assert models10[b](t) == pytest.approx(10 * models[b](t), rel=1e-9)


def test_calibrate_from_records_with_a_cost_table(tmp_path, monkeypatch):
    """`entmtp calibrate --from-records --cost-table` on the shipped hydra/code records: every tree's
    cost in the written set is the table-fitted model's, and the set says where its costs came from."""
    monkeypatch.chdir(REPO)  # the shipped records are found under trees/
    tbl = write(tmp_path, hand_table())
    out = tmp_path / "gpu-set.json"
    assert main(["calibrate", "--drafter", "hydra", "--task", "code", "--from-records", "--cost-table", str(tbl),
                 "--out", str(out)]) == 0
    ts = load_tree_set(out)
    models, source = step_cost_models_from_table(load_cost_table(tbl), shape(), "hydra", COST_BATCHES, 5,
                                                 log=lambda m: None)
    assert ts.provenance["step_cost_source"] == source
    assert ts.hardware == "TEST GPU 9000 (cost table tbl.json)"
    assert ts.provenance["step_cost_model"] == {str(b): m.to_json() for b, m in models.items()}
    for entry in ts.trees:
        for b in COST_BATCHES:
            assert entry.cost(b) == pytest.approx(models[b](entry.tree), abs=1e-6)  # stored in microseconds
    # and not this machine's: the shipped CPU set of the same records has other costs
    cpu = load_tree_set(REPO / "trees" / "entmtp-tiny-hydra-code.json")
    assert cpu.provenance["step_cost_model"] != ts.provenance["step_cost_model"]


def _bad(table: dict, **change) -> dict:
    t = copy.deepcopy(table)
    t.update(change)
    return t


def _drop_batch(table: dict, batch: int) -> dict:
    t = copy.deepcopy(table)
    t["rows"] = [r for r in t["rows"] if r["batch"] != batch]
    return t


def _row(table: dict, **change) -> dict:
    t = copy.deepcopy(table)
    t["rows"][0].update(change)
    return t


@pytest.mark.parametrize("make,match", [
    (lambda t: "{not json", "is not JSON"),
    (lambda t: _bad(t, format="something-else"), "'format' must be 'entmtp-cost-table'"),
    (lambda t: _bad(t, version=7), "'version' must be 1"),
    (lambda t: {k: v for k, v in t.items() if k != "models"}, "missing field 'models'"),
    (lambda t: _row(t, median_ms=-1.0), "row 0: median_ms must be a positive number"),
    (lambda t: _row(t, what="target"), "row 0 lacks field 'width'"),
    (lambda t: _row(t, model="nobody"), "names model 'nobody'"),
    (lambda t: {**t, "rows": t["rows"] + t["rows"][:1]}, "two rows measure the same thing"),
    (lambda t: _drop_batch(t, 32), "at batch 32 has 0 measured size"),
    (lambda t: {**t, "models": {"x": {"shape": {**TINY_SHAPE, "num_hidden_layers": 30}, "dtype": "float16"}},
                "rows": [dict(r, model="x") for r in t["rows"]]}, "no model has this model's shape"),
])
def test_bad_tables_give_one_clear_error(tmp_path, make, match):
    raw = make(hand_table())
    path = tmp_path / "bad.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(CostTableError, match=match):
        step_cost_models_from_table(load_cost_table(path), shape(), "hydra", COST_BATCHES, 5, log=lambda m: None)


def test_cli_reports_a_bad_table_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["calibrate", "--drafter", "hydra", "--task", "code", "--from-records",
                 "--cost-table", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cost-table: cannot read cost table") and "nope.json" in err[0]
    tbl = write(tmp_path, hand_table())
    assert main(["calibrate", "--drafter", "medusa", "--task", "code", "--from-records", "--cost-table", str(tbl)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --cost-table: {tbl}: drafter_level of tiny-gpu (medusa) at batch 1 has 0 measured "
                   "size(s); at least 2 are needed"]
    assert main(["calibrate", "--drafter", "hydra", "--task", "code", "--cost-model", "x"]) == 2
    assert capsys.readouterr().err.strip() == "error: --cost-model needs --cost-table"

