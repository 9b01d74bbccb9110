"""Measure each tree's step cost inside a running SGLang server and write it into the tree set.

    .venv/bin/python -m entmtp_sglang.bench.sglang_costs [--tree-set trees/entmtp-tiny-eagle-mixed.json]
        [--batches 1,8,32] [--repeats 3] [--out FILE]

The selector ranks trees by (expected accepted + 1) / step cost, so the costs must be those of the engine
that serves: SGLang's per-step overhead (scheduling, draft-extend, the verify bookkeeping) dwarfs the
per-node cost of a small model on a CPU, and the reference engine's costs do not transfer. This starts
one ENTMTP server with the tree set, pins each tree in turn (`custom_params: {"entmtp_tree": NAME}`) on
`b` concurrent calibration prompts (never the benchmarks' held-out ones), and takes the step cost as
the difference quotient between a long and a short run,

    cost(tree, b) = (t_long - t_short) / (steps_long - steps_short),

which cancels prefill and HTTP overhead; steps are the batch's verify passes (the most any request
took). Trees and batch sizes are interleaved, the median over repeats is kept, and the set's
`expected_accepted` (from `entmtp calibrate`) is left as it was.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from ..calibrate.server import SGLangServer
from ..costs.provenance import amended
from ..sglang.config import ENV_TREE_SET, PIN_KEY, resolve_tree_set_path
from ..tasks import TASKS, interleave
from ..tree.treeset import load_tree_set


def calibration_prompts(n: int, chat_template: str | None = None) -> list[str]:
    """Calibration prompts as text (through the model's chat template, if it has one)."""
    from ..tasks import prompt_text

    items = interleave(TASKS, "calib", max(1, n // len(TASKS) + 1))
    return [prompt_text({**it, "prompt": it["prompt"][-600:]}, chat_template) for it in items][:n]


def timed_batch(server: SGLangServer, prompts: list[str], tree: str, max_new: int) -> tuple[float, int]:
    """Wall time and verify passes of one batch of concurrent requests, all pinned to `tree`."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True,
              "custom_params": {PIN_KEY: tree}}
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: server.post("/generate", {"text": p, "sampling_params": params}),
                             prompts))
    wall = time.perf_counter() - t0
    steps = max(int(o["meta_info"].get("spec_verify_ct") or o["meta_info"]["completion_tokens"]) for o in outs)
    return wall, steps


def measure(server: SGLangServer, names: list[str], batches: list[int], repeats: int, short: int, long: int,
            progress=print, chat_template: str | None = None) -> dict[str, dict[int, float]]:
    prompts = calibration_prompts(max(batches), chat_template)
    samples: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in batches}
    total, done = repeats * len(names) * len(batches), 0
    for rep in range(repeats):
        for b in batches:
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                t_s, s_s = timed_batch(server, prompts[:b], name, short)
                t_l, s_l = timed_batch(server, prompts[:b], name, long)
                if s_l > s_s:
                    samples[(name, b)].append((t_l - t_s) / (s_l - s_s))
                done += 1
                progress(f"[{done}/{total}] {name} batch {b}: "
                         f"{1000 * samples[(name, b)][-1]:.1f} ms/step" if samples[(name, b)] else
                         f"[{done}/{total}] {name} batch {b}: no step difference")
    return {n: {b: statistics.median(samples[(n, b)]) for b in batches if samples[(n, b)]} for n in names}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m entmtp_sglang.bench.sglang_costs",
                                 description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree-set", type=Path, default=None, help="tree set to measure (default: the shipped EAGLE set)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--short", type=int, default=16, help="new tokens of the short run")
    ap.add_argument("--long", type=int, default=64, help="new tokens of the long run")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: overwrite --tree-set)")
    ap.add_argument("--log", type=Path, default=None, help="server log file")
    ap.add_argument("--model", default=None,
                    help="model directory or smollm2 (default: the bundled model); its ENTMTP set by default")
    args = ap.parse_args(argv)
    model = None
    if args.model:
        from ..model.prepare import resolve_alias

        model = resolve_alias(args.model)
    path = args.tree_set or resolve_tree_set_path(None, model.name if model else "entmtp-tiny")
    if path is None:
        ap.error("no tree set is shipped for this model: pass --tree-set FILE")
    ts = load_tree_set(path)
    batches = sorted({int(b) for b in args.batches.split(",")})
    if not batches or min(batches) < 1 or args.long <= args.short:
        ap.error("batch sizes must be >= 1 and --long must exceed --short")
    names = [t.tree.name for t in ts.trees]
    print(f"measuring {len(names)} trees of {path} at batch {batches} in SGLang ...", flush=True)
    t0 = time.monotonic()
    server = SGLangServer.cpu("ENTMTP", env={ENV_TREE_SET: str(path)}, log_path=args.log,
                              max_total_tokens=max(20000, 200 * max(batches) * 4),
                              **({"model": model, "extra": ("--dtype", "float32")} if model else {}))
    with server:
        template = model / "chat_template.jinja" if model else None
        costs = measure(server, names, batches, args.repeats, args.short, args.long,
                        progress=lambda m: print(m, flush=True),
                        chat_template=template.read_text() if template and template.exists() else None)
    trees = tuple(dataclasses.replace(t, cost_seconds={b: round(c, 6) for b, c in costs[t.tree.name].items()})
                  for t in ts.trees)
    hardware = f"{ts.hardware.split(';')[0]}; step costs measured in SGLang (entmtp_sglang.bench.sglang_costs)"
    step_costs = {"engine": "sglang", "batches": batches, "repeats": args.repeats, "short": args.short,
                  "long": args.long, "created": time.strftime("%Y-%m-%d %H:%M"),
                  "prompts": "calib split, interleaved tasks"}
    out = amended(ts, {"step_costs": step_costs}, trees=trees, hardware=hardware)
    out.save(args.out or path)
    print(f"wrote {args.out or path} in {(time.monotonic() - t0) / 60:.1f} min")
    for t in trees:
        costs = "  ".join(f"b{b}: {1000 * c:.1f} ms" for b, c in sorted(t.cost_seconds.items()))
        print(f"  {t.tree.name:10s} {costs}")


if __name__ == "__main__":
    sys.exit(main())
