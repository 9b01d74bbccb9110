"""Every `ENTMTP_*` environment switch, read once per process into one frozen record.

    from entmtp_sglang.settings import settings
    if settings().ragged: ...                  # parsed on first use, the same record after

`Settings.from_env(env)` parses a mapping (default `os.environ`); a bad value is a ValueError that names the switch
and the values it takes (`ENTMTP_RAGGED='maybe': takes 0 or 1`; a 0-or-1 switch also takes off/on, false/true and
no/yes, in any case). An unset or empty variable keeps the default. Code below reads the record, never `os.environ`
(SGLang's, Triton's and the Hub's own variables excepted). Each field carries its switch: the variable, the values
it takes and a one-line meaning, from which `markdown_table()` writes the table of docs/settings.md
(`python -m entmtp_sglang.settings` prints it; a test checks the two agree). Tests that set a variable drop the
cached record with `settings.cache_clear()` (tests/conftest.py does so on every `monkeypatch.setenv`/`delenv`).
Nothing here imports torch, nor anything of the package: every layer may read it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Inside SGLang a rest ends in a catch-up pass (one draft extend over the rested positions, 4-9 ms at batch 1 on
# this CPU, bench/sglang_step_profile.py), so rests run up to 16 steps, not the reference engine's 4: a run of
# back-offs pays that pass once per 17 steps instead of once per 5
SGLANG_MAX_REST = 16
MAX_REST_LIMIT = 64   # a rest owes the drafter one position per step, caught up in one pass when it ends
DEFAULT_FORCED_MAX_TOKENS = 16
# the choices of two switches, kept here so that this module imports nothing of the package (the kernels read it);
# tests/test_settings.py checks them against their owners
SERVER_POLICIES = ("entmtp", "entmtp-bins", "entmtp-predictor")   # policy/registry.py's SERVER_POLICIES
LINEAR_PATHS = ("auto", "fewrow", "onednn", "torch")   # model/linear.py: "auto" and its PATHS
DEFAULT_CACHE = Path("~/.cache/entmtp")

_OFF, _ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes")


# --- the kinds of value a switch takes: parse a non-empty stripped string, or say what holds ------------------------

@dataclass(frozen=True)
class Flag:
    values = "0 or 1"   # off/on, false/true and no/yes too

    def parse(self, raw: str) -> bool:
        if raw.lower() not in _OFF + _ON:
            raise ValueError
        return raw.lower() in _ON

    def holds(self, value) -> bool:
        return isinstance(value, bool)

    def show(self, value) -> str:
        return "1" if value else "0"


@dataclass(frozen=True)
class Count:
    low: int
    high: int | None = None

    @property
    def values(self) -> str:
        return f"an integer >= {self.low}" if self.high is None else f"an integer in {self.low}..{self.high}"

    def parse(self, raw: str) -> int:
        value = int(raw)
        if not self.holds(value):
            raise ValueError
        return value

    def holds(self, value) -> bool:
        return (isinstance(value, int) and not isinstance(value, bool) and value >= self.low
                and (self.high is None or value <= self.high))

    def show(self, value) -> str:
        return str(value)


@dataclass(frozen=True)
class Choice:
    choices: tuple[str, ...]

    @property
    def values(self) -> str:
        return "one of " + ", ".join(self.choices)

    def parse(self, raw: str) -> str:
        if raw.lower() not in self.choices:
            raise ValueError
        return raw.lower()

    def holds(self, value) -> bool:
        return value in self.choices

    def show(self, value) -> str:
        return value


@dataclass(frozen=True)
class PathValue:
    what: str              # "a file", "a directory"
    optional: bool = True  # None (unset) is a value

    @property
    def values(self) -> str:
        return f"{self.what} path"

    def parse(self, raw: str) -> Path:
        return Path(raw).expanduser()

    def holds(self, value) -> bool:
        return isinstance(value, Path) or (self.optional and value is None)

    def show(self, value) -> str:
        return str(value)


@dataclass(frozen=True)
class Switch:
    env: str                       # the variable
    kind: Flag | Count | Choice | PathValue
    meaning: str                   # one line, as the docs table says it
    default_text: str | None = None  # the docs' default where the value alone does not say it
    older: tuple[str, ...] = ()    # older spellings of the variable, read when it is unset

    @property
    def values(self) -> str:
        return self.kind.values


def _switch(env: str, kind, default, meaning: str, default_text: str | None = None, older: tuple[str, ...] = (),
            factory=None):
    meta = {"switch": Switch(env, kind, meaning, default_text, older)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _default_cache() -> Path:
    return DEFAULT_CACHE.expanduser()


@dataclass(frozen=True)
class Settings:
    """One field per `ENTMTP_*` switch (its `Switch` in the field's metadata), validated on construction: a value
    of the wrong kind or out of range is a ValueError naming the variable. Build it with `from_env`."""

    # -- the tree set and the policy (sglang/config.py) --
    tree_set_path: Path | None = _switch(
        "ENTMTP_TREE_SET", PathValue("a tree-set file"), None,
        "the tree set to serve; `--speculative-adaptive-config FILE` does the same when FILE is an EntMTP tree set",
        "the shipped set for the served directory's name; none: a generic set, calibrated online")
    force_tree_set: bool = _switch(
        "ENTMTP_FORCE_TREE_SET", Flag(), False,
        "`1`: serve a set calibrated for another model (refused at start-up otherwise)")
    policy: str = _switch(
        "ENTMTP_POLICY", Choice(SERVER_POLICIES), "entmtp",
        "how a tree is scored: `entmtp` (the set's per-node acceptance predictor when it has one, else its signal "
        "bins), `entmtp-predictor`, `entmtp-bins`")
    grammar_draft: bool = _switch(
        "ENTMTP_GRAMMAR_DRAFT", Flag(), True,
        "`0`: no grammar-aware drafting and no grammar-masked signal for `json_schema`/`regex`/`ebnf` requests")
    online_calibration: bool = _switch(
        "ENTMTP_ONLINE_CALIBRATION", Flag(), False,
        "`1`: refit a calibrated set's acceptance predictor and step costs from served steps (every 64 steps)",
        "`0` (always on for the generic set)")
    online_costs: bool = _switch(
        "ENTMTP_ONLINE_COSTS", Flag(), True,
        "`0`: keep the set's step costs instead of refitting them from this server's timed steps")
    max_rest: int = _switch(
        "ENTMTP_MAX_REST", Count(0, MAX_REST_LIMIT), SGLANG_MAX_REST,
        "the longest rest of the drafter after backing off to chain:0 (1, 2, 4, ... steps); `0`: run the drafter "
        "every step")
    guard: bool = _switch(
        "ENTMTP_GUARD", Flag(), True,
        "`0`: no guard (by default, at 4 requests and more, a batch size where this server's speculating steps "
        "emitted 2% fewer tokens per second than its resting ones, the decision's time included, rests; "
        "docs/sglang.md, \"Per step\")")
    # -- the decode step (sglang/worker.py, sglang/forced_draft.py) --
    per_row_trees: bool = _switch(
        "ENTMTP_PER_ROW_TREES", Flag(), True,
        "`0`: one tree for the whole batch (the batch's best) instead of each request its own tree at the node "
        "count and depth the batch shares")
    ragged: bool = _switch(
        "ENTMTP_RAGGED", Flag(), True,
        "`0`: every row of a speculating step verifies the step's node count (no ragged verify, no row resting "
        "inside a speculating step)")
    forced_spans: bool = _switch(
        "ENTMTP_FORCED_SPANS", Flag(), True,
        "`0`: no forced spans (the text a request's grammar decides is not drafted below its tree; they need "
        "ragged verify)")
    rest_spans: str = _switch(
        "ENTMTP_REST_SPANS", Choice(("0", "1", "auto")), "auto",
        "whether a resting row still takes its span, verified as a chain below its root: `auto` in a step of fewer "
        "than 4 requests (from 4 on a verified token is no longer nearly free on a CPU, and spans on resting steps "
        "cost more than they returned: the mixed batch at 8 requests 0.79x plain with them, 1.00x without, "
        "2026-12-07), `1` at every batch size, `0` never (a resting step verifies its roots alone)")
    lookup_spans: str = _switch(
        "ENTMTP_LOOKUP_SPANS", Choice(("0", "1", "all")), "all",
        "a request's own text repeating (prompt lookup) as spans, below its tree and where its grammar decides "
        "nothing: `all` every request, `1` constrained requests only, `0` off")
    cross_spans: bool = _switch(
        "ENTMTP_CROSS_SPANS", Flag(), False,
        "`1`: lookup spans also draw on what earlier requests wrote (a bounded server-wide index of finished "
        "outputs, emptied with the radix cache; entmtp_sglang/shared_ngrams.py) where a request's own text has no "
        "longer match; off until the agent benchmark (issue 60) measures where it pays")
    span_ends: bool = _switch(
        "ENTMTP_SPAN_ENDS", Flag(), True,
        "`0`: a grammar span ends in its text's last token as the tokenizer spells it alone, instead of the token "
        "the model writes there joined to what follows (`\"` -> `\":` after a key under free whitespace)")
    forced_max_tokens: int = _switch(
        "ENTMTP_FORCED_MAX_TOKENS", Count(1), DEFAULT_FORCED_MAX_TOKENS,
        "the longest forced span per request and step")
    # -- what the server writes down --
    record_path: Path | None = _switch(
        "ENTMTP_RECORD", PathValue("a file"), None,
        "append one JSON line per verified step (what `entmtp calibrate --engine sglang` reads)")
    profile_path: Path | None = _switch(
        "ENTMTP_PROFILE", PathValue("a file"), None,
        "append each decode step's seconds per stage (choose, catch-up, draft, verify, draft extend) as a JSON line")
    tree_trace_dir: Path | None = _switch(
        "ENTMTP_TREE_TRACE", PathValue("a directory"), None,
        "each rank appends each decode step's trees (the shape-setting `tree`, and `trees`: each request's own, in "
        "`rids` order) to `DIR/trees-tp<rank>-pid<pid>.jsonl`")
    # -- SGLang on the CPU and the kernels (sglang/cpu/, model/linear.py, kernels/) --
    cpu_sampling: bool = _switch(
        "ENTMTP_CPU_SAMPLING", Flag(), True,
        "`0`: on CPU, give sampled requests SGLang's greedy verification instead of exact tree rejection sampling")
    linear: str = _switch(
        "ENTMTP_LINEAR", Choice(LINEAR_PATHS), "auto",
        "the float32 CPU linear path of SGLang with the plugin and of the reference engine: `auto` (the "
        "batch-invariant path `entmtp kernels` measured fastest here, cached in `$ENTMTP_CACHE/linear_path.json`), "
        "`fewrow` (the few-row kernel), `onednn` (oneDNN on a packed weight), `torch` (`F.linear`: nothing hooked)")
    onednn: bool = _switch(
        "ENTMTP_ONEDNN", Flag(), True,
        "the older switch: `0` means `ENTMTP_LINEAR=torch` (`ENTMTP_ONEDNN_HEAD`, older still, is read when it is "
        "unset)", older=("ENTMTP_ONEDNN_HEAD",))
    rowwise: bool = _switch(
        "ENTMTP_ROWWISE", Flag(), True,
        "`0` leaves float32 RMSNorm, SiLU-and-mul and rotary embedding (SGLang's CPU engine, the reference engine) "
        "to torch's own ops instead of the row-wise ops of `kernels/rowwise_ops.cpp`")
    fewrow: bool = _switch(
        "ENTMTP_FEWROW", Flag(), True,
        "`0`: never build or load the few-row linear kernel (`kernels/fewrow_linear.cpp`); linear layers take "
        "another path")
    cache_dir: Path = _switch(
        "ENTMTP_CACHE", PathValue("a directory", optional=False), None,
        "prepared models, built kernels, the linear-path choice, training data and runs (outside the repository)",
        "`~/.cache/entmtp`", factory=_default_cache)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            s: Switch = f.metadata["switch"]
            value = getattr(self, f.name)
            if not s.kind.holds(value):
                raise ValueError(f"{s.env}={value!r} ({f.name}): takes {s.values}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Parse every switch from `env` (default `os.environ`): unset or empty keeps the default; a bad value is a
        ValueError naming the variable as set and the values it takes."""
        env = os.environ if env is None else env
        values = {}
        for f in dataclasses.fields(cls):
            s: Switch = f.metadata["switch"]
            name = next((n for n in (s.env, *s.older) if n in env), s.env)
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                values[f.name] = s.kind.parse(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: takes {s.values}") from None
        return cls(**values)

    @classmethod
    def switches(cls) -> dict[str, Switch]:
        """Field name -> its switch, in the record's order."""
        return {f.name: f.metadata["switch"] for f in dataclasses.fields(cls)}

    @classmethod
    def env_names(cls) -> frozenset[str]:
        """Every variable the record reads, older spellings included."""
        return frozenset(n for s in cls.switches().values() for n in (s.env, *s.older))


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """This process's settings, parsed from the environment on first use (`settings.cache_clear()` re-reads)."""
    return Settings.from_env()


def markdown_table() -> str:
    """The docs' table of every switch: variable, values, default, meaning."""
    defaults = Settings()
    rows = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for name, s in Settings.switches().items():
        value = getattr(defaults, name)
        default = s.default_text or ("unset" if value is None else f"`{s.kind.show(value)}`")
        rows.append(f"| `{s.env}` | {s.values} | {default} | {s.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
