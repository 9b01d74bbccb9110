"""What one decode step costs inside SGLang on this CPU, side by side: a stock SGLang plain step (the reference), a
plain step of SGLang with this package installed on its `entmtp_torch` attention with overlap scheduling on (the
plain step speculation must beat), an ENTMTP resting step, and an ENTMTP speculative step of every tree of the
served set, at batch 1, 4 and 16; and where the ENTMTP step's time goes (ENTMTP_PROFILE, sglang/profile.py).

    .venv/bin/python bench/sglang_step_profile.py    # about 12 minutes; writes bench/results/sglang_step_profile.*
    .venv/bin/python bench/sglang_step_profile.py --batches 1 --trees b0n2d1,b0n6d1 --repeats 1 --max-new-tokens 8
        --out /tmp/profile                           # a smoke run (a few minutes)

Three servers: stock SGLang (`plain-stock`: SGLANG_PLUGINS=entmtp_cpu_ops, this package's general plugin not loaded,
so SGLang's own linear layers and attention; entmtp_sglang/bench/sglang_benchmark.py), plain SGLang with this package
on the `entmtp_torch` attention ENTMTP runs on (`plain-entmtp`: the plugin's CPU linear layers and row-wise ops,
sglang_benchmark.PLAIN_ENTMTP; overlap scheduling on, as plain SGLang runs it: SGLang turns it off on a CPU only for
speculative algorithms, the plugin only for ENTMTP, so ENTMTP's steps run without it) and ENTMTP as `make serve`
starts it; SmolLM2, greedy, float32. Every step is reported against the stock plain step (paired: the stock step of
the same repeat), and against the plain step with the package on `entmtp_torch`. Goals (issue 34): at batch 1 the
smallest tree's step at most 1.15x a stock plain step, a 6-node tree's at most 1.25x; (issue 56) at batch 1 and 4
the smallest tree's step at most 1.10x the plain step with the package on `entmtp_torch`; the report says whether
each is met. Runs from before `plain-entmtp` measured plain with the package on SGLang's `torch_native` (`plain`)
instead, and render as they did. Every request of an ENTMTP measurement pins one tree (`custom_params.entmtp_tree`;
chain:0 = resting, with its periodic catch-up), so a step is that tree's step.

Two figures per step: the batch's wall time over its decode steps (the most any request of it took), prefill
included, as a user sees it; and the decode step alone, the same batch's wall time less that of the batch asked for
one token (prefill, the drafter's prefill and the first token), over the decode steps. The fixed
part of a speculative step is the intercept of a least-squares line through the trees' step times (ms = fixed + per
drafted node + per draft level), for each figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

from entmtp_sglang.bench.sglang_benchmark import PLAIN_ENTMTP, STOCK_ENV, concurrent_generate, machine
from entmtp_sglang.calibrate.server import SGLangServer
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.sglang.config import resolve_tree_set_path
from entmtp_sglang.tasks import load_prompts
from entmtp_sglang.tree.treeset import load_tree_set

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("total", "choose", "catch_up", "draft", "draft_forward", "verify", "target_forward", "draft_extend")
# the plain servers' rows: stock SGLang, plain with the package on entmtp_torch (overlap on) and, in runs from before
# it, plain with the package on torch_native
STOCK_PIN, PLAIN_ENTMTP_PIN, PLAIN_PIN = "plain-stock", PLAIN_ENTMTP.name, "plain"
PLAINS = (STOCK_PIN, PLAIN_ENTMTP_PIN, PLAIN_PIN)
RUN = (STOCK_PIN, PLAIN_ENTMTP_PIN)   # the plain servers a run starts
REFERENCES = ((STOCK_PIN, "stock plain step"),
              (PLAIN_ENTMTP_PIN, "plain step with the package on entmtp_torch, overlap on"),
              (PLAIN_PIN, "plain step with the package"))
GOALS = (("smallest", 1.15), (6, 1.25))   # at batch 1, against the stock plain step: the smallest tree, 6-node trees
# issue 56: the smallest tree's step against the plain step with the package on entmtp_torch, at these batch sizes
PLAIN_GOAL, PLAIN_GOAL_BATCHES = 1.10, (1, 4)


def step_ms(outs: list[dict], seconds: float, batch: int, speculative: bool) -> float:
    """Wall milliseconds per decode step of a batch kept `batch` requests full: all requests' steps over `batch`."""
    steps = sum(int(o["meta_info"]["spec_verify_ct"]) if speculative else int(o["meta_info"]["completion_tokens"]) - 1
                for o in outs)
    return 1000 * seconds * batch / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trees", default="", help="comma-separated trees of the served set to time (chain:0 is the "
                    "resting step); default: every tree of the set")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render", type=Path, metavar="JSONL", help="draw the tables again from a run's JSON lines "
                    "(written beside it, the same name ending .md) and exit")
    args = ap.parse_args()
    if args.render is not None:
        lines = render(args.render)
        args.render.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    model = resolve_alias(args.model)
    ts = load_tree_set(resolve_tree_set_path(None, model.name))
    logs = ROOT / "runs" / "sglang-step-profile"
    logs.mkdir(parents=True, exist_ok=True)
    prof = logs / "entmtp-profile.jsonl"
    prof.unlink(missing_ok=True)
    kv = ("--max-total-tokens", "6000", "--dtype", "float32")
    stock = SGLangServer.cpu(None, model=model, attention="torch_native", extra=kv, env=dict(STOCK_ENV),
                             log_path=logs / "plain-stock.log")
    # no --disable-overlap-schedule: overlap scheduling on, as plain SGLang runs it
    plain = SGLangServer.cpu(None, model=model, attention=PLAIN_ENTMTP.attention, extra=kv,
                             log_path=logs / f"{PLAIN_ENTMTP_PIN}.log")
    ent = SGLangServer.cpu("ENTMTP", model=model, extra=kv, log_path=logs / "entmtp.log",
                           env={"ENTMTP_PROFILE": str(prof), "ENTMTP_ONLINE_COSTS": "0"})
    prompts = [it["prompt"][-600:] for task in ("code", "chat", "prose", "json", "math")
               for it in load_prompts(task, "test", 4)]
    names = [t.tree.name for t in ts.trees]
    wanted = [x.strip() for x in args.trees.split(",") if x.strip()] or names
    unknown = [x for x in wanted if x not in names]
    if unknown:
        ap.error(f"--trees: {', '.join(unknown)} not in the served set ({', '.join(names)})")
    pins = list(RUN) + wanted
    nodes = {t.tree.name: (t.tree.num_nodes, t.tree.max_depth) for t in ts.trees}
    ms: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    decode: dict[tuple[str, int], list[float]] = collections.defaultdict(list)   # prefill taken out
    t0 = time.time()
    servers = {STOCK_PIN: stock, PLAIN_ENTMTP_PIN: plain}
    with stock, plain, ent:
        for pin in pins:   # untimed: each server's first requests and each tree's first step (its runtime state)
            params = {"temperature": 0.0, "max_new_tokens": 4}
            if pin not in PLAINS:
                params["custom_params"] = {"entmtp_tree": pin}
            concurrent_generate(servers.get(pin, ent), [{"text": p, "sampling_params": params} for p in prompts[:2]], 2)
        for rep in range(args.repeats):
            for b in (int(x) for x in args.batches.split(",")):
                batch = prompts[: max(b, 4)]
                for pin in pins:
                    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
                    if pin not in PLAINS:
                        params["custom_params"] = {"entmtp_tree": pin}
                    srv = servers.get(pin, ent)
                    first = {**params, "max_new_tokens": 1}
                    _, sec1 = concurrent_generate(srv, [{"text": p, "sampling_params": first} for p in batch], b)
                    outs, sec = concurrent_generate(srv, [{"text": p, "sampling_params": params} for p in batch], b)
                    ms[(pin, b)].append(step_ms(outs, sec, b, pin not in PLAINS))
                    decode[(pin, b)].append(step_ms(outs, max(sec - sec1, 0.0), b, pin not in PLAINS))
                    print(f"repeat {rep} batch {b} {pin}: {ms[(pin, b)][-1]:.1f} ms/step, decode alone "
                          f"{decode[(pin, b)][-1]:.1f}", flush=True)
    rows = []
    for (pin, b), v in ms.items():
        n, d = nodes.get(pin, (1, 0))
        rows.append({"tree": "rest (chain:0)" if pin == "chain:0" else pin, "batch": b, "nodes": n, "depth": d,
                     "step_ms": round(statistics.median(v), 2), "repeats_ms": [round(x, 2) for x in v],
                     "decode_ms": round(statistics.median(decode[(pin, b)]), 2),
                     "decode_repeats_ms": [round(x, 2) for x in decode[(pin, b)]]})
    profile = collections.defaultdict(list)
    for line in prof.read_text().splitlines():
        r = json.loads(line)
        profile[(r["tree"], r["bs"])].append(r)
    stages = {key: {**{s: round(1000 * statistics.median(r.get(s, 0.0) for r in rs), 2) for s in STAGES},
                    "total_mean": round(1000 * statistics.fmean(r.get("total", 0.0) for r in rs), 2)}
              for key, rs in profile.items() if len(rs) >= 3}
    write(rows, stages, args, model, time.time() - t0)


def fixed_part(rows: list[dict], b: int, key: str = "step_ms") -> float | None:
    """Intercept of ms = fixed + per_node * (nodes - 1) + per_level * depth over the speculative trees."""
    pts = [r for r in rows if r["batch"] == b and r["depth"] > 0]
    if len({(r["nodes"], r["depth"]) for r in pts}) < 3:
        return None
    x = torch.tensor([[1.0, r["nodes"] - 1, r["depth"]] for r in pts], dtype=torch.float64)
    y = torch.tensor([[r[key]] for r in pts], dtype=torch.float64)
    return float(torch.linalg.lstsq(x, y).solution[0, 0])


def paired(row: dict, plain: dict, key: str) -> float:
    """Median over repeats of this step's time over the plain step's of the same repeat (measured minutes apart, not
    hours: robust to the machine's drift between repeats)."""
    return statistics.median(x / max(p, 1e-9) for x, p in zip(row[key], plain[key]))


def references(rows: list[dict], b: int) -> list[tuple[dict, str]]:
    """The plain steps at batch `b` each step is compared with: stock SGLang's first, then plain SGLang's with this
    package, on entmtp_torch (or, in runs from before it, on torch_native; a run from before the stock server has
    the latter only)."""
    out = []
    for name, label in REFERENCES:
        row = next((r for r in rows if r["batch"] == b and r["tree"] == name), None)
        if row is not None:
            out.append((row, label if any(r["tree"] == STOCK_PIN for r in rows) else "plain step"))
    return out


def goals(rows: list[dict]) -> list[str]:
    """Whether the batch-1 goals hold, against the stock plain step (paired, the decode step alone; the step with
    the prefill shared in brackets): the smallest tree's step at most 1.15x, each 6-node tree's at most 1.25x."""
    stock = next((r for r in rows if r["batch"] == 1 and r["tree"] == STOCK_PIN), None)
    trees = [r for r in rows if r["batch"] == 1 and r["depth"] > 0]
    if stock is None or not trees:
        return []
    smallest = min(r["nodes"] for r in trees)
    parts = []
    for which, limit in GOALS:
        nodes = smallest if which == "smallest" else which
        chosen = [r for r in trees if r["nodes"] == nodes]
        if not chosen:
            parts.append(f"no {nodes}-node tree was timed (goal {limit:.2f}x)")
            continue
        cells = []
        for r in chosen:
            alone, shared = paired(r, stock, "decode_repeats_ms"), paired(r, stock, "repeats_ms")
            cells.append(f"{r['tree']} {alone:.2f}x ({shared:.2f}x): {'met' if alone <= limit else 'NOT met'}")
        what = f"the smallest tree ({nodes} nodes)" if which == "smallest" else f"{nodes}-node trees"
        parts.append(f"{what}, goal at most {limit:.2f}x: " + ", ".join(cells))
    return ["Goals at batch 1, each step over the stock plain step of the same repeat (the decode step alone; with the "
            "prefill shared in brackets): " + "; ".join(parts) + "."]


def plain_goals(rows: list[dict]) -> list[str]:
    """Whether the issue-56 goal holds: at batch 1 and 4 (`PLAIN_GOAL_BATCHES`) the smallest tree's step at most
    `PLAIN_GOAL` times the plain step with the package on entmtp_torch, overlap on, of the same repeat (paired, the
    decode step alone; with the prefill shared in brackets). Nothing for a run without that plain step."""
    parts = []
    for b in PLAIN_GOAL_BATCHES:
        plain = next((r for r in rows if r["batch"] == b and r["tree"] == PLAIN_ENTMTP_PIN), None)
        trees = [r for r in rows if r["batch"] == b and r["depth"] > 0]
        if plain is None:
            continue
        if not trees:
            parts.append(f"batch {b}: no tree was timed")
            continue
        smallest = min(r["nodes"] for r in trees)
        cells = []
        for r in (r for r in trees if r["nodes"] == smallest):
            alone, shared = paired(r, plain, "decode_repeats_ms"), paired(r, plain, "repeats_ms")
            cells.append(f"{r['tree']} {alone:.2f}x ({shared:.2f}x): {'met' if alone <= PLAIN_GOAL else 'NOT met'}")
        parts.append(f"batch {b}, the smallest tree ({smallest} nodes): " + ", ".join(cells))
    if not parts:
        return []
    return [f"Goal against the plain step with the package on entmtp_torch, overlap on (issue 56), each step over that "
            f"plain step of the same repeat (the decode step alone; with the prefill shared in brackets), the smallest "
            f"tree at most {PLAIN_GOAL:.2f}x: " + "; ".join(parts) + "."]


def table(rows, stages) -> list[str]:
    batches = sorted({r["batch"] for r in rows})
    refs_of = {b: references(rows, b) for b in batches}
    labels = [label for _, label in max(refs_of.values(), key=len)] if refs_of else ["plain step"]
    vs = " | ".join(f"vs {label} (paired)" for label in labels)
    lines = [f"| batch | step | nodes | depth | ms per step, prefill shared (median) | {vs} | "
             f"ms per decode step alone (median) | {vs} |", "|---|---|---|---|---|" + "---|" * (2 * len(labels) + 1)]
    for b in batches:
        refs = refs_of[b]
        first = {STOCK_PIN: 0, PLAIN_ENTMTP_PIN: 1, PLAIN_PIN: 1}
        for r in sorted((r for r in rows if r["batch"] == b), key=lambda r: (first.get(r["tree"], 2), r["nodes"])):
            shared = " | ".join(f"{r['step_ms'] / ref['step_ms']:.2f}x ({paired(r, ref, 'repeats_ms'):.2f}x)"
                                for ref, _ in refs)
            alone = " | ".join(f"{r['decode_ms'] / max(ref['decode_ms'], 1e-9):.2f}x "
                               f"({paired(r, ref, 'decode_repeats_ms'):.2f}x)" for ref, _ in refs)
            lines.append(f"| {b} | {r['tree']} | {r['nodes']} | {r['depth']} | {r['step_ms']:.1f} | {shared} | "
                         f"{r['decode_ms']:.1f} | {alone} |")
        fixed, alone = fixed_part(rows, b), fixed_part(rows, b, "decode_ms")
        if fixed is not None and alone is not None and refs:
            lines.append(f"| {b} | speculative step, fixed part (fit at 0 drafted nodes, depth 0) | | | {fixed:.1f} | "
                         + " | ".join(f"{fixed / ref['step_ms']:.2f}x" for ref, _ in refs) + f" | {alone:.1f} | "
                         + " | ".join(f"{alone / max(ref['decode_ms'], 1e-9):.2f}x" for ref, _ in refs) + " |")
    g = goals(rows) + plain_goals(rows)
    lines += ["", *g] if g else []
    lines += ["", "Inside the ENTMTP worker, median ms per stage (ENTMTP_PROFILE; `catch_up` is inside `choose`, "
              "`draft_forward` inside `draft`/`draft_extend`/`catch_up`, `target_forward` inside `verify`):", "",
              "| step | batch | " + " | ".join(STAGES) + " | total (mean: periodic work too, as a rest's catch-up) |",
              "|---|---|" + "---|" * (len(STAGES) + 1)]
    for (tree, b), st in sorted(stages.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {tree} | {b} | " + " | ".join(f"{st.get(s, 0.0):.1f}" for s in STAGES)
                     + f" | {st.get('total_mean', float('nan')):.1f} |")
    return lines


def header(meta: dict) -> list[str]:
    """The processor and commit a run measured on (from its JSON lines), then a blank line; nothing if unknown."""
    if not meta.get("processor"):
        return []
    return [f"Processor: {meta['processor']}; {meta.get('cpus', '?')} CPUs, torch threads "
            f"{meta.get('torch_threads', '?')}; commit {str(meta.get('commit', ''))[:7] or '?'}; "
            f"{meta.get('max_new_tokens', '?')} new tokens, median of {meta.get('repeats', '?')} repeats.", ""]


def render(path: Path) -> list[str]:
    """The tables again from a run's JSON lines (`--render`)."""
    rows, stages = [], {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "stages_of" in r:
            stages[(r["stages_of"], r["batch"])] = r
        else:
            rows.append(r)
    return header(rows[0] if rows else {}) + table(rows, stages)


def write(rows, stages, args, model, seconds) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": model.name, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "duration_s": round(seconds), **machine()}
    lines = header(meta) + table(rows, stages)
    with open(args.out / "sglang_step_profile.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
        for (tree, b), st in stages.items():
            f.write(json.dumps({**meta, "stages_of": tree, "batch": b, **st}) + "\n")
    (args.out / "sglang_step_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
