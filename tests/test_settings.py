"""The `ENTMTP_*` switches: one frozen record parsed once (entmtp_sglang/settings.py), the docs' table written from
it, and no switch read around it."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

from entmtp_sglang.settings import (
    LINEAR_PATHS,
    MAX_REST_LIMIT,
    SERVER_POLICIES,
    SGLANG_MAX_REST,
    Settings,
    markdown_table,
    settings,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "settings.md"
SOURCES = sorted([*(ROOT / "entmtp_sglang").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
SWITCH = re.compile(r"\bENTMTP_[A-Z0-9_]*[A-Z0-9]\b")
# modules that still read a switch from os.environ themselves, and why (none: every switch is read through the record)
READ_AROUND: set[str] = set()


def test_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.tree_set_path, s.record_path, s.profile_path, s.tree_trace_dir) == (None, None, None, None)
    assert (s.policy, s.lookup_spans, s.linear, s.rest_spans) == ("entmtp", "all", "auto", "auto")
    assert (s.max_rest, s.forced_max_tokens) == (SGLANG_MAX_REST, 16)
    assert not s.force_tree_set and not s.online_calibration
    assert all((s.grammar_draft, s.online_costs, s.guard, s.per_row_trees, s.ragged, s.forced_spans,
                s.span_ends, s.cpu_sampling, s.onednn, s.rowwise, s.fewrow))
    assert s.cache_dir == Path("~/.cache/entmtp").expanduser()


@pytest.mark.parametrize("raw, value", [
    ("0", False), (" 0 ", False), ("false", False), ("OFF", False), ("no", False),
    ("1", True), ("True", True), ("on", True), ("YES", True),
])
def test_a_flag_takes_its_spellings(raw, value):
    assert Settings.from_env({"ENTMTP_RAGGED": raw}).ragged is value
    assert Settings.from_env({"ENTMTP_ONLINE_CALIBRATION": raw}).online_calibration is value


def test_unset_or_empty_keeps_the_default():
    empty = {name: "" for name in Settings.env_names()} | {"ENTMTP_GUARD": "  "}
    assert Settings.from_env(empty) == Settings()


def test_values_are_parsed_to_their_kinds(tmp_path):
    s = Settings.from_env({
        "ENTMTP_MAX_REST": " 0 ", "ENTMTP_FORCED_MAX_TOKENS": "6", "ENTMTP_LOOKUP_SPANS": " ALL ",
        "ENTMTP_POLICY": "Entmtp-Bins", "ENTMTP_LINEAR": "Torch", "ENTMTP_TREE_SET": str(tmp_path / "set.json"),
        "ENTMTP_RECORD": " steps.jsonl ", "ENTMTP_TREE_TRACE": "~/trace", "ENTMTP_CACHE": str(tmp_path),
    })
    assert (s.max_rest, s.forced_max_tokens, s.lookup_spans, s.policy, s.linear) == (0, 6, "all", "entmtp-bins",
                                                                                     "torch")
    assert s.tree_set_path == tmp_path / "set.json" and s.record_path == Path("steps.jsonl")
    assert s.tree_trace_dir == Path("~/trace").expanduser() and s.cache_dir == tmp_path
    assert Settings.from_env({"ENTMTP_MAX_REST": str(MAX_REST_LIMIT)}).max_rest == MAX_REST_LIMIT


def test_the_older_onednn_spellings():
    assert not Settings.from_env({"ENTMTP_ONEDNN": "0"}).onednn
    assert not Settings.from_env({"ENTMTP_ONEDNN_HEAD": "0"}).onednn             # read when ENTMTP_ONEDNN is unset
    assert Settings.from_env({"ENTMTP_ONEDNN": "1", "ENTMTP_ONEDNN_HEAD": "0"}).onednn


@pytest.mark.parametrize("name, raw, takes", [
    ("ENTMTP_RAGGED", "maybe", "0 or 1"),
    ("ENTMTP_SPAN_ENDS", "2", "0 or 1"),
    ("ENTMTP_MAX_REST", "-1", f"an integer in 0..{MAX_REST_LIMIT}"),
    ("ENTMTP_MAX_REST", str(MAX_REST_LIMIT + 1), f"an integer in 0..{MAX_REST_LIMIT}"),
    ("ENTMTP_MAX_REST", "lots", f"an integer in 0..{MAX_REST_LIMIT}"),
    ("ENTMTP_FORCED_MAX_TOKENS", "0", "an integer >= 1"),
    ("ENTMTP_FORCED_MAX_TOKENS", "1.5", "an integer >= 1"),
    ("ENTMTP_POLICY", "oracle", "one of entmtp, entmtp-bins, entmtp-predictor"),
    ("ENTMTP_LOOKUP_SPANS", "yes", "one of 0, 1, all"),
    ("ENTMTP_LINEAR", "fast", "one of auto, fewrow, onednn, torch"),
    ("ENTMTP_ONEDNN_HEAD", "off please", "0 or 1"),   # an older spelling is named as set
])
def test_a_bad_value_names_the_switch_and_the_values_it_takes(name, raw, takes):
    with pytest.raises(ValueError) as e:
        Settings.from_env({name: raw})
    assert str(e.value) == f"{name}={raw!r}: takes {takes}"


def test_the_record_is_validated_and_frozen():
    with pytest.raises(ValueError, match=r"ENTMTP_MAX_REST=65 \(max_rest\): takes an integer in 0\.\.64"):
        Settings(max_rest=65)
    with pytest.raises(ValueError, match="ENTMTP_RAGGED='0' .* takes 0 or 1"):
        Settings(ragged="0")   # a string is not a flag: parse with from_env
    with pytest.raises(ValueError, match="ENTMTP_CACHE=None"):
        Settings(cache_dir=None)
    with pytest.raises(ValueError, match="ENTMTP_POLICY"):
        Settings(policy="oracle")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().ragged = False


def test_settings_are_read_once_until_the_cache_is_cleared(monkeypatch):
    monkeypatch.setenv("ENTMTP_MAX_REST", "3")   # conftest: setenv drops the cached record
    first = settings()
    assert first.max_rest == 3 and settings() is first
    monkeypatch.setitem(os.environ, "ENTMTP_MAX_REST", "5")   # behind the cache's back: not seen
    assert settings() is first
    settings.cache_clear()
    assert settings().max_rest == 5


def test_the_choices_are_their_owners():
    from entmtp_sglang.model.linear import PATHS
    from entmtp_sglang.policy import registry

    assert LINEAR_PATHS == ("auto", *PATHS)
    assert SERVER_POLICIES == registry.SERVER_POLICIES


# --- the docs' table ---------------------------------------------------------------------------------------------

def _docs_table() -> str:
    lines = DOCS.read_text().splitlines()
    start = lines.index("| variable | values | default | meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def test_the_docs_table_names_every_switch_and_no_other():
    named = {m.group(1) for m in re.finditer(r"^\| `(ENTMTP_[A-Z0-9_]+)` \|", _docs_table(), re.M)}
    switches = {s.env for s in Settings.switches().values()}
    assert not switches - named, f"switches missing from docs/settings.md: {sorted(switches - named)}"
    assert not named - switches, f"docs/settings.md names switches the record lacks: {sorted(named - switches)}"


def test_the_docs_table_is_the_records():
    assert _docs_table() == markdown_table(), \
        "docs/settings.md's table is not the record's: rewrite it with `python -m entmtp_sglang.settings`"


# --- nothing read around the record ------------------------------------------------------------------------------

def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_every_switch_named_in_the_code_is_the_records():
    """Every `ENTMTP_*` string in the package's code (not its docstrings) is a switch of the record: a new
    `os.environ.get("ENTMTP_NEW")`, or a message naming a switch that is gone, fails here."""
    known, unknown = Settings.env_names(), {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for name in set(SWITCH.findall(node.value)) - known:
                    unknown.setdefault(name, []).append(f"{_rel(path)}:{node.lineno}")
    assert not unknown, f"ENTMTP_* names the record (entmtp_sglang/settings.py) lacks: {unknown}"


def _env_reads(tree: ast.AST):
    """(key expression, line) of each os.environ.get / os.getenv / os.environ[...] / `in os.environ` read."""
    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) \
            and n.value.id == "os"
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and isinstance(n.func, ast.Attribute) and (
                (n.func.attr == "get" and is_environ(n.func.value))
                or (n.func.attr == "getenv" and isinstance(n.func.value, ast.Name) and n.func.value.id == "os")):
            yield n.args[0], n.lineno
        elif isinstance(n, ast.Subscript) and is_environ(n.value) and isinstance(n.ctx, ast.Load):
            yield n.slice, n.lineno
        elif isinstance(n, ast.Compare) and any(is_environ(c) for c in n.comparators):
            yield n.left, n.lineno


def test_no_switch_is_read_from_the_environment_around_the_record():
    trees = {path: ast.parse(path.read_text(), str(path)) for path in SOURCES}
    constants = {}   # NAME = "ENTMTP_..." at a module's top level (ENV_RAGGED and the like), by name
    for tree in trees.values():
        for n in tree.body:
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
                constants.update({t.id: n.value.value for t in n.targets if isinstance(t, ast.Name)})
    readers = {}
    for path, tree in trees.items():
        if _rel(path) == "entmtp_sglang/settings.py":
            continue
        for key, line in _env_reads(tree):
            name = (key.value if isinstance(key, ast.Constant)
                    else constants.get(key.id if isinstance(key, ast.Name) else getattr(key, "attr", ""), "?"))
            if not isinstance(name, str) or name == "?" or name.startswith("ENTMTP_"):
                readers.setdefault(_rel(path), []).append(f"{line}: {name}")
    around = {k: v for k, v in readers.items() if k not in READ_AROUND}
    assert not around, f"read these from entmtp_sglang.settings.settings(), not os.environ: {around}"
    assert set(readers) == READ_AROUND, \
        f"{sorted(READ_AROUND - set(readers))} read the record now: drop them from READ_AROUND in this file"
