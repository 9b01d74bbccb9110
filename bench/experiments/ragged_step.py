"""What a ragged step costs inside SGLang (issue 36, item 2): a batch where some rows rest (their root alone) beside
rows drafting the set's widest tree, against steps where every row verifies one node count.

One ENTMTP server (SmolLM2, greedy, float32, ENTMTP_PROFILE timing each step's stages), batch 8, every request
pinning its tree (`custom_params.entmtp_tree`). Configurations, each one batch of 8 requests, repeated:

    full n:     every row pins a depth-1 tree of n nodes (each depth-1 tree of the set the server serves): 8 n
                tokens verified, no padding
    ragged k:   k rows pin the widest of them (W nodes), 8 - k rows pin chain:0 (resting rows inside the step):
                W k + (8 - k) tokens verified, in the widest tree's (1 level, W nodes) shape

The figure: the target's verify forward of a ragged step (`target_forward`, packing and scattering included)
against the line through the full steps (ms = a + b * tokens) at its real tokens, and against the full step of the
widest tree (what the step would cost if every row verified the widest row's nodes, as without ragged verify), also
paired: per repeat, the ragged step's median over the widest full step's of the same repeat (the machine drifts).
The trace (ENTMTP_TREE_TRACE) confirms the ragged steps ran ragged (resting rows' 1 node).

    .venv/bin/python bench/experiments/ragged_step.py   # about 6 minutes here
    # JSON lines in bench/results/ragged_step.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from entmtp_sglang.bench.sglang_benchmark import concurrent_generate
from entmtp_sglang.calibrate.server import SGLangServer
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.tasks import load_prompts

ROOT = Path(__file__).resolve().parents[2]
BATCH = 8
REST = "chain:0"


def depth_one_trees(model: Path) -> dict[str, int]:
    """The depth-1 trees of the set an ENTMTP server serves for `model` with its EAGLE drafter (name -> nodes),
    chain:0 included: the configurations below pin only trees the server holds."""
    from entmtp_sglang.tree.treeset import load_tree_set, shipped_tree_set

    path = shipped_tree_set("eagle", "mixed", model.name, engine="sglang")
    if not path.exists():
        path = shipped_tree_set("eagle", "mixed", model.name)
    trees = {e.tree.name: e.tree.num_nodes for e in load_tree_set(path).trees if e.tree.max_depth <= 1}
    if REST not in trees or len(trees) < 3:
        raise SystemExit(f"{path} needs chain:0 and at least two depth-1 trees for this benchmark; it has {trees}")
    return trees


def configs(nodes: dict[str, int], ks=(2, 4)) -> dict[str, list[str]]:
    full = sorted((t for t in nodes if t != REST), key=nodes.get)
    out = {f"full {nodes[t]}": [t] * BATCH for t in full}
    for k in ks:
        out[f"ragged {k}"] = [full[-1]] * k + [REST] * (BATCH - k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ragged_step.jsonl")
    args = ap.parse_args()
    model = resolve_alias(args.model)
    logs = ROOT / "runs" / "ragged-step"
    logs.mkdir(parents=True, exist_ok=True)
    prof, trace = logs / "profile.jsonl", logs / "trace"
    prof.unlink(missing_ok=True)
    for f in trace.glob("*.jsonl"):
        f.unlink()
    ent = SGLangServer.cpu("ENTMTP", model=model, extra=("--max-total-tokens", "6000", "--dtype", "float32"),
                           log_path=logs / "entmtp.log",
                           env={"ENTMTP_PROFILE": str(prof), "ENTMTP_ONLINE_COSTS": "0",
                                "ENTMTP_TREE_TRACE": str(trace)})
    prompts = [it["prompt"][-400:] for task in ("code", "chat", "json", "prose")
               for it in load_prompts(task, "test", 2)]
    NODES = depth_one_trees(model)
    runs = configs(NODES)
    stages: dict[str, list[dict]] = collections.defaultdict(list)
    per_repeat: dict[str, list[float]] = collections.defaultdict(list)   # median target_forward ms, per repeat
    t0 = time.time()
    with ent:
        for pins in runs.values():   # untimed: each shape's first step
            concurrent_generate(ent, [_payload(p, t, 3) for p, t in zip(prompts, pins)], BATCH)
        for _ in range(args.repeats):
            for name, pins in runs.items():
                before = _lines(prof)
                concurrent_generate(ent, [_payload(p, t, args.max_new_tokens) for p, t in zip(prompts, pins)], BATCH)
                new = [r for r in _lines(prof)[len(before):] if r["bs"] == BATCH]
                stages[name] += new
                per_repeat[name].append(statistics.median(r.get("target_forward", 0.0) for r in new) if new else 0.0)
    steps = [json.loads(x) for f in trace.glob("*.jsonl") for x in f.read_text().splitlines()]
    ragged_seen = sum(1 for s in steps if "nodes" in s and 1 in s["nodes"] and max(s["nodes"]) > 1)
    rows = []
    for name, pins in runs.items():
        rs = stages[name]
        rows.append({"config": name, "tokens": sum(NODES[t] for t in pins), "steps": len(rs),
                     **{k: round(1000 * statistics.median(r.get(k, 0.0) for r in rs), 2)
                        for k in ("target_forward", "verify", "total")}})
    full = [r for r in rows if r["config"].startswith("full")]
    a, b = np.polyfit([r["tokens"] for r in full], [r["target_forward"] for r in full], 1)[::-1]
    wide = max(full, key=lambda r: r["tokens"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"SmolLM2 via SGLang, batch {BATCH}, {args.max_new_tokens} new tokens, {args.repeats} repeats, "
          f"{time.time() - t0:.0f} s; ragged steps in the trace: {ragged_seen}")
    print(f"target verify forward ms = {a:.2f} + {b:.3f} x tokens (full steps)")
    print("| config | tokens verified | steps | target forward ms | line at its tokens | vs widest full (paired) | "
          "verify ms | step ms |")
    print("|---|---|---|---|---|---|---|---|")
    with args.out.open("a") as out:
        for r in rows:
            line = a + b * r["tokens"]
            paired = statistics.median(x / max(w, 1e-9) for x, w in zip(per_repeat[r["config"]],
                                                                           per_repeat[wide["config"]]))
            r.update(line_ms=round(line, 2), vs_line=round(r["target_forward"] / line, 3),
                     vs_widest=round(r["target_forward"] / wide["target_forward"], 3),
                     vs_widest_paired=round(paired, 3))
            print(f"| {r['config']} | {r['tokens']} | {r['steps']} | {r['target_forward']:.1f} | {r['line_ms']:.1f} "
                  f"({r['vs_line']:.2f}x) | {r['vs_widest']:.2f}x ({r['vs_widest_paired']:.2f}x) | {r['verify']:.1f} | "
                  f"{r['total']:.1f} |")
            out.write(json.dumps({**r, "batch": BATCH, "model": model.name, "max_new_tokens": args.max_new_tokens,
                                  "repeats": args.repeats, "ragged_steps_seen": ragged_seen, "commit": commit,
                                  "date": time.strftime("%Y-%m-%d")}) + "\n")


def _payload(prompt: str, tree: str, max_new: int) -> dict:
    return {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                                "custom_params": {"entmtp_tree": tree}}}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    main()
