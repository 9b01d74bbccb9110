"""SmolLM2's fixed-data drafters in one command: the data, EAGLE-3 and EAGLE trained on it, installed (issue 38).

    python -m entmtp_sglang.training.smollm2_drafters --threads 2 --install     # `make drafters-fixed`

1. `entmtp distill fixed-data` (training/fixed_data.py): 2M teacher-forced positions of the wheel corpus, into
   `$ENTMTP_CACHE/distill/fixed-<hash>/` (resumed shard by shard; about 40 minutes on 2 cores of a Xeon with
   AVX-512, 4 hours on an AVX2 AMD EPYC);
2. `eagle3_train` (EAGLE-3, `--minutes-eagle3`) and `eagle3_train --kind eagle` (the EAGLE drafter over the same
   shards, `--minutes-eagle`), each into `$ENTMTP_CACHE/<kind>/<run>/`; a run that has finished (its
   `summary.json`) is reused, an unfinished one resumes from its checkpoint;
3. the target's own answers (`--own-prompts`, default 1000: greedy responses to training prompts of the kinds
   `distill_data` draws: ShareGPT first turns, standard-library functions, word problems, schemas answered under
   their grammar; and to a tenth as many held-out prompts), teacher-forced into the same shard format in
   `$ENTMTP_CACHE/own/<run>/` (`ablation.own_responses`), and each drafter fine-tuned on them from its fixed-data
   weights (`eagle3_train --init`, `--minutes-own`), into `$ENTMTP_CACHE/<kind>/<run>-own/`: the ablation in
   docs/drafters.md shows the target's own text worth more per position than fixed text, and the fixed text's 2M
   positions the better start;
4. with `--install`, each drafter's bf16 checkpoint as shipped (EAGLE-3 without its head: `entmtp model prepare`
   writes the target's rows in) goes into `entmtp_sglang/models/smollm2-135m-instruct/<kind>/` with a
   `training.json` that records the recipe, the data (positions per source, bytes, compute time), the training
   (positions, seconds) and the held-out agreement. `--kinds` picks which drafters are trained and installed.

It prints the time and size of every step and of the whole recipe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from . import eagle3_train as et
from . import fixed_data as fd

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "entmtp_sglang" / "models" / "smollm2-135m-instruct"
COMMAND = "python -m entmtp_sglang.training.smollm2_drafters --threads 2 --install"


def _log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} smollm2-drafters: {msg}", file=sys.stderr, flush=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def install(run_dir: Path, kind: str, data: Path, out: Path, own: dict | None = None) -> dict:
    """Copy a finished run's shipped checkpoint into `out` with its training.json; returns that record. `own`: the
    fine-tune on the target's own answers that `run_dir` is ({"prompts", "positions", "supervised", "init_from"})."""
    summary = json.loads((run_dir / "summary.json").read_text())
    data_summary = json.loads((data / "summary.json").read_text())
    first = summary
    if own is not None:
        first = json.loads((Path(own["init_from"]) / "summary.json").read_text())
    record = {
        "command": COMMAND, "kind": kind,
        "data": {k: data_summary[k] for k in ("recipe", "recipe_hash", "positions", "loss_mask_positions",
                                              "positions_by_source", "bytes", "compute_seconds",
                                              "positions_per_second", "cpu", "torch")},
        **{k: first[k] for k in ("config", "positions", "seconds", "capture_layers", "draft_vocab",
                                 "held_out_shards", "held_out")},
        "self_distilled": "none: this drafter is trained on the fixed data alone (the ablation in docs/drafters.md "
                          "compares fixed, self-distilled and mixed data at equal positions)",
    }
    if own is not None:
        record["self_distilled"] = {
            **own, "what": "then fine-tuned on the target's own greedy answers (teacher-forced, same format), from "
                           "the fixed-data weights above",
            **{k: summary[k] for k in ("config", "positions", "seconds", "held_out_shards", "held_out")}}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir / "shipped", tmp)
    record["shipped_bytes"] = dir_bytes(tmp)
    (tmp / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return record


def run(args) -> int:
    from ..model.prepare import cache_root

    checked = et.kinds_and_model(args)
    if checked is None:
        return 2
    kinds, model_dir = checked
    t_all = time.time()
    t0 = time.time()
    data = fd.build(model_dir, fd.Recipe(), threads=args.threads)
    data_summary = json.loads((data / "summary.json").read_text())
    _log(f"data: {data_summary['positions']:,} positions, {data_summary['bytes'] / 2**30:.2f} GiB, "
         f"{data_summary['compute_seconds'] / 60:.0f} min of compute ({time.time() - t0:.0f} s this run) in {data}")
    if not data_summary["complete"]:
        print(f"error: {data} is incomplete ({data_summary['shards_complete']}/{data_summary['shards']} shards)",
              file=sys.stderr)
        return 1
    minutes = {"eagle3": args.minutes_eagle3, "eagle": args.minutes_eagle}
    own_files = None
    if args.own_prompts:
        from .ablation import own_responses, supervised_in

        t0 = time.time()
        home = cache_root() / "own" / args.run
        home.mkdir(parents=True, exist_ok=True)
        own_files = own_responses(model_dir, home, data, args.own_prompts, max(20, args.own_prompts // 10), 32,
                                  112, 256, args.threads, cache_root() / "wheels", _log)
        _log(f"own answers: {len(own_files['self-train'])} training shards, {supervised_in(own_files['self-train']):,} "
             f"supervised positions ({time.time() - t0:.0f} s this run) in {home}")
    for kind in kinds:
        run_dir = cache_root() / kind / args.run
        if not (run_dir / "summary.json").exists():
            cfg = et.TrainConfig(kind=kind, minutes=minutes[kind])
            et.train(data, model_dir, run_dir, cfg, threads=args.threads)
        summary = json.loads((run_dir / "summary.json").read_text())
        _log(f"{kind}: {summary['positions']:,} positions in {summary['seconds'] / 60:.0f} min; held-out agreement "
             f"per level {summary['held_out']['agreement']} ({run_dir})")
        own = None
        if own_files is not None:
            fixed_run, run_dir = run_dir, cache_root() / kind / f"{args.run}-own"
            if not (run_dir / "summary.json").exists():
                cfg = et.TrainConfig(kind=kind, minutes=args.minutes_own, positions=10**9, lr=2e-4, warmup=0.05)
                et.train(own_files["self-train"][0].parent, model_dir, run_dir, cfg, threads=args.threads,
                         held_out=own_files["self-held"], init_from=fixed_run)
            summary = json.loads((run_dir / "summary.json").read_text())
            own = {"prompts": args.own_prompts, "supervised": supervised_in(own_files["self-train"]),
                   "init_from": str(fixed_run)}
            _log(f"{kind} on the target's own answers: {summary['positions']:,} positions in "
                 f"{summary['seconds'] / 60:.0f} min; held-out own answers, agreement per level "
                 f"{summary['held_out']['agreement']} ({run_dir})")
        if args.install:
            out = PACKAGE_DIR / kind
            record = install(run_dir, kind, data, out, own)
            _log(f"{kind}: installed into {out} ({record['shipped_bytes'] / 1e6:.1f} MB)")
    _log(f"done in {(time.time() - t_all) / 60:.0f} min this run")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.smollm2_drafters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="the target (default: smollm2, prepared on first use)")
    p.add_argument("--kinds", default="eagle3,eagle", help="drafters to train and install (default: eagle3,eagle)")
    p.add_argument("--run", default="smollm2", help="run name: $ENTMTP_CACHE/<kind>/<run>/ (default: smollm2)")
    p.add_argument("--minutes-eagle3", type=float, default=32.0, help="EAGLE-3's training budget (default: 32)")
    p.add_argument("--minutes-eagle", type=float, default=20.0, help="EAGLE's training budget (default: 20)")
    p.add_argument("--own-prompts", type=int, default=1000,
                   help="fine-tune each drafter on the target's own answers to this many prompts (default: 1000; "
                        "0: the fixed data alone)")
    p.add_argument("--minutes-own", type=float, default=6.0, help="each fine-tune's budget (default: 6)")
    p.add_argument("--install", action="store_true",
                   help=f"copy the drafters into {PACKAGE_DIR.relative_to(REPO)}/<kind>/")
    p.add_argument("--threads", type=int, default=0)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
