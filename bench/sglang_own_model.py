"""ENTMTP on a model the user serves, inside SGLang on this CPU: no set, a set calibrated through SGLang, and
the set shipped for that model, side by side with no speculation and static EAGLE.

    .venv/bin/python bench/sglang_own_model.py --model smollm2 --calibrated SET.json [--per-task 2]

The model is served under a directory name no shipped set matches (a symlink, `<name>-own`), so ENTMTP
without a set starts with the generic set and calibrates online; `--calibrated` must be a set written by
`entmtp calibrate --engine sglang --model-path <that symlink> ...` (its model name is the symlink's); the
shipped set is forced with ENTMTP_FORCE_TREE_SET=1. Greedy, float32, one server per system, all up at once,
measured interleaved (entmtp_sglang/bench/sglang_benchmark.py); median over repeats.
Writes bench/results/sglang_own_model.{jsonl,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import PLAIN, SystemSpec, run, to_markdown, write
from entmtp_sglang.model.prepare import resolve_alias

ROOT = Path(__file__).resolve().parent.parent


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
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    model = resolve_alias(args.model)
    served = own_model_dir(model, args.link_dir)
    shipped = ROOT / "trees" / f"{model.name}-eagle-mixed.json"
    systems = [PLAIN,
               SystemSpec("eagle-s3-k1-n4", "EAGLE", 3, 1, 4),
               SystemSpec("entmtp-no-set", "ENTMTP"),
               SystemSpec("entmtp-calibrated-via-sglang", "ENTMTP",
                          env=(("ENTMTP_TREE_SET", str(args.calibrated.resolve())),))]
    if shipped.exists():
        systems.append(SystemSpec("entmtp-shipped-set", "ENTMTP", env=(("ENTMTP_TREE_SET", str(shipped)),
                                                                        ("ENTMTP_FORCE_TREE_SET", "1"))))
    batches = tuple(int(b) for b in args.batches.split(","))
    t0 = time.time()
    config = {"model": model.name, "served_as": served.name, "calibrated": str(args.calibrated),
              "per_task": args.per_task, "max_new_tokens": args.max_new_tokens, "batches": list(batches),
              "systems": [s.name for s in systems]}

    def save(rows, done):
        write(rows, args.out, {**config, "repeats": done, "duration_s": round(time.time() - t0)},
              name="sglang_own_model")

    rows = run(systems, batches, args.per_task, args.max_new_tokens, args.repeats,
               log_dir=ROOT / "runs" / "sglang-own-model", on_repeat=save, model=served)
    save(rows, args.repeats)
    print(to_markdown(rows))


if __name__ == "__main__":
    main()
