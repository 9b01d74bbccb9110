"""The product benchmark: ENTMTP as `make serve` starts it against stock SGLang, plain SGLang with this package
installed (on its `entmtp_torch` attention, the baseline of what speculation adds, and on `torch_native`), SGLang's
EAGLE (the static grid) and `--speculative-adaptive`, on SmolLM2-135M-Instruct on this CPU.

    .venv/bin/python bench/sglang_speed.py --ladder         # the product run: about 2 h 10 min on 2 cores, estimated
    .venv/bin/python bench/sglang_speed.py                  # every system on every workload: hours; --systems to cut
    .venv/bin/python bench/sglang_speed.py --render bench/results/sglang_speed.jsonl.gz  # the table again, no servers
    .venv/bin/python bench/sglang_speed.py --render bench/results/sglang_speed.jsonl.gz --headline  # README's tables
    .venv/bin/python bench/sglang_speed.py --tasks code --batches 1 --per-task 2 --max-new-tokens 8 --repeats 1
        --systems plain,entmtp --out /tmp/smoke      # a smoke run (a few minutes): stock, both plains, ENTMTP, code

The ladder (`--ladder`, issue 58): stock SGLang in float32 and bfloat16, plain with the package on `torch_native` and
on `entmtp_torch`, SGLang's EAGLE (s1-k1-n2, the best static setting of earlier runs, and adaptive) and SGLang's own
NGRAM on the package's layers and attention, and ENTMTP three times: the drafter's trees only (`entmtp-no-spans`),
with lookup spans (`entmtp-no-forced`), as served (`entmtp`). Three passes, each its own servers
(`ladder_passes`): every rung on a mixed stream of `--ladder-per-task` prompts of each task (default 2, ten requests)
at batch 1 and 4 and on the mixed batch of twice as many (16 requests) at `--mixed-batch-batches`, stock and plain on
entmtp_torch in every wave and ENTMTP's three rungs in one wave; then stock in both dtypes, plain on entmtp_torch and
ENTMTP on each task (8 prompts by default) at batch 1; then those four on the compact JSON layout. Defaults with
`--ladder`: 8 prompts per task from the measurement set, 96 new tokens, 3 repeats, each pass from an empty radix
cache (NGRAM's corpus emptied with it), servers shuffled per repeat. The headline's first table is the ladder
(`ladder`): each rung's gain over the rung it builds on, paired.

Systems (entmtp_sglang/bench/sglang_benchmark.py says how each is started):
- `plain-stock`, the baseline: stock SGLang, this package's general plugin not loaded (SGLANG_PLUGINS=entmtp_cpu_ops:
  only the eight sgl_kernel CPU ops SGLang cannot start on a CPU without), SGLang's own linear layers, attention
  (torch_native) and sampling. Every ratio over stock divides by it, every paired one by its run beside in the same
  wave.
- `plain-stock-bf16`: the same stock SGLang serving in bfloat16 (`--dtype bfloat16`, what SGLang's `--dtype auto`
  serves this checkpoint in, so the stock a CPU user would run; the other servers serve float32, the only dtype the
  package's layers take). Its outputs round differently and are its own: compared with nothing. The headline's "vs
  stock SGLang in bfloat16" columns divide by it.
- `plain-entmtp`, the baseline of what speculation adds: plain SGLang with this package installed (the plugin's CPU
  linear layers, sglang/cpu/linear.py, and row-wise ops) on the plugin's `entmtp_torch` attention, the backend ENTMTP
  and the EAGLE servers run on, with SGLang's overlap scheduling on as plain SGLang runs it (nothing turns it off:
  SGLang does only for speculative algorithms on a CPU, the plugin only for ENTMTP). Every "what speculation adds"
  figure divides by it: the table's `vs plain-entmtp, paired` column, ENTMTP's table against EAGLE (`versus`), and
  in the headline the column over it, ENTMTP vs plain and the third table. ENTMTP's greedy output is checked
  against it token for token (the same layers), and every output against stock's too.
- `plain`: the same plain server on SGLang's `torch_native` attention (what the package's layers alone give over
  stock); its greedy outputs are checked against `plain-entmtp`'s, so the two plain servers must agree. Runs from
  before `plain-entmtp` (the committed one among them) divide what speculation adds by `plain` instead
  (`speculation_baseline`), and render as they did.
- `entmtp`: `--speculative-algorithm ENTMTP` as `make serve` starts it.
- `ngram`: SGLang's NGRAM (`--speculative-algorithm NGRAM`, 12 draft tokens, its defaults otherwise), on the package's
  layers and `entmtp_torch` (SGLang's `torch_native` fails its verify pass on a CPU); the package supplies its one
  sgl-kernel op, `reconstruct_indices_from_tree_mask` (tests/test_sglang_ops.py, tests/test_sglang_ngram.py).
- SGLang's EAGLE over the static grid (s1-k1-n2, s2-k1-n3, s3-k1-n4, s3-k2-n6) and `--speculative-adaptive`, with the
  same EAGLE drafter and token map. Stock SGLang cannot run them on a CPU (torch_native refuses EAGLE; intel_amx
  needs a CPU build of sgl-kernel), so they run in the closest form: the plugin loaded for its `entmtp_torch`
  attention and CPU ops, on SGLang's own layers (ENTMTP_LINEAR=torch, ENTMTP_ROWWISE=0; `--eagle-layers package`
  puts them on the plugin's layers instead).
Each SmolLM2 server holds 3-4 GiB here, so no more than five are up at once (--at-once, `waves`): the three
baselines, stock in float32 and in bfloat16 and `plain-entmtp`, in every wave (EVERY_WAVE), two others beside them, in
SYSTEMS' order: ENTMTP with adaptive first, then the static grid two at a time, and `plain` (torch_native) last (four
waves, 17 server runs, by default; `--systems entmtp,eagle-adaptive,eagle-s1-k1-n2,plain` runs two waves). Every
ratio the README uses stays computable and paired, as each needs only a system and the baselines of its wave: over
stock in either dtype (every system), over `plain-entmtp` (ENTMTP, EAGLE, adaptive, `plain`), and ENTMTP against
EAGLE through `plain-entmtp`. A second table gives ENTMTP's paired ratio over the best static EAGLE setting's and
adaptive's (each over the `plain-entmtp` run beside it; over stock in older runs).

Workloads (through the model's chat template, greedy, float32): code, chat, prose, JSON under a schema, tool calls
under a schema, each at batch 1 and 4; the mixed stream (all of them, task after task) at batch 8 and 16, and at
batch 1 and 4 as the sum of the five tasks' runs (the same requests: tokens over seconds added up); the mixed batch
(JSON, tool calls, code and chat taken in turn, so that every batch in flight mixes them, as agent traffic does) at
batch 4, 8 and 16, with a table of the trees each kind of request took inside it (ENTMTP picks a tree per request).
The prompts (`--prompts`): the measurement set by default (bench/workloads/measure.json, written for measuring and
never used to tune anything), or the development set's held-out split (`dev`: the task prompts and
bench/workloads/tool_calls.json, which runs before 2026-12-07 measured). The two schema workloads run again in the
compact JSON layout (`json-compact`, `tool-call-compact`: stock in both dtypes, both plains and ENTMTP, one wave,
restarted with SGLang's --constrained-json-disable-any-whitespace, where the grammar alone decides much more of the
text; `--json-layouts`). The forced-spans column: the share of the output tokens that came from forced spans (text
the grammar decides, drafted below ENTMTP's trees), their acceptance and tokens verified per span; after
"repeats:", the same for lookup spans (the request's own text repeating where the grammar decides nothing,
ENTMTP_LOOKUP_SPANS). The servers of a wave are measured interleaved (entmtp_sglang/bench/sglang_benchmark.py),
each repeat and workload in a new seeded random order (`--order fixed`: stock first, then stock in bfloat16 and
`plain-entmtp`, then the others), each pass from an empty radix cache (`--no-flush`: a repeat reuses the prefill
of the same prompts); tokens/s is the median over repeats, and every output is compared with plain decoding's (with
this package: `plain-entmtp`'s) and stock SGLang's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    ADAPTIVE,
    EAGLE_GRID,
    NGRAM,
    PLAIN,
    PLAIN_ENTMTP,
    STOCK,
    STOCK_BF16,
    Row,
    SystemSpec,
    baseline_of,
    best_paired,
    bootstrap_interval,
    machine,
    meta_from_jsonl,
    over_best,
    paired_over,
    paired_ratio,
    paired_ratios,
    rows_from_jsonl,
    run_workloads,
    sglang_layers,
    speculation_baseline,
    to_markdown,
    versus,
    write,
)
from entmtp_sglang.bench.workload import tool_calls
from entmtp_sglang.grammar import schema_prompt_grammars
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.tasks import load_prompts, load_schema

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "bench" / "workloads" / "tool_calls.json"
# the measurement prompt set (issue 58): written for measuring only, never used to tune anything; `--prompts dev`
# takes the development set instead (the held-out test split of entmtp_sglang/data/prompts and TOOLS)
MEASURE = ROOT / "bench" / "workloads" / "measure.json"
PROMPT_SETS = ("measure", "dev")
ENTMTP = SystemSpec("entmtp", "ENTMTP")
# SGLang's EAGLE and --speculative-adaptive as close to stock as they run on a CPU (module docstring)
EAGLE_SGLANG_LAYERS = tuple(sglang_layers(s) for s in (ADAPTIVE, *EAGLE_GRID))
# ENTMTP as it was before each request drafted its own tree: one tree for the whole batch (an ablation; not run
# unless named)
ENTMTP_ONE_TREE = SystemSpec("entmtp-one-tree", "ENTMTP", env=(("ENTMTP_PER_ROW_TREES", "0"),))
# each request its own tree, but every row of a speculating step verifies the step's node count (no ragged verify,
# no resting rows inside a speculating step): an ablation, not run unless named
ENTMTP_NO_RAGGED = SystemSpec("entmtp-no-ragged", "ENTMTP", env=(("ENTMTP_RAGGED", "0"),))
# without forced spans (the text a request's grammar decides, drafted below its tree): an ablation, not run unless named
ENTMTP_NO_FORCED = SystemSpec("entmtp-no-forced", "ENTMTP", env=(("ENTMTP_FORCED_SPANS", "0"),))
# forced spans of the grammar's text only, without the request's own text repeating where the grammar decides
# nothing (lookup spans): an ablation, not run unless named
ENTMTP_NO_LOOKUP = SystemSpec("entmtp-no-lookup", "ENTMTP", env=(("ENTMTP_LOOKUP_SPANS", "0"),))
# lookup spans on constrained rows only (rows without a grammar take no repeats as spans): an ablation, not run
# unless named
ENTMTP_LOOKUP_CONSTRAINED = SystemSpec("entmtp-lookup-constrained", "ENTMTP", env=(("ENTMTP_LOOKUP_SPANS", "1"),))
# spans only on speculating steps: a step the policy rests verifies its roots alone (before spans came to resting
# steps): an ablation, not run unless named
ENTMTP_NO_REST_SPANS = SystemSpec("entmtp-no-rest-spans", "ENTMTP", env=(("ENTMTP_REST_SPANS", "0"),))
# grammar spans ending in their text's last token as the tokenizer spells it, not in the token the model writes there
# joined to what follows (forced_spans.SpanEnds): an ablation, not run unless named
ENTMTP_NO_SPAN_ENDS = SystemSpec("entmtp-no-span-ends", "ENTMTP", env=(("ENTMTP_SPAN_ENDS", "0"),))
# without the guard that rests a batch size where speculating steps delivered fewer tokens per second than resting
# ones (policy/guard.py): an ablation, not run unless named
ENTMTP_NO_GUARD = SystemSpec("entmtp-no-guard", "ENTMTP", env=(("ENTMTP_GUARD", "0"),))
# the drafter's trees alone: neither lookup spans (the request's own repeats) nor grammar spans (the text its grammar
# decides), the ladder's first ENTMTP rung (`LADDER`)
ENTMTP_NO_SPANS = SystemSpec("entmtp-no-spans", "ENTMTP",
                             env=(("ENTMTP_LOOKUP_SPANS", "0"), ("ENTMTP_FORCED_SPANS", "0")))
# ENTMTP with the EAGLE-3 drafter trained on fixed data (models/<model>/eagle3/, issue 38), where the model has one
ENTMTP_EAGLE3 = SystemSpec("entmtp-eagle3", "ENTMTP", draft="eagle3")
# ENTMTP with another drafter's weights (`--compare-draft DIR`: say the drafter shipped before a refresh, against the
# one shipped now), in the same run
COMPARE = SystemSpec("entmtp-compare-draft", "ENTMTP")
# stock (float32 and bfloat16) and plain on entmtp_torch in every wave (the three baselines); ENTMTP's wave first,
# beside adaptive; plain on torch_native last (module docstring)
SYSTEMS = (STOCK, STOCK_BF16, PLAIN_ENTMTP, ENTMTP, *EAGLE_SGLANG_LAYERS, PLAIN)
OPTIONAL = (NGRAM, ENTMTP_NO_SPANS, ENTMTP_EAGLE3, ENTMTP_ONE_TREE, ENTMTP_NO_RAGGED, ENTMTP_NO_FORCED,
            ENTMTP_NO_LOOKUP, ENTMTP_NO_REST_SPANS, ENTMTP_LOOKUP_CONSTRAINED, ENTMTP_NO_SPAN_ENDS, ENTMTP_NO_GUARD)
EVERY_WAVE = (STOCK.name, STOCK_BF16.name, PLAIN_ENTMTP.name)
BASELINES = (STOCK, STOCK_BF16, PLAIN_ENTMTP)   # always run: every ratio divides by one of them
DEFAULT = tuple(s.name for s in SYSTEMS)
AT_ONCE = 5   # each SmolLM2 server holds 3-4 GiB here (front end, scheduler, detokenizer): five fit in 24 GiB
# (16.7 GiB in use with five up at once, 2026-12-07)
TASKS = ("code", "chat", "prose", "json", "tool-call")
# the schema workloads again in the compact JSON layout (SGLang's --constrained-json-disable-any-whitespace, a
# server flag: a second set of servers), on these systems where they run
COMPACT = "--constrained-json-disable-any-whitespace"
COMPACT_TASKS = ("json", "tool-call")
COMPACT_SYSTEMS = (STOCK.name, STOCK_BF16.name, PLAIN_ENTMTP.name, PLAIN.name, ENTMTP.name, ENTMTP_EAGLE3.name,
                   ENTMTP_NO_FORCED.name, ENTMTP_NO_LOOKUP.name, ENTMTP_NO_REST_SPANS.name, ENTMTP_NO_SPAN_ENDS.name)
# the mixed batch: agent traffic, every batch in flight mixing schema extraction, tool calls, code and chat
MIXED_BATCH_TASKS = ("json", "tool-call", "code", "chat")
BEST_STATIC = "best static"   # a rung (and a headline line) for the best static EAGLE setting of the run, by name
# The ladder from stock SGLang to ENTMTP (`--ladder` runs it, `ladder` tables it): each rung's system, its line, and
# the rungs its gain divides by, the first of them the run has (paired, `paired_over`). Where a rung builds on the
# one before it, that one; the speculative algorithms stand side by side on plain with the package on entmtp_torch
# (the same layers and attention), and ENTMTP's span kinds are added one at a time.
LADDER = (
    (STOCK.name, "stock SGLang, float32", ()),
    (STOCK_BF16.name, "stock SGLang, bfloat16 (what `--dtype auto` serves)", (STOCK.name,)),
    (PLAIN.name, "+ this package's CPU layers (SGLang's `torch_native` attention)", (STOCK.name,)),
    (PLAIN_ENTMTP.name, "+ its `entmtp_torch` attention, overlap on: plain decoding", (PLAIN.name, STOCK.name)),
    (BEST_STATIC, "SGLang EAGLE, the best static setting (`{setting}`{layers})", (PLAIN_ENTMTP.name,)),
    (ADAPTIVE.name, "SGLang EAGLE, `--speculative-adaptive`{layers}", (PLAIN_ENTMTP.name,)),
    (NGRAM.name, "SGLang NGRAM (12 draft tokens a step)", (PLAIN_ENTMTP.name,)),
    (ENTMTP_NO_SPANS.name, "ENTMTP, the drafter's trees only", (PLAIN_ENTMTP.name,)),
    (ENTMTP_NO_FORCED.name, "+ lookup spans (the request's own repeats)", (ENTMTP_NO_SPANS.name, PLAIN_ENTMTP.name)),
    (ENTMTP.name, "+ grammar spans: **ENTMTP as served**",
     (ENTMTP_NO_FORCED.name, ENTMTP_NO_SPANS.name, PLAIN_ENTMTP.name)),
)
# a rung's line where the run lacks the rung it builds on (its gain then divides by a later one of its `over`)
LADDER_ALONE = {PLAIN_ENTMTP.name: "plain SGLang with this package on its `entmtp_torch` attention, overlap on",
                ENTMTP_NO_FORCED.name: "ENTMTP with lookup spans, no grammar spans",
                ENTMTP.name: "**ENTMTP as served** (`make serve`)"}
LADDER_SYSTEMS = (STOCK.name, STOCK_BF16.name, PLAIN.name, PLAIN_ENTMTP.name, "eagle-s1-k1-n2", ADAPTIVE.name,
                  NGRAM.name, ENTMTP_NO_SPANS.name, ENTMTP_NO_FORCED.name, ENTMTP.name)
# the ladder's workloads: the mixed stream at batch 1 and 4, the mixed batch, where the run has them
LADDER_CELLS = (("mixed", 1), ("mixed", 4), ("mixed-batch", 4), ("mixed-batch", 8), ("mixed-batch", 16))


def with_compare_draft(specs: list[SystemSpec], draft: Path, tree_set: Path | None = None) -> list[SystemSpec]:
    """`specs` with ENTMTP on the drafter in `draft` (serving `tree_set` if given) right after ENTMTP (in its wave),
    or last."""
    at = next((i + 1 for i, s in enumerate(specs) if s.name == ENTMTP.name), len(specs))
    env = (("ENTMTP_TREE_SET", str(Path(tree_set).resolve())),) if tree_set is not None else ()
    return specs[:at] + [dataclasses.replace(COMPARE, draft=str(Path(draft).resolve()), env=env)] + specs[at:]


def systems_for(names: list[str], eagle_layers: str = "sglang") -> list[SystemSpec]:
    """The specs to run, in SYSTEMS' order: the named ones and the two baselines (`BASELINES`: stock SGLang, which
    every ratio over stock needs, and plain with the package on entmtp_torch, which what speculation adds needs).
    `eagle_layers="package"`: EAGLE and adaptive on this package's linear layers instead of SGLang's."""
    specs = (SYSTEMS if eagle_layers == "sglang" else (STOCK, STOCK_BF16, PLAIN_ENTMTP, ENTMTP, ADAPTIVE, *EAGLE_GRID,
                                                        PLAIN)
             ) + OPTIONAL
    wanted = set(names) | {s.name for s in BASELINES}
    return [s for s in specs if s.name in wanted]


def chat(tokenizer, user: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def payload(text: str, max_new: int, schema: dict | None = None) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new}
    if schema is not None:
        params["json_schema"] = json.dumps(schema)
    return {"text": text, "sampling_params": params}


def sglang_serves(schema: dict) -> bool:
    """Whether SGLang's xgrammar backend takes this JSON schema (its own check of the features xgrammar lacks, such
    as some string formats); True where this SGLang has no such check."""
    try:
        from sglang.srt.constrained.json_schema_validation import validate_xgrammar_json_schema
    except ImportError:
        return True
    try:
        validate_xgrammar_json_schema(schema)
    except Exception:
        return False
    return True


def workloads(tokenizer, per_task: int, max_new: int, prompts: str = "dev") -> dict[str, list[dict]]:
    """task -> /generate payloads, the JSON prompts under their schemas: from the measurement set (`prompts=
    "measure"`, MEASURE) or the development set's held-out test split ("dev")."""
    if prompts == "measure":
        return measurement_workloads(tokenizer, per_task, max_new)
    if prompts != "dev":
        raise ValueError(f"prompts must be one of {', '.join(PROMPT_SETS)}, got {prompts!r}")
    out = {}
    for task in ("code", "chat", "prose"):
        items = load_prompts(task, "test", per_task)
        out[task] = [payload(chat(tokenizer, it["prompt"][-600:]), max_new) for it in items]
    # the held-out JSON prompts whose schema SGLang serves (it refuses the others with an HTTP 400)
    items = [it for it in load_prompts("json", "test") if sglang_serves(load_schema(it))]
    items, _ = schema_prompt_grammars(items, tokenizer.name_or_path, len(tokenizer), per_task)
    out["json"] = [payload(chat(tokenizer, it["prompt"].removeprefix("User: ").split("\nAssistant:")[0]), max_new,
                           load_schema(it)) for it in items]
    out["tool-call"] = [payload(chat(tokenizer, call.user, call.system), max_new, call.schema)
                        for call in tool_calls(TOOLS, per_task)]
    return out


def measurement_workloads(tokenizer, per_task: int, max_new: int, path: Path = MEASURE) -> dict[str, list[dict]]:
    """task -> /generate payloads from the measurement set (`path`): its first `per_task` items of each workload,
    through the model's chat template. Refuses a set with fewer items than asked or a schema SGLang does not serve
    (a benchmark that silently measured fewer prompts would not say what it says)."""
    spec = json.loads(Path(path).read_text())
    out = {}
    for task in ("code", "chat", "prose", "json"):
        items = spec.get(task) or []
        if len(items) < per_task:
            raise ValueError(f"{path}: {task} has {len(items)} prompts, {per_task} asked (--per-task)")
        items = items[:per_task]
        if task != "json":
            out[task] = [payload(chat(tokenizer, text), max_new) for text in items]
            continue
        refused = [i for i, it in enumerate(items) if not sglang_serves(it["schema"])]
        if refused:
            raise ValueError(f"{path}: SGLang does not serve the schema of json item(s) {refused}")
        out[task] = [payload(chat(tokenizer, it["prompt"]), max_new, it["schema"]) for it in items]
    calls = tool_calls(spec["tool_calls"], per_task)
    if len(calls) < per_task:
        raise ValueError(f"{path}: tool_calls has {len(calls)} requests, {per_task} asked (--per-task)")
    out["tool-call"] = [payload(chat(tokenizer, call.user, call.system), max_new, call.schema) for call in calls]
    return out


def interleave(tasks: dict[str, list[dict]], names=MIXED_BATCH_TASKS) -> tuple[list[dict], list[str]]:
    """The mixed batch's payloads and their task labels: the named tasks' prompts taken in turn (one of each, then
    the next of each, ...), so that any few consecutive requests, and so every batch in flight, mix the tasks."""
    payloads, labels = [], []
    for i in range(max((len(tasks[n]) for n in names), default=0)):
        for n in names:
            if i < len(tasks[n]):
                payloads.append(tasks[n][i])
                labels.append(n)
    return payloads, labels


def tree_size(name: str) -> tuple[int, int] | None:
    """(nodes, depth) of a tree as ENTMTP names it: "b3n3d2" (3 nodes, depth 2), "chain:k" (k + 1 nodes, depth k),
    "rest" / "plain" (1, 0); None for a name of another form."""
    if name in ("rest", "plain"):
        return 1, 0
    m = re.fullmatch(r"chain:(\d+)", name)
    if m:
        return int(m.group(1)) + 1, int(m.group(1))
    m = re.search(r"n(\d+)d(\d+)$", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def trees_per_label(rows: list[Row]) -> str:
    """Inside the mixed batch, the trees each kind of request took (ENTMTP's per-request choices): steps, mean
    nodes and depth, the share of steps resting, the commonest trees. Empty when no row has per-label trees."""
    lines = []
    for r in rows:
        for label, trees in sorted(r.trees_by_label.items(), key=lambda kv: MIXED_BATCH_TASKS.index(kv[0])
                                   if kv[0] in MIXED_BATCH_TASKS else len(MIXED_BATCH_TASKS)):
            sizes = [(tree_size(t), n) for t, n in trees.items()]
            steps = sum(trees.values())
            known = [(sz, n) for sz, n in sizes if sz is not None]
            k = sum(n for _, n in known)
            nodes = f"{sum(sz[0] * n for sz, n in known) / k:.2f}" if k else ""
            depth = f"{sum(sz[1] * n for sz, n in known) / k:.2f}" if k else ""
            resting = sum(n for t, n in trees.items() if t in ("rest", "chain:0"))
            top = ", ".join(f"{t} {n}" for t, n in trees.most_common(4))
            lines.append(f"| {r.system} | {r.batch} | {label} | {steps} | {nodes} | {depth} | "
                         f"{resting / steps:.0%} | {top} |")
    if not lines:
        return ""
    return ("Inside the mixed batch, per kind of request (the median repeat's steps; resting = `rest` or `chain:0`):"
            "\n\n| system | batch | request | steps | mean nodes | mean depth | resting | trees |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines))


def _per_repeat(parts: list[tuple[int, list[float]]]) -> list[float]:
    """Tokens/s of a sum of runs in each repeat: every part's tokens over its seconds in that repeat, added up
    (`parts`: (tokens, tokens/s per repeat)); empty when the parts' repeats do not line up."""
    reps = {len(per) for _, per in parts}
    if len(reps) != 1 or not all(all(per) for _, per in parts):
        return []
    return [round(sum(n for n, _ in parts) / sum(n / per[i] for n, per in parts), 2) for i in range(reps.pop())]


def mixed_rows(rows: list[Row], batches) -> list[Row]:
    """The mixed stream at `batches` from the per-task rows: each system's tokens and seconds added up, per repeat
    too, and so the baseline's runs beside them (their paired ratio; the baseline is stock SGLang when the rows
    have it, `baseline_of`) and those of the other systems of every wave (`Row.beside`: plain with the package on
    entmtp_torch)."""
    out = []
    baseline = baseline_of(rows)
    for b in batches:
        base = {r.task: r for r in rows if r.system == baseline and r.batch == b}
        of = collections.defaultdict(dict)   # system -> task -> row, for the runs beside others
        for r in rows:
            if r.batch == b:
                of[r.system][r.task] = r
        for system in dict.fromkeys(r.system for r in rows):
            part = [r for r in rows if r.system == system and r.batch == b and r.task in TASKS]
            if part:
                eq = [r.equal_to_plain for r in part]
                eq_stock = [r.equal_to_stock for r in part]
                trees = sum((r.trees for r in part), start=type(part[0].trees)())
                spans = [r.forced for r in part if r.forced]
                forced = [sum(f[k] for f in spans) for k in range(3)] if spans else None
                repeats = [r.lookup for r in part if r.lookup]
                lookup = [sum(f[k] for f in repeats) for k in range(3)] if repeats else None
                # per repeat: every task's tokens (the same each repeat, greedy) over its seconds in that repeat
                per_repeat = _per_repeat([(r.tokens, r.repeat_tokens_per_s) for r in part])
                beside = ([] if not all(r.plain_repeat_tokens_per_s and r.task in base for r in part) else
                          _per_repeat([(base[r.task].tokens, r.plain_repeat_tokens_per_s) for r in part]))
                others = {n: _per_repeat([(of[n][r.task].tokens, r.beside[n]) for r in part])
                          for n in set.intersection(*(set(r.beside) for r in part))
                          if all(r.task in of[n] for r in part)}
                out.append(Row(system, b, sum(r.tokens for r in part), sum(r.seconds for r in part),
                               [a for r in part for a in r.accept_lengths], trees,
                               None if None in eq else sum(eq), sum(r.requests for r in part), per_repeat,
                               task="mixed", plain_repeat_tokens_per_s=beside,
                               equal_to_stock=None if None in eq_stock else sum(eq_stock), forced=forced,
                               lookup=lookup, beside={n: v for n, v in others.items() if v}))
    return out


def preface(rows: list[Row], meta: dict | None = None) -> str:
    """What the ratios divide by, how each plain server ran, and the processor (from the run's JSON lines)."""
    meta = meta or {}
    lines = []
    if meta.get("processor"):
        lines.append(f"Processor: {meta['processor']}; {meta.get('cpus', '?')} CPUs; commit "
                     f"{str(meta.get('commit', ''))[:7] or '?'}.")
    if baseline_of(rows) == STOCK.name:
        layers = meta.get("layers") or {}
        eagle = sorted(n for n, v in layers.items() if n.startswith("eagle-"))
        on = {layers[n] for n in eagle}
        how = ("SGLang's own layers (linear, RMSNorm, SiLU, rotary), the plugin loaded for its attention backend and "
               "CPU ops (stock SGLang cannot run EAGLE on a CPU)" if on == {"sglang"} else
               "this package's layers" if on == {"package"} else "")
        lines.append("Every ratio divides by stock SGLang (`plain-stock`: SGLANG_PLUGINS=entmtp_cpu_ops, this "
                     "package's general plugin not loaded), every paired ratio by its run beside in the same wave and "
                     "repeat. `plain` is plain SGLang with this package installed (its CPU linear layers and "
                     "row-wise ops). "
                     "greedy = plain / = stock: outputs equal to theirs token for token (the fewest over repeats; "
                     "stock in bfloat16, a dtype of its own: its later repeats against its first)."
                     + (f" EAGLE and adaptive: {how}." if how else ""))
    if speculation_baseline(rows) == PLAIN_ENTMTP.name:
        lines.append(f"What speculation adds divides by `{PLAIN_ENTMTP.name}`, plain SGLang with this package on its "
                     "`entmtp_torch` attention with overlap scheduling on (the layers and attention ENTMTP and EAGLE "
                     f"run on), measured in every wave: the `vs {PLAIN_ENTMTP.name}, paired` column (over its run "
                     "beside in the same wave and repeat) and ENTMTP's table against EAGLE below. greedy = plain "
                     f"compares with `{PLAIN_ENTMTP.name}`'s outputs, `{PLAIN.name}`'s (on `torch_native`) too.")
    return "\n".join(lines) + ("\n\n" if lines else "")


def through(rows: list[Row]) -> str:
    """The system ENTMTP's and EAGLE's paired ratios go through when they are compared with each other (`versus`,
    the headline's columns against adaptive and the best static setting): plain with the package on entmtp_torch
    where the run has it (what speculation adds, over each one's run beside it), else (older runs) stock SGLang."""
    return PLAIN_ENTMTP.name if speculation_baseline(rows) == PLAIN_ENTMTP.name else STOCK.name


def tables(rows: list[Row], meta: dict | None = None) -> str:
    """The results table, then ENTMTP against the best static EAGLE setting and adaptive."""
    names = {r.system for r in rows}
    statics = [s.name for s in EAGLE_GRID if s.name in names]
    steps = ladder(rows, meta=meta)
    text = preface(rows, meta) + (f"The ladder (each rung's gain over the one named, paired):\n\n{steps}\n\n"
                                  if steps else "") + to_markdown(rows)
    via = through(rows)
    base = ("stock" if baseline_of(rows) == STOCK.name else "plain") if via == STOCK.name else f"`{via}`"
    if "entmtp" in names and (statics or ADAPTIVE.name in names):
        text += (f"\n\nENTMTP's paired ratio to {base} over each system's (the best static EAGLE setting named):\n\n"
                 + versus(rows, "entmtp", {"best static EAGLE": statics, "adaptive": [ADAPTIVE.name]},
                          via if via == PLAIN_ENTMTP.name else None))
    per_label = trees_per_label(rows)
    return text + (f"\n\n{per_label}" if per_label else "")


# the systems the ladder also measures on each workload (its cells pass, `ladder_passes`)
LADDER_CELL_SYSTEMS = (STOCK.name, STOCK_BF16.name, PLAIN_ENTMTP.name, ENTMTP.name)


def ladder_passes(systems, tasks: dict[str, list[dict]], args, work: dict, compact_work: dict,
                  compact_systems) -> list[tuple]:
    """`--ladder`'s passes, each its own servers: (label, systems, workloads, systems in every wave).

    1. `ladder`: every rung on the mixed stream (`--ladder-per-task` prompts of each task, task after task) at batch 1
       and 4, and on the mixed batch (twice as many of each of its tasks, taken in turn) at `--mixed-batch-batches`;
       stock and plain on entmtp_torch in every wave (every rung's gain pairs through them).
    2. `cells`: stock in both dtypes, plain on entmtp_torch and ENTMTP on each task (`--per-task` prompts) at
       `--batches` (default 1).
    3. `compact`: the same systems on the schema tasks in the compact JSON layout (issue 56's compact goals).
    Passes with nothing to run are left out."""
    lp = args.ladder_per_task
    if lp < 1 or any(len(tasks[t]) < 2 * lp for t in TASKS):
        raise SystemExit(f"--ladder-per-task {lp}: needs 1 or more, and twice that many prompts of each task "
                         f"(--per-task {args.per_task})")
    ladder_work = {"mixed": ([p for t in TASKS for p in tasks[t][:lp]], (1, 4))}
    if args.mixed_batch_batches:
        payloads, labels = interleave({t: items[:2 * lp] for t, items in tasks.items()})
        ladder_work["mixed-batch"] = (payloads, tuple(args.mixed_batch_batches), labels)
    names = {s.name for s in systems}
    # ENTMTP's rungs in one wave, so that each span kind's gain pairs with the rung below it directly
    order = {n: i for i, n in enumerate((STOCK.name, PLAIN_ENTMTP.name, ENTMTP.name, ENTMTP_NO_FORCED.name,
                                         ENTMTP_NO_SPANS.name, STOCK_BF16.name, PLAIN.name))}
    systems = sorted(systems, key=lambda s: order.get(s.name, len(order)))
    cells = [s for s in systems if s.name in LADDER_CELL_SYSTEMS]
    cell_every = tuple(n for n in EVERY_WAVE if n in {c.name for c in cells})
    compact = [s for s in compact_systems if s.name in LADDER_CELL_SYSTEMS]
    plan = [("ladder", systems, ladder_work, tuple(n for n in (STOCK.name, PLAIN_ENTMTP.name) if n in names)),
            ("cells", cells, {t: w for t, w in work.items() if t in TASKS}, cell_every),
            ("compact", compact, compact_work, cell_every)]
    return [p for p in plan if p[1] and p[2]]


def ladder(rows: list[Row], via: str | None = None, meta: dict | None = None) -> str:
    """The ladder (`LADDER`) as one table from a run's rows: per rung the tokens/s of each workload of `LADDER_CELLS`
    the run has, and its gain over the rung before it (the first of its `over` the run has), paired: the median of
    the per-repeat ratios, over the run beside it where both ran in one wave, else through the run's baseline
    (`paired_over`). A rung the run lacks is left out; empty where the run has fewer than two rungs. `via`: the
    system the best static EAGLE setting is chosen by (default: plain on entmtp_torch where the run has it); `meta`:
    the run's configuration, which says whose layers EAGLE ran on."""
    on = {((meta or {}).get("layers") or {}).get(n) for n in (ADAPTIVE.name, *(s.name for s in EAGLE_GRID))} - {None}
    layers = "; SGLang's own layers" if on == {"sglang"} else "; this package's layers" if on == {"package"} else ""
    by = {(r.system, r.task, r.batch): r for r in rows}
    names = {r.system for r in rows}
    cells = [c for c in LADDER_CELLS if any((r.task, r.batch) == c for r in rows)]
    statics = [s.name for s in EAGLE_GRID if s.name in names]
    via = via or through(rows)
    best = (best_paired(rows, statics, "mixed", 1, via) or (None, None))[1] if statics else None
    rungs = []
    for name, label, over in LADDER:
        system = best if name == BEST_STATIC else name
        if system is None or system not in names:
            continue
        ref = next((o for o in over if o in names), None)
        if over and ref != over[0]:
            label = LADDER_ALONE.get(name, label)
        rungs.append((system, label.format(setting=(system or "").removeprefix("eagle-"), layers=layers), ref))
    if len(rungs) < 2 or not cells:
        return ""
    head = ["rung", "gain over", *(f"{'mixed stream' if t == 'mixed' else 'mixed batch'}, batch {b}" for t, b in cells)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system, label, ref in rungs:
        out = []
        for t, b in cells:
            r = by.get((system, t, b))
            gain = paired_over(rows, r, ref) if r is not None and ref is not None else None
            out.append("" if r is None else f"{r.tokens_per_s:.1f}" + (f" **{gain:.2f}x**" if gain else ""))
        lines.append(f"| {label} | {'' if ref is None else f'`{ref}`'} | " + " | ".join(out) + " |")
    return "\n".join(lines)


# the README headline's first table: each system's line, in this order (others by name, after them)
HEADLINE_LABELS = {
    STOCK.name: "stock SGLang, plain decoding",
    STOCK_BF16.name: "stock SGLang, plain decoding in bfloat16 (`--dtype bfloat16`, what `--dtype auto` serves)",
    PLAIN.name: "plain SGLang with this package installed (its CPU linear layers and row-wise ops)",
    PLAIN_ENTMTP.name: ("plain SGLang with this package on its `entmtp_torch` attention, overlap on (ENTMTP's layers "
                        "and attention: the baseline of what speculation adds)"),
    ADAPTIVE.name: "SGLang's EAGLE, `--speculative-adaptive` (steps 3, top-k 1{layers})",
    "best static": ("SGLang's EAGLE, the best static setting in hindsight (`{setting}`, best by the paired "
                    "ratio{layers})"),
    ENTMTP.name: "**ENTMTP**, `--speculative-algorithm ENTMTP` with `make serve`'s flags",
    ENTMTP_EAGLE3.name: "ENTMTP with SmolLM2's EAGLE-3 drafter (`--speculative-draft-model-path .../eagle3`)",
    ENTMTP_NO_LOOKUP.name: "ENTMTP without lookup spans (`ENTMTP_LOOKUP_SPANS=0`: no request's own repeats as drafts)",
}
# plain's line where the run also has plain on entmtp_torch (PLAIN_ENTMTP), which the old label would not tell apart
PLAIN_TORCH_NATIVE_LABEL = ("plain SGLang with this package installed, on SGLang's `torch_native` attention (its CPU "
                            "linear layers and row-wise ops)")
# the second table's columns: ENTMTP over stock on each workload
HEADLINE_TASKS = (("code", "code"), ("chat", "chat"), ("prose", "prose"), ("json", "JSON, schema"),
                  ("tool-call", "tool call, schema"), ("json-compact", "JSON, compact"),
                  ("tool-call-compact", "tool call, compact"), ("mixed", "mixed"), ("mixed-batch", "mixed batch"))


def rendered(path: Path, batches=(1, 4)) -> list[Row]:
    """A run's rows from its JSON lines, the mixed stream at `batches` summed again from the tasks' rows (a ladder
    run's as they are: it measured its own mixed stream)."""
    if meta_from_jsonl(path).get("ladder"):
        return rows_from_jsonl(path)
    rows = [r for r in rows_from_jsonl(path) if not (r.task == "mixed" and r.batch in batches)]
    return rows + mixed_rows(rows, batches)


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def headline(rows: list[Row], meta: dict | None = None) -> str:
    """The README's headline tables from a run's rows (`--render JSONL --headline`; the README carries them as
    printed, and a test checks that they are the committed run's): the systems at batch 1 on the mixed stream, then
    ENTMTP against stock SGLang per workload and batch size, against plain with the package, and its paired ratio
    over adaptive and the best static EAGLE setting (`over_best`).

    What speculation adds divides by plain SGLang with the package on `entmtp_torch`, overlap on (`PLAIN_ENTMTP`,
    `speculation_baseline`) where the run has it: the first table gets a column over it, the second table's
    "ENTMTP vs plain" column is over it (ratio of medians, paired in brackets), ENTMTP and EAGLE are compared through
    it (`through`), and a third table gives ENTMTP over it per workload and batch size. An older run without it
    prints what it printed then: ENTMTP over plain on `torch_native` (ratio of medians), the comparisons through
    stock, two tables."""
    meta = meta or {}
    base = {(r.task, r.batch): r for r in rows if r.system == STOCK.name}
    by = {(r.system, r.task, r.batch): r for r in rows}
    on = {(meta.get("layers") or {}).get(s.name) for s in EAGLE_SGLANG_LAYERS} - {None}
    layers = "; SGLang's own layers" if on == {"sglang"} else "; this package's layers" if on == {"package"} else ""
    spec = PLAIN_ENTMTP.name if speculation_baseline(rows) == PLAIN_ENTMTP.name else None
    via = through(rows)

    def pair(system: str, task: str, b: int) -> tuple[float | None, float | None]:
        r, s = by.get((system, task, b)), base.get((task, b))
        if r is None or s is None:
            return None, None
        return r.tokens_per_s / s.tokens_per_s, paired_ratio(r, s)

    def cell(system: str, task: str, b: int) -> str:
        ratio, paired = pair(system, task, b)
        return "" if ratio is None else f"{_x(ratio)} ({_x(paired) or '-'})"

    def over(system: str, task: str, b: int, ref: str | None = spec) -> str:
        """`system` over `ref` (plain on entmtp_torch): ratio of medians (paired)."""
        r, s = by.get((system, task, b)), by.get((ref, task, b))
        if r is None or s is None:
            return ""
        return f"{_x(r.tokens_per_s / s.tokens_per_s)} ({_x(paired_over(rows, r, ref)) or '-'})"

    statics = [s.name for s in EAGLE_GRID if any(r.system == s.name for r in rows)]

    bf16 = STOCK_BF16.name if any(r.system == STOCK_BF16.name for r in rows) else None
    cols = ["system (batch 1, mixed workloads)", "tok/s", "vs stock SGLang (paired)",
            *(["vs stock SGLang in bfloat16 (paired)"] if bf16 else []),
            *(["vs plain with the package on `entmtp_torch` (paired)"] if spec else [])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    names = list(dict.fromkeys(r.system for r in rows if r.task == "mixed" and r.batch == 1))
    order = [n for n in HEADLINE_LABELS if n in names or n == "best static"]
    order += [n for n in names if n not in HEADLINE_LABELS and n not in statics]
    for name in order:
        setting = ((best_paired(rows, statics, "mixed", 1, via) or (None, None))[1] if name == "best static"
                   else None)
        if name == "best static" and setting is None:
            continue
        system = setting or name
        r = by[(system, "mixed", 1)]
        label = (PLAIN_TORCH_NATIVE_LABEL if spec and name == PLAIN.name else HEADLINE_LABELS.get(name, f"`{name}`")
                 ).format(setting=(setting or "").removeprefix("eagle-"), layers=layers)
        tps, ratio = f"{r.tokens_per_s:.1f}", cell(system, "mixed", 1)
        cells = [tps, ratio, *([over(system, "mixed", 1, bf16)] if bf16 else []),
                 *([over(system, "mixed", 1)] if spec else [])]
        if name == ENTMTP.name:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def versus_best(task: str, b: int, others: list[str]) -> str:
        return _x((over_best(rows, ENTMTP.name, others, task, b, via) or (None,))[0])

    plains = ([("plain with the package, `torch_native` (mixed)", PLAIN.name),
               ("plain with the package, `entmtp_torch` (mixed)", PLAIN_ENTMTP.name)] if spec else
              [("plain with the package (mixed)", PLAIN.name)])
    head = ["batch", *(h for _, h in HEADLINE_TASKS), *(h for h, _ in plains),
            "mixed, ENTMTP vs plain on `entmtp_torch` (paired)" if spec else "mixed, ENTMTP vs plain with the package",
            *(["mixed, ENTMTP vs stock in bfloat16 (paired)"] if bf16 else []),
            "mixed vs adaptive", "mixed vs best static", "mixed batch vs adaptive", "mixed batch vs best static"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    batches = sorted({r.batch for r in rows if r.system == ENTMTP.name})
    for b in batches:
        ent, plain = by.get((ENTMTP.name, "mixed", b)), by.get((PLAIN.name, "mixed", b))
        cells = [str(b), *(cell(ENTMTP.name, t, b) for t, _ in HEADLINE_TASKS),
                 *(cell(n, "mixed", b) for _, n in plains),
                 over(ENTMTP.name, "mixed", b) if spec else
                 _x(ent.tokens_per_s / plain.tokens_per_s) if ent and plain else "",
                 *([over(ENTMTP.name, "mixed", b, bf16)] if bf16 else []),
                 versus_best("mixed", b, [ADAPTIVE.name]), versus_best("mixed", b, statics),
                 versus_best("mixed-batch", b, [ADAPTIVE.name]), versus_best("mixed-batch", b, statics)]
        table.append("| " + " | ".join(cells) + " |")
    steps = ladder(rows, via, meta)
    text = (steps + "\n\n" if steps else "") + "\n".join(lines) + "\n\n" + "\n".join(table)
    if spec:   # what speculation adds, per workload: ENTMTP over plain on entmtp_torch
        head = ["batch (ENTMTP over plain with the package on `entmtp_torch`, paired)", *(h for _, h in HEADLINE_TASKS)]
        adds = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        adds += ["| " + " | ".join([str(b), *(over(ENTMTP.name, t, b) for t, _ in HEADLINE_TASKS)]) + " |"
                 for b in batches]
        text += "\n\n" + "\n".join(adds)
        said = goals(rows)
        if said:
            text += "\n\n" + said
    where = standing(rows)
    return text + ("\n\n" + where if where else "")


# the workloads as the README's prose names them, in its order
PROSE_TASKS = (("code", "code"), ("chat", "chat"), ("prose", "prose"), ("json", "JSON"), ("tool-call", "tool calls"),
               ("json-compact", "compact JSON"), ("tool-call-compact", "compact tool calls"),
               ("mixed", "the mixed stream"), ("mixed-batch", "the mixed batch"))


def _batches(by_batch: dict[int, float]) -> str:
    """The batch sizes above 1 of `by_batch`: "4", or "4-16"."""
    above = sorted(b for b in by_batch if b > 1)
    return str(above[0]) if len(above) == 1 else f"{above[0]}-{above[-1]}"


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x-{hi:.2f}x"


def standing(rows: list[Row]) -> str:
    """"Where ENTMTP stands", every figure from the run's rows (the README carries it as printed; a test checks it):
    outputs equal to plain's and stock's, what a user gains over stock in each dtype, how much of it plain decoding
    with the package gets without speculating, and what speculation adds (ENTMTP over plain with the package on
    `entmtp_torch`, paired) per workload at batch 1, then where it wins and where it does not. Empty for a run
    without ENTMTP, stock and that plain server."""
    names = {r.system for r in rows}
    if not {ENTMTP.name, STOCK.name, PLAIN_ENTMTP.name} <= names:
        return ""
    task_batches = {r.batch for r in rows if r.task in TASKS}
    counted = [r for r in rows if r.system == ENTMTP.name and not (r.task == "mixed" and r.batch in task_batches)]
    requests = sum(r.requests for r in counted)
    plain_eq = sum(r.equal_to_plain or 0 for r in counted)
    stock_eq = [r.equal_to_stock for r in counted]
    stock_said = ("" if None in stock_eq else f" and stock SGLang's float32 output {sum(stock_eq)} of {requests}")
    own = [r for r in rows if r.system == STOCK_BF16.name and r.equal_to_plain is not None]
    own_said = (f"; stock SGLang in bfloat16 repeated its first run's outputs {sum(r.equal_to_plain for r in own)} of "
                f"{sum(r.requests for r in own)}" if own else "")
    sentences = [f"Outputs equal to plain decoding's with the package: {plain_eq} of {requests} ENTMTP requests"
                 f"{stock_said}{own_said} (the fewest over repeats)."]
    mine = [r for r in rows if r.system == ENTMTP.name]

    def over(r: Row, ref: str) -> float | None:
        return paired_over(rows, r, ref)

    gains = [x for r in mine if (x := over(r, STOCK.name))]
    bf16 = [x for r in mine if STOCK_BF16.name in names and (x := over(r, STOCK_BF16.name))]
    if gains:
        sentences.append(f"Over stock SGLang a user gains {_span(gains)} in float32"
                         + (f" and {_span(bf16)} over stock in bfloat16" if bf16 else "")
                         + " (paired, every workload and batch size).")
    plain_mixed = {r.batch: over(r, STOCK.name) for r in rows if r.system == PLAIN_ENTMTP.name and r.task == "mixed"}
    plain_mixed = {b: x for b, x in plain_mixed.items() if x}
    if 1 in plain_mixed:
        more = [x for b, x in plain_mixed.items() if b > 1]
        sentences.append(f"Plain decoding with the package, no speculation, is {plain_mixed[1]:.2f}x stock at batch 1 "
                         f"on the mixed stream" + (f", {_span(more)} at {_batches(plain_mixed)}" if more else "")
                         + ".")
    adds = {(r.task, r.batch): x for r in mine if (x := over(r, PLAIN_ENTMTP.name))}
    batches = sorted({b for _, b in adds})

    def where(test) -> str:
        said = []
        for b in batches:
            hit = [label for t, label in PROSE_TASKS if (t, b) in adds and test(adds[(t, b)])]
            if hit:
                said.append(f"at batch {b} on " + ", ".join(hit))
        return "; ".join(said)

    if adds:
        top = max(adds.items(), key=lambda kv: kv[1])
        label = dict(PROSE_TASKS)[top[0][0]]
        sentences.append(f"What speculation adds (ENTMTP over plain with the package on `entmtp_torch`, paired; the "
                         f"last table) is at most {top[1]:.2f}x ({label} at batch {top[0][1]}): ENTMTP wins (at least "
                         f"1.10x plain) {where(lambda x: x >= 1.1) or 'nowhere'}; "
                         + (f"it is below plain {below}." if (below := where(lambda x: x < 1.0)) else
                            "it is nowhere below plain."))
    return "**Where ENTMTP stands** (every figure from this run): " + " ".join(sentences)


# issue 56's goals for what speculation adds: (task, batch sizes, the least paired ratio of ENTMTP over plain with the
# package on entmtp_torch)
GOALS = (("mixed", (1, 4, 8, 16), 1.0), ("mixed-batch", (1, 4, 8, 16), 1.0), ("mixed", (1,), 1.5),
         ("mixed", (4,), 1.3), ("tool-call-compact", (1,), 2.0), ("json-compact", (1,), 2.0))


def goals(rows: list[Row]) -> str:
    """Each of `GOALS` said plainly met or not, from the run's rows: ENTMTP's paired ratio over plain with the package
    on `entmtp_torch` (the ratio of medians where a row has no pairing); a goal whose rows the run lacks is left
    out. Empty without that baseline."""
    if speculation_baseline(rows) != PLAIN_ENTMTP.name:
        return ""
    by = {(r.system, r.task, r.batch): r for r in rows}
    said = []
    for task, batches, least in GOALS:
        cells = []
        for b in batches:
            r, p = by.get((ENTMTP.name, task, b)), by.get((PLAIN_ENTMTP.name, task, b))
            if r is None or p is None:
                continue
            x = paired_over(rows, r, PLAIN_ENTMTP.name) or r.tokens_per_s / p.tokens_per_s
            ratios = paired_ratios(r, p) if PLAIN_ENTMTP.name in r.beside else None
            spread = ""
            if ratios and len(ratios) > 1:
                lo, hi = bootstrap_interval(ratios)
                spread = f" [{lo:.2f}-{hi:.2f}]"
            cells.append(f"{b}: {x:.2f}x{spread} {'met' if x >= least else '**NOT met**'}")
        if cells:
            said.append(f"- {task} at least {least:.1f}x: " + ", ".join(cells))
    return ("Goals (issue 56), ENTMTP over plain with the package on `entmtp_torch`, paired (the median of the "
            "repeats' ratios; in brackets a 95% bootstrap interval over the repeats), by batch size:\n"
            + "\n".join(said)) if said else ""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--prompts", choices=PROMPT_SETS, default="measure", help="the prompt set: measure (default: "
                    "bench/workloads/measure.json, written for measuring and never used to tune anything) or dev (the "
                    "development set's held-out split, which runs before 2026-12-07 measured)")
    ap.add_argument("--flush", action=argparse.BooleanOptionalAction, default=True, help="empty each server's radix "
                    "cache before each measured pass (default: on; --no-flush lets a repeat reuse the prefill of the "
                    "same prompts, as runs before 2026-12-07 did)")
    ap.add_argument("--order", choices=("shuffled", "fixed"), default="shuffled", help="the order of a wave's servers "
                    "in each repeat and workload: shuffled (default, seeded by --seed) or fixed (stock first, then the "
                    "other baselines, then the rest, as runs before 2026-12-07 measured)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the shuffled order (default 0)")
    ap.add_argument("--per-task", type=int, default=None, help="prompts per task (default 4, with --ladder 8; the "
                    "mixed stream at batch 16 needs 16)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 32, with --ladder 96")
    ap.add_argument("--ladder-per-task", type=int, default=2, help="with --ladder: prompts of each task in the "
                    "ladder's mixed stream (default 2: ten requests), and twice as many of each in its mixed batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(DEFAULT), help="comma-separated, from: " + ", ".join(
        s.name for s in SYSTEMS + OPTIONAL) + f" (default: all but {', '.join(s.name for s in OPTIONAL)}); "
        f"{', '.join(s.name for s in BASELINES)}, the baselines, always run")
    ap.add_argument("--tasks", default=",".join(TASKS) + ",mixed,mixed-batch", help="comma-separated workloads, "
                    "from: " + ", ".join(TASKS) + ", mixed (the mixed stream: all the tasks' prompts, task after "
                    "task), mixed-batch (" + ", ".join(MIXED_BATCH_TASKS) + " taken in turn, so every batch in "
                    "flight mixes them) (default: all)")
    ap.add_argument("--batches", type=_ints, default=None, help="batch sizes of each task (default 1,4, with --ladder "
                    "1; the mixed rows at these batch sizes sum the runs of the tasks measured, except with --ladder, "
                    "which measures its own mixed stream at 1 and 4)")
    ap.add_argument("--mixed-batches", type=_ints, default=(8, 16), help="batch sizes of the mixed stream, measured "
                    "as one workload (default 8,16; empty: none)")
    ap.add_argument("--mixed-batch-batches", type=_ints, default=(4, 8, 16), help="batch sizes of the mixed batch "
                    "(default 4,8,16; it has per-task x 4 requests)")
    ap.add_argument("--json-layouts", default="free,compact", help="JSON layouts of the schema workloads (json, "
                    "tool-call): free (SGLang's default: whitespace is the model's choice) and compact (the servers "
                    f"started with {COMPACT}, rows json-compact and tool-call-compact, on "
                    f"{', '.join(COMPACT_SYSTEMS)} where named) (default: both)")
    ap.add_argument("--ladder", action="store_true", help="run the ladder from stock SGLang to ENTMTP (instead of "
                    "--systems): " + ", ".join(LADDER_SYSTEMS) + ", EAGLE on this package's layers (--eagle-layers "
                    "package), tabled rung by rung")
    ap.add_argument("--eagle-layers", choices=("sglang", "package"), default="sglang", help="linear layers of the "
                    "EAGLE and adaptive servers: SGLang's own (default: the closest to stock SGLang they run in on a "
                    "CPU) or this package's")
    ap.add_argument("--at-once", type=int, default=AT_ONCE, help="the most servers up together; more systems run "
                    f"in waves, {', '.join(EVERY_WAVE)} in each (default %(default)s: each server holds 3-4 GiB)")
    ap.add_argument("--compare-draft", type=Path, metavar="DIR", default=None,
                    help=f"also run ENTMTP with the drafter in DIR (system {COMPARE.name}; the same tree set, on every "
                    "layout): another drafter's weights against the shipped one's in the same run")
    ap.add_argument("--compare-tree-set", type=Path, metavar="FILE", default=None,
                    help="the tree set that --compare-draft's server serves (ENTMTP_TREE_SET; default: the shipped "
                    "set for its kind, as ENTMTP's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render", type=Path, metavar="JSONL",
                    help="start no server: draw the Markdown table again from a run's JSON lines (into --out)")
    ap.add_argument("--headline", action="store_true", help="with --render: print the README's headline tables "
                    "from the run instead (the systems at batch 1 on the mixed stream; ENTMTP per workload and batch)")
    args = ap.parse_args()
    args.per_task = args.per_task or (8 if args.ladder else 4)
    args.max_new_tokens = args.max_new_tokens or (96 if args.ladder else 32)
    args.batches = args.batches if args.batches is not None else ((1,) if args.ladder else (1, 4))
    if args.render is not None:
        rows, meta = rendered(args.render, args.batches), meta_from_jsonl(args.render)
        if args.headline:
            print(headline(rows, meta))
            return
        args.out.mkdir(parents=True, exist_ok=True)
        args.out.joinpath("sglang_speed.md").write_text(tables(rows, meta) + "\n")
        print(tables(rows, meta))
        return
    from transformers import AutoTokenizer

    model = resolve_alias(args.model)
    names = [n for n in args.systems.split(",") if n]
    if args.ladder:
        names, args.eagle_layers = list(LADDER_SYSTEMS), "package"
    unknown = sorted(set(names) - {s.name for s in SYSTEMS + OPTIONAL})
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}")
    chosen = [t for t in args.tasks.split(",") if t]
    bad = sorted(set(chosen) - set(TASKS) - {"mixed", "mixed-batch"})
    if bad or not chosen:
        ap.error(f"unknown task(s) {', '.join(bad) or '(none)'}; choose from {', '.join(TASKS)}, mixed, mixed-batch")
    layouts = {x for x in args.json_layouts.split(",") if x}
    if not layouts or layouts - {"free", "compact"}:
        ap.error(f"--json-layouts takes free and/or compact, not {args.json_layouts!r}")
    kv = ("--max-total-tokens", "6000")   # the longest batch here needs under 5k tokens of KV
    specs = systems_for(names, args.eagle_layers)
    if args.compare_draft is not None:
        if not (args.compare_draft / "config.json").exists():
            ap.error(f"--compare-draft {args.compare_draft}: no drafter there (no config.json)")
        if args.compare_tree_set is not None and not args.compare_tree_set.is_file():
            ap.error(f"--compare-tree-set {args.compare_tree_set}: no such file")
        specs = with_compare_draft(specs, args.compare_draft, args.compare_tree_set)
    elif args.compare_tree_set is not None:
        ap.error("--compare-tree-set goes with --compare-draft")
    systems = [dataclasses.replace(s, args=s.args + kv) for s in specs]
    try:
        tasks = workloads(AutoTokenizer.from_pretrained(str(model)), args.per_task, args.max_new_tokens, args.prompts)
    except ValueError as e:
        ap.error(str(e))
    work = {task: (items, tuple(args.batches)) for task, items in tasks.items() if task in chosen and args.batches
            and ("free" in layouts or task not in COMPACT_TASKS)}
    compact_work = {f"{task}-compact": (tasks[task], tuple(args.batches)) for task in COMPACT_TASKS
                    if "compact" in layouts and task in chosen and args.batches}
    compact_systems = [dataclasses.replace(s, args=s.args + (COMPACT,)) for s in systems
                       if s.name in COMPACT_SYSTEMS + (COMPARE.name,)]
    if "mixed" in chosen and args.mixed_batches:
        work["mixed"] = ([p for t in TASKS for p in tasks[t]], tuple(args.mixed_batches))
    if "mixed-batch" in chosen and args.mixed_batch_batches:
        payloads, labels = interleave(tasks)
        work["mixed-batch"] = (payloads, tuple(args.mixed_batch_batches), labels)
    run_names = {s.name for s in systems}
    every = tuple(n for n in EVERY_WAVE if n in run_names)
    passes = []   # (label, systems, workloads, systems of every wave): the servers of each pass start anew
    if args.ladder:
        passes, summed = ladder_passes(systems, tasks, args, work, compact_work, compact_systems), ()
    else:
        summed = tuple(b for b in args.batches if "mixed" not in work or b not in work["mixed"][1])
        passes = [p for p in (("free", systems, work, every), ("compact", compact_systems, compact_work, every))
                  if p[2]]
    if not passes:
        ap.error("nothing to measure: no task at any batch size")
    t0 = time.time()
    config = {"model": model.name, "per_task": args.per_task, "max_new_tokens": args.max_new_tokens,
              "prompts": args.prompts, "flush": args.flush, "order": args.order,
              "seed": args.seed if args.order == "shuffled" else None,
              "systems": [s.name for s in systems],
              "workloads": {k: list(v[1]) for _, _, w, _ in passes for k, v in w.items()},
              "passes": {label: [s.name for s in specs] for label, specs, _, _ in passes},
              "ladder": bool(args.ladder), "ladder_per_task": args.ladder_per_task if args.ladder else None,
              "compact_systems": [s.name for s in compact_systems] if compact_work else [],
              "baseline": STOCK.name,
              "speculation_baseline": next((n for n in (PLAIN_ENTMTP.name, PLAIN.name) if n in run_names), None),
              "every_wave": list(every), "layers": {s.name: s.layers for s in systems},
              "attention": {s.name: s.attention for s in systems},
              "env": {s.name: dict(s.env) for s in systems},
              "drafts": {s.name: s.draft for s in systems if s.speculative == "ENTMTP"}}

    conditions = {"flush": args.flush, "shuffle_seed": args.seed if args.order == "shuffled" else None}
    done_rows: list = []   # the rows of the passes finished so far

    def save(rows, done):
        rows = done_rows + rows
        rows = rows + mixed_rows(rows, summed)
        meta = {**config, "repeats": args.repeats, "repeats_done": done, "duration_s": round(time.time() - t0)}
        write(rows, args.out, meta, name="sglang_speed")
        args.out.joinpath("sglang_speed.md").write_text(tables(rows, {**meta, **machine()}) + "\n")

    rows = []
    for label, specs, pass_work, pass_every in passes:
        rows = run_workloads(specs, pass_work, args.repeats, ROOT / "runs" / f"sglang-speed-{label}", on_repeat=save,
                             model=model, starts_at_once=2, at_once=args.at_once, baseline=STOCK.name,
                             every=pass_every, **conditions)
        done_rows.extend(rows)
        rows = []
    rows = done_rows[:]
    done_rows.clear()
    save(rows, args.repeats)
    print(tables(rows + mixed_rows(rows, summed), {**config, **machine()}))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
