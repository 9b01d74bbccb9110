"""What speculation adds, quickly: ENTMTP against plain SGLang with this package on `entmtp_torch` (overlap on),
nothing else, on the product benchmark's workloads (bench/sglang_speed.py's prompts, chat template and mixed batch).

The product benchmark (an hour and more) runs every system beside stock SGLang in both dtypes; this runs the two
servers the "what speculation adds" ratio needs, in one wave, interleaved (plain first in every round), so a change
to ENTMTP can be checked against plain in minutes. Each ratio is paired: ENTMTP over the plain run beside it in the
same repeat, the median over repeats, with a bootstrap interval over them.

    .venv/bin/python bench/experiments/speculation_gap.py --tasks chat,prose,mixed-batch --batches 4 \\
        --mixed-batch-batches 8,16 --out /tmp/gap          # about 10 minutes on 2 cores

ENTMTP's server may be given environment switches (`--env ENTMTP_GUARD=0`), so an ablation runs beside the default
with `--also`: a second ENTMTP server with those switches (`entmtp-also`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    ENTMTP,
    PLAIN_ENTMTP,
    bootstrap_interval,
    machine,
    paired_ratios,
    run_workloads,
    to_markdown,
    write,
)
from entmtp_sglang.model.prepare import resolve_alias

ROOT = Path(__file__).resolve().parents[2]


def _speed():
    spec = importlib.util.spec_from_file_location("bench_sglang_speed", ROOT / "bench" / "sglang_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq or not key.startswith("ENTMTP_"):
            raise SystemExit(f"--env/--also take ENTMTP_NAME=VALUE, got {p!r}")
        out.append((key, value))
    return tuple(out)


def gap_table(rows) -> str:
    """Per task and batch: each ENTMTP server's paired ratio over plain on entmtp_torch, with its interval."""
    by = {(r.system, r.task, r.batch): r for r in rows}
    lines = ["| task | batch | system | tok/s | plain tok/s | paired ratio | 95% interval over repeats |",
             "|---|---|---|---|---|---|---|"]
    for (system, task, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        p = by.get((PLAIN_ENTMTP.name, task, b))
        if system == PLAIN_ENTMTP.name or p is None:
            continue
        ratios = paired_ratios(r, p)
        if not ratios:
            continue
        lo, hi = bootstrap_interval(ratios)
        lines.append(f"| {task} | {b} | {system} | {r.tokens_per_s:.1f} | {p.tokens_per_s:.1f} | "
                     f"**{statistics.median(ratios):.2f}x** | {lo:.2f}-{hi:.2f} |")
    return "\n".join(lines)


def main() -> None:
    speed = _speed()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", choices=speed.PROMPT_SETS, default="measure")
    ap.add_argument("--tasks", default="chat,prose,mixed-batch",
                    help="from: " + ", ".join(speed.TASKS) + ", mixed-batch")
    ap.add_argument("--batches", type=speed._ints, default=(4,), help="batch sizes of each task (default 4)")
    ap.add_argument("--mixed-batch-batches", type=speed._ints, default=(8, 16))
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flush", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--env", action="append", default=[], metavar="ENTMTP_NAME=VALUE",
                    help="an environment switch of the ENTMTP server (repeatable)")
    ap.add_argument("--also", action="append", default=[], metavar="ENTMTP_NAME=VALUE",
                    help="run a second ENTMTP server (`entmtp-also`) with these switches too (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    chosen = [t for t in args.tasks.split(",") if t]
    bad = sorted(set(chosen) - set(speed.TASKS) - {"mixed-batch"})
    if bad or not chosen:
        ap.error(f"unknown task(s) {', '.join(bad) or '(none)'}")
    model = resolve_alias(args.model)
    kv = ("--max-total-tokens", "6000")
    systems = [dataclasses.replace(PLAIN_ENTMTP, args=PLAIN_ENTMTP.args + kv),
               dataclasses.replace(ENTMTP, args=ENTMTP.args + kv, env=ENTMTP.env + _env(args.env))]
    if args.also:
        systems.append(dataclasses.replace(systems[1], name="entmtp-also", env=systems[1].env + _env(args.also)))
    try:
        tasks = speed.workloads(AutoTokenizer.from_pretrained(str(model)), args.per_task, args.max_new_tokens,
                                args.prompts)
    except ValueError as e:
        ap.error(str(e))
    work = {t: (tasks[t], tuple(args.batches)) for t in chosen if t in speed.TASKS and args.batches}
    if "mixed-batch" in chosen and args.mixed_batch_batches:
        payloads, labels = speed.interleave(tasks)
        work["mixed-batch"] = (payloads, tuple(args.mixed_batch_batches), labels)
    if not work:
        ap.error("nothing to measure")
    t0 = time.time()
    rows = run_workloads(systems, work, args.repeats, ROOT / "runs" / "speculation-gap", model=model,
                         baseline=PLAIN_ENTMTP.name, flush=args.flush)
    meta = {"model": model.name, "prompts": args.prompts, "per_task": args.per_task,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "flush": args.flush,
            "env": {s.name: dict(s.env) for s in systems}, "duration_s": round(time.time() - t0), **machine()}
    write(rows, args.out, meta, name="speculation_gap")
    text = (f"Processor: {meta['processor']}; commit {meta['commit'][:7]}; {args.prompts} prompts, "
            f"{args.max_new_tokens} new tokens, median of {args.repeats} repeats; {meta['duration_s']} s.\n\n"
            f"{gap_table(rows)}\n\n{to_markdown(rows, PLAIN_ENTMTP.name)}\n")
    args.out.joinpath("speculation_gap.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
