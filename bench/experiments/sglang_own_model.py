"""ENTMTP on a model the user serves, inside SGLang on this CPU: no set, a set calibrated through SGLang, and
the set shipped for that model, side by side with no speculation, static EAGLE (a grid of three) and
SGLang's `--speculative-adaptive`.

    .venv/bin/python bench/experiments/sglang_own_model.py --model smollm2 --calibrated SET.json [--per-task 2]

The model is served under a directory name no shipped set matches (a symlink, `<name>-own`), so ENTMTP
without a set starts with the generic set and calibrates online; `--calibrated` must be a set written by
`entmtp calibrate --engine sglang --model-path <that symlink> ...` (its model name is the symlink's); the
shipped set is forced with ENTMTP_FORCE_TREE_SET=1. Greedy, float32, one server per system, all up at once,
measured interleaved (entmtp_sglang/bench/sglang_benchmark.py); median over repeats.
Writes bench/results/sglang_own_model.{jsonl,md} (with `--token-map`: sglang_own_model_token_map.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import ADAPTIVE, EAGLE_GRID, PLAIN, SystemSpec, run, to_markdown, write
from entmtp_sglang.model.load import draft_token_map
from entmtp_sglang.model.prepare import resolve_alias

ROOT = Path(__file__).resolve().parents[2]


def own_model_dir(model: Path, where: Path) -> Path:
    """`model` under the name `<name>-own` (a symlink in `where`)."""
    link = where / f"{model.name}-own"
    where.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(model.resolve(), target_is_directory=True)
    return link


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--calibrated", type=Path, required=True, help="the set from entmtp calibrate --engine sglang")
    ap.add_argument("--per-task", type=int, default=2, help="test prompts per task (5 tasks)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--link-dir", type=Path, default=ROOT / "runs" / "own-model",
                    help="where the renamed model link lives (must match the one calibrated on)")
    ap.add_argument("--systems", default="", help="comma-separated subset of: plain, " + ", ".join(
        s.name for s in (*EAGLE_GRID, ADAPTIVE)) + ", entmtp-no-set, entmtp-calibrated-via-sglang, "
        "entmtp-calibrated-online, entmtp-shipped-set (default: all)")
    ap.add_argument("--token-map", action="store_true",
                    help="every speculative server drafts over the drafter's draft vocabulary "
                         "(--speculative-token-map from `entmtp model token-map`)")
    ap.add_argument("--max-total-tokens", type=int, default=6000,
                    help="each server's KV pool in tokens (default: 6000; eight SmolLM2 servers at SGLang's "
                         "20000 do not fit in 24 GiB)")
    ap.add_argument("--at-once", type=int, default=None, help="the most servers up together; more systems run in "
                    "waves, plain decoding in each (default: all at once)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    model = resolve_alias(args.model)
    served = own_model_dir(model, args.link_dir)
    shipped = ROOT / "trees" / f"{model.name}-eagle-mixed.json"
    calibrated = ("ENTMTP_TREE_SET", str(args.calibrated.resolve()))
    systems = [PLAIN, *EAGLE_GRID, ADAPTIVE,
               SystemSpec("entmtp-no-set", "ENTMTP"),
               SystemSpec("entmtp-calibrated-via-sglang", "ENTMTP", env=(calibrated,)),
               SystemSpec("entmtp-calibrated-online", "ENTMTP", env=(calibrated, ("ENTMTP_ONLINE_CALIBRATION", "1")))]
    if shipped.exists():
        systems.append(SystemSpec("entmtp-shipped-set", "ENTMTP", env=(("ENTMTP_TREE_SET", str(shipped)),
                                                                        ("ENTMTP_FORCE_TREE_SET", "1"))))
    kv = ("--max-total-tokens", str(args.max_total_tokens))   # the servers' KV pools; the last flag wins
    systems = [dataclasses.replace(s, args=s.args + kv) for s in systems]
    if args.token_map:
        extra = ("--speculative-token-map", str(draft_token_map(model / "eagle")))
        systems = [s if s.speculative is None else dataclasses.replace(s, args=s.args + extra) for s in systems]
    names = [n for n in args.systems.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in systems})
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(s.name for s in systems)}")
    systems = [s for s in systems if not names or s.name in names]
    batches = tuple(int(b) for b in args.batches.split(","))
    t0 = time.time()
    config = {"model": model.name, "served_as": served.name, "calibrated": str(args.calibrated),
              "token_map": args.token_map,
              "per_task": args.per_task, "max_new_tokens": args.max_new_tokens, "batches": list(batches),
              "systems": [s.name for s in systems]}

    def save(rows, done):
        write(rows, args.out, {**config, "repeats": done, "duration_s": round(time.time() - t0)},
              name="sglang_own_model_token_map" if args.token_map else "sglang_own_model")

    rows = run(systems, batches, args.per_task, args.max_new_tokens, args.repeats,
               log_dir=ROOT / "runs" / "sglang-own-model", on_repeat=save, model=served,
               starts_at_once=2, at_once=args.at_once)  # a SmolLM2 server peaks at several GB while it loads
    save(rows, args.repeats)
    print(to_markdown(rows))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
