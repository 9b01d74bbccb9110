"""What one decode step costs inside SGLang on this CPU, side by side: a plain SGLang step, an ENTMTP resting step,
and an ENTMTP speculative step of every tree of the served set, at batch 1, 4 and 16; and where the ENTMTP step's
time goes (ENTMTP_PROFILE, sglang/profile.py).

    .venv/bin/python bench/sglang_step_profile.py    # about 10 minutes; writes bench/results/sglang_step_profile.*

Two servers (plain SGLang and ENTMTP as `make serve` starts it), SmolLM2, greedy, float32. Every request of a
measurement pins one tree (`custom_params.entmtp_tree`; chain:0 = resting, with its periodic catch-up), so a step
is that tree's step. Two figures per step: the batch's wall time over its decode steps (the most any request of it
took), prefill included, as a user sees it; and the decode step alone, the same batch's wall time less that of the
batch asked for one token (prefill, the drafter's prefill and the first token), over the decode steps. The fixed
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

from entmtp_sglang.bench.sglang_benchmark import concurrent_generate, machine
from entmtp_sglang.calibrate.server import SGLangServer
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.sglang.config import resolve_tree_set_path
from entmtp_sglang.tasks import load_prompts
from entmtp_sglang.tree.treeset import load_tree_set

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("total", "choose", "catch_up", "draft", "draft_forward", "verify", "target_forward", "draft_extend")


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
    plain = SGLangServer.cpu(None, model=model, attention="torch_native", extra=kv, log_path=logs / "plain.log")
    ent = SGLangServer.cpu("ENTMTP", model=model, extra=kv, log_path=logs / "entmtp.log",
                           env={"ENTMTP_PROFILE": str(prof), "ENTMTP_ONLINE_COSTS": "0"})
    prompts = [it["prompt"][-600:] for task in ("code", "chat", "prose", "json", "math")
               for it in load_prompts(task, "test", 4)]
    names = [t.tree.name for t in ts.trees]
    wanted = [x.strip() for x in args.trees.split(",") if x.strip()] or names
    unknown = [x for x in wanted if x not in names]
    if unknown:
        ap.error(f"--trees: {', '.join(unknown)} not in the served set ({', '.join(names)})")
    pins = ["plain"] + wanted
    nodes = {t.tree.name: (t.tree.num_nodes, t.tree.max_depth) for t in ts.trees}
    ms: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    decode: dict[tuple[str, int], list[float]] = collections.defaultdict(list)   # prefill taken out
    t0 = time.time()
    with plain, ent:
        for rep in range(args.repeats):
            for b in (int(x) for x in args.batches.split(",")):
                batch = prompts[: max(b, 4)]
                for pin in pins:
                    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
                    if pin != "plain":
                        params["custom_params"] = {"entmtp_tree": pin}
                    srv = plain if pin == "plain" else ent
                    first = {**params, "max_new_tokens": 1}
                    _, sec1 = concurrent_generate(srv, [{"text": p, "sampling_params": first} for p in batch], b)
                    outs, sec = concurrent_generate(srv, [{"text": p, "sampling_params": params} for p in batch], b)
                    ms[(pin, b)].append(step_ms(outs, sec, b, pin != "plain"))
                    decode[(pin, b)].append(step_ms(outs, max(sec - sec1, 0.0), b, pin != "plain"))
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


def table(rows, stages) -> list[str]:
    lines = ["| batch | step | nodes | depth | ms per step, prefill shared (median) | vs plain step (paired) | "
             "ms per decode step alone (median) | vs plain step (paired) |", "|---|---|---|---|---|---|---|---|"]
    for b in sorted({r["batch"] for r in rows}):
        plain = next(r for r in rows if r["batch"] == b and r["tree"] == "plain")
        for r in sorted((r for r in rows if r["batch"] == b), key=lambda r: (r["tree"] != "plain", r["nodes"])):
            lines.append(f"| {b} | {r['tree']} | {r['nodes']} | {r['depth']} | {r['step_ms']:.1f} | "
                         f"{r['step_ms'] / plain['step_ms']:.2f}x ({paired(r, plain, 'repeats_ms'):.2f}x) | "
                         f"{r['decode_ms']:.1f} | {r['decode_ms'] / max(plain['decode_ms'], 1e-9):.2f}x "
                         f"({paired(r, plain, 'decode_repeats_ms'):.2f}x) |")
        fixed, alone = fixed_part(rows, b), fixed_part(rows, b, "decode_ms")
        if fixed is not None and alone is not None:
            lines.append(f"| {b} | speculative step, fixed part (fit at 0 drafted nodes, depth 0) | | | {fixed:.1f} | "
                         f"{fixed / plain['step_ms']:.2f}x | {alone:.1f} | "
                         f"{alone / max(plain['decode_ms'], 1e-9):.2f}x |")
    lines += ["", "Inside the ENTMTP worker, median ms per stage (ENTMTP_PROFILE; `catch_up` is inside `choose`, "
              "`draft_forward` inside `draft`/`draft_extend`/`catch_up`, `target_forward` inside `verify`):", "",
              "| step | batch | " + " | ".join(STAGES) + " | total (mean: periodic work too, as a rest's catch-up) |",
              "|---|---|" + "---|" * (len(STAGES) + 1)]
    for (tree, b), st in sorted(stages.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {tree} | {b} | " + " | ".join(f"{st.get(s, 0.0):.1f}" for s in STAGES)
                     + f" | {st.get('total_mean', float('nan')):.1f} |")
    return lines


def render(path: Path) -> list[str]:
    """The tables again from a run's JSON lines (`--render`)."""
    rows, stages = [], {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "stages_of" in r:
            stages[(r["stages_of"], r["batch"])] = r
        else:
            rows.append(r)
    return table(rows, stages)


def write(rows, stages, args, model, seconds) -> None:
    lines = table(rows, stages)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": model.name, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "duration_s": round(seconds), **machine()}
    with open(args.out / "sglang_step_profile.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**meta, **r}) + "\n")
        for (tree, b), st in stages.items():
            f.write(json.dumps({**meta, "stages_of": tree, "batch": b, **st}) + "\n")
    (args.out / "sglang_step_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
