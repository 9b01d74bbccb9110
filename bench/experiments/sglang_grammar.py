"""ENTMTP inside SGLang under JSON schemas: grammar-aware drafting on vs off, against SGLang plain.

    .venv/bin/python bench/experiments/sglang_grammar.py [--schemas 8] [--max-new-tokens 96] [--repeats 3]

Three servers of the same SGLang build, up side by side: SGLang without speculation, ENTMTP with
grammar-aware drafting (the default: grammar-masked entropy signal and drafts), and ENTMTP with it off
(`ENTMTP_GRAMMAR_DRAFT=0`). Held-out JSON prompts (test split) with their schemas, compact JSON
(`--constrained-json-disable-any-whitespace`), greedy, float32, batch 1; the systems take turns on each
request, and every repeat is a full pass. Prints, and writes to bench/results/sglang_grammar.{md,jsonl}:
tokens/s (median over repeats of the pass's tokens / seconds), its ratio to plain, mean accepted drafts per
verify step, the trees chosen, and whether every output equals plain's token for token.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from entmtp_sglang.calibrate.server import ServerError, SGLangServer  # noqa: E402
from entmtp_sglang.tasks import load_prompts, load_schema  # noqa: E402

FLAGS = ("--dtype", "float32", "--constrained-json-disable-any-whitespace")
SYSTEMS = {
    "plain": dict(speculative=None, attention="torch_native", env={}),
    "entmtp": dict(speculative="ENTMTP", env={"ENTMTP_GRAMMAR_DRAFT": "1"}),
    "entmtp-no-grammar-draft": dict(speculative="ENTMTP", env={"ENTMTP_GRAMMAR_DRAFT": "0"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--schemas", type=int, default=8, help="held-out JSON prompts SGLang accepts the schema of")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {name: SGLangServer.cpu(s["speculative"], env=s["env"], log_path=logs / f"grammar-{name}.log",
                                      extra=FLAGS, **({"attention": s["attention"]} if "attention" in s else {}))
               for name, s in SYSTEMS.items()}
    t_start = time.monotonic()
    try:
        for srv in servers.values():
            srv.start(wait=False)
        for name, srv in servers.items():
            srv.wait_ready()
            print(f"{name} ready", flush=True)
        jobs = pick_jobs(servers["plain"], args.schemas, args.max_new_tokens)
        rows = measure(servers, jobs, args.repeats)
    finally:
        for srv in servers.values():
            srv.stop()
    minutes = (time.monotonic() - t_start) / 60
    write(rows, args, len(jobs), minutes)


def pick_jobs(plain: SGLangServer, n: int, max_new: int) -> list[dict]:
    """The first n held-out JSON prompts whose schema SGLang accepts (some use formats it rejects: HTTP 400)."""
    jobs = []
    for item in load_prompts("json", "test"):
        job = {"text": item["prompt"], "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new, "json_schema": json.dumps(load_schema(item))}}
        try:
            plain.post("/generate", {**job, "sampling_params": {**job["sampling_params"], "max_new_tokens": 1}})
        except ServerError as e:
            print(f"skip {item['id']}: {str(e)[:120]}", flush=True)
            continue
        jobs.append(job)
        if len(jobs) == n:
            break
    return jobs


def measure(servers: dict, jobs: list[dict], repeats: int) -> dict:
    tps = collections.defaultdict(list)
    outputs: dict[str, list] = {name: [] for name in servers}
    accepted = collections.defaultdict(list)
    trees = collections.defaultdict(collections.Counter)
    for rep in range(repeats):
        tokens, seconds = collections.Counter(), collections.Counter()
        for i, job in enumerate(jobs):
            order = list(servers) if (rep + i) % 2 == 0 else list(servers)[::-1]
            for name in order:
                t0 = time.perf_counter()
                out = servers[name].post("/generate", job)
                seconds[name] += time.perf_counter() - t0
                meta = out["meta_info"]
                tokens[name] += meta["completion_tokens"]
                if rep == 0:
                    outputs[name].append(out["output_ids"])
                    if meta.get("spec_verify_ct"):
                        accepted[name].append(meta["spec_num_correct_drafts"] / meta["spec_verify_ct"])
                    trees[name].update(meta.get("entmtp_trees", []))
        for name in servers:
            tps[name].append(tokens[name] / seconds[name])
        print(f"repeat {rep + 1}/{repeats}: " + ", ".join(f"{n} {tps[n][-1]:.2f} tok/s" for n in servers),
              flush=True)
    base = statistics.median(tps["plain"])
    rows = {}
    for name in servers:
        med = statistics.median(tps[name])
        rows[name] = {
            "system": name, "tokens_per_s": round(med, 3), "vs_plain": round(med / base, 3),
            "tokens_per_s_repeats": [round(x, 3) for x in tps[name]],
            "accepted_drafts_per_step": round(statistics.mean(accepted[name]), 3) if accepted[name] else None,
            "equal_to_plain": sum(a == b for a, b in zip(outputs[name], outputs["plain"])),
            "trees": dict(trees[name].most_common()),
        }
    return rows


def write(rows: dict, args, n_jobs: int, minutes: float) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    head = (f"## ENTMTP in SGLang under JSON schemas (commit {commit}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{minutes:.1f} min)\n\n{n_jobs} held-out JSON prompts with their schemas, {args.max_new_tokens} new "
            f"tokens max, batch 1, greedy, float32, compact JSON; median of {args.repeats} interleaved passes; "
            f"{platform.processor() or platform.machine()}, load average at end "
            f"{open('/proc/loadavg').read().split()[0]}.\n\n"
            "| system | tokens/s | vs plain | accepted drafts / step | equal to plain | trees chosen |\n"
            "|---|---|---|---|---|---|\n")
    lines = []
    for r in rows.values():
        total = sum(r["trees"].values()) or 1
        tr = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in list(r["trees"].items())[:4]) or "-"
        acc = "-" if r["accepted_drafts_per_step"] is None else f"{r['accepted_drafts_per_step']:.2f}"
        lines.append(f"| {r['system']} | {r['tokens_per_s']:.2f} | {r['vs_plain']:.2f}x | {acc} | "
                     f"{r['equal_to_plain']}/{n_jobs} | {tr} |")
    md = head + "\n".join(lines) + "\n"
    print(md)
    (args.out / "sglang_grammar.md").write_text(md)
    with open(args.out / "sglang_grammar.jsonl", "w") as f:
        for r in rows.values():
            f.write(json.dumps({**r, "commit": commit, "max_new_tokens": args.max_new_tokens,
                                "repeats": args.repeats, "prompts": n_jobs, "minutes": round(minutes, 2)}) + "\n")


if __name__ == "__main__":
    main()
