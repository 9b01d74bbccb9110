"""SGLang on this CPU, side by side: no speculation, EAGLE static (small grid), --speculative-adaptive, ENTMTP.

    .venv/bin/python bench/experiments/sglang_cpu.py [--per-task 3] [--max-new-tokens 64] [--batches 1,8]

One server per system, the same SGLang build, prompts (held-out test split of code, chat, math, prose,
JSON) and machine; greedy; float32 so that greedy equality with the no-speculation server is checked
exactly. Writes bench/results/sglang_cpu.{jsonl,md}. See entmtp_sglang/bench/sglang_benchmark.py.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import DEFAULT_SYSTEMS, run, to_markdown, write

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-task", type=int, default=3, help="test prompts per task (5 tasks)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (requests in flight)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default="",
                    help="comma-separated subset of: " + ", ".join(s.name for s in DEFAULT_SYSTEMS))
    ap.add_argument("--at-once", type=int, default=None, help="the most servers up together; more systems run in "
                    "waves, plain decoding in each (default: all at once)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    t0 = time.time()
    config = {"per_task": args.per_task, "max_new_tokens": args.max_new_tokens, "batches": list(batches)}

    def save(rows, done):       # after every repeat, so a long run leaves results behind
        write(rows, args.out, {**config, "repeats": done, "duration_s": round(time.time() - t0)})

    names = [n for n in args.systems.split(",") if n]
    systems = [s for s in DEFAULT_SYSTEMS if not names or s.name in names]
    config["systems"] = [s.name for s in systems]
    rows = run(systems, batches=batches, per_task=args.per_task, max_new=args.max_new_tokens, repeats=args.repeats,
               log_dir=ROOT / "runs" / "sglang-bench", on_repeat=save, at_once=args.at_once)
    print(to_markdown(rows))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
