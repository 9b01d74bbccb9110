"""More of the target's own answers for the drafters already shipped: generate, teacher-force, fine-tune, compare.

    python -m entmtp_sglang.training.own_refresh --kinds eagle,eagle3 --prompts 3000 --generate-minutes 75 \\
        --threads 2 --install                                                    # `make drafters-refresh`

The docs' ablation (docs/drafters.md) found the target's own answers worth about a third more per position than
fixed text, and the shipped drafters' held-out agreement still rising when their budgets ended. This goes on from
the shipped weights themselves (no earlier cache needed):

1. the target's greedy answers to `--prompts` new training prompts (`distill_data`'s kinds: ShareGPT first turns,
   standard-library functions, word problems, schemas answered under their grammar; drawn with `--seed`, so a new
   seed asks mostly new prompts) and to `--held-prompts` others none of them repeat, generated for at most
   `--generate-minutes` (what was answered by then is used), then teacher-forced into the fixed-data shard format
   (SGLang's capture layers, the target's top-32): `$ENTMTP_CACHE/own/<name>/`;
2. each drafter of `--kinds` scored on the held-out answers as shipped, fine-tuned from the shipped weights
   (`eagle3_train --init <shipped folder>`, training-time test over 3 levels, `--minutes` each, a fresh optimizer
   at `--lr`) into `$ENTMTP_CACHE/<kind>/<name>/`, and scored again on the same held-out windows;
3. with `--install`, a drafter whose held-out agreement rose at depth 1 and on average over the levels replaces the
   shipped one (bf16, the same size), its `training.json` extended by this step's record (the data, the time, both
   scores). A drafter that did not improve is left as it is, and the log says so.

Every step resumes (the answers shard by shard, a training run from its checkpoint); the log has progress and ETAs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import eagle3_train as et
from . import fixed_data as fd

REPO = Path(__file__).resolve().parents[2]


def _log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} own-refresh: {msg}", file=sys.stderr, flush=True)


def teacher_recipe(model_dir: Path, home: Path) -> Path:
    """`home/recipe.json`: the fixed-data recipe's teacher settings (top-k, batch and shard sizes) with SGLang's
    capture layers and the target's fingerprint: what `own_responses` teacher-forces with."""
    import torch

    from ..model.load import load_target, target_fingerprint

    target = load_target(model_dir, torch.float32)
    recipe = {**asdict(fd.Recipe()), "model": str(model_dir), "fingerprint": target_fingerprint(target),
              "capture_layers": list(fd.eagle3_layers(target.shape.num_hidden_layers)), "kind": "self-distilled"}
    home.mkdir(parents=True, exist_ok=True)
    (home / "recipe.json").write_text(json.dumps(recipe, indent=1))
    return home


def better(after: dict, before: dict) -> bool:
    a, b = after["agreement"], before["agreement"]
    return a[0] > b[0] and sum(a) > sum(b)


def install(run_dir: Path, out: Path, record: dict) -> int:
    """The run's shipped checkpoint into `out` (replacing it), `training.json` kept and extended by `record`."""
    old = json.loads((out / "training.json").read_text()) if (out / "training.json").exists() else {}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir / "shipped", tmp)
    old.setdefault("refreshes", []).append(record)
    (tmp / "training.json").write_text(json.dumps(old, indent=1) + "\n")
    shutil.rmtree(out)
    tmp.rename(out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def run(args) -> int:
    from ..model.prepare import cache_root
    from .ablation import own_responses, supervised_in

    checked = et.kinds_and_model(args)
    if checked is None:
        return 2
    kinds, model_dir = checked
    package = Path(args.package or REPO / "entmtp_sglang" / "models" / model_dir.name)
    for kind in kinds:
        if not (package / kind / "model.safetensors").exists():
            print(f"error: no shipped {kind} drafter in {package / kind} to start from", file=sys.stderr)
            return 2
    t_all = time.time()
    home = Path(args.out or cache_root() / "own" / args.name)
    teacher_recipe(model_dir, home)
    t0 = time.time()
    files = own_responses(model_dir, home, home, args.prompts, args.held_prompts, args.batch_size,
                          args.max_new_tokens, args.max_prompt_tokens, args.threads,
                          Path(args.wheels or cache_root() / "wheels"), _log, seed=args.seed,
                          stop_after_s=args.generate_minutes * 60)
    answered = json.loads((home / "self-train" / "answered.json").read_text())
    data = {"prompts_asked": args.prompts, "seed": args.seed, "batches_answered": answered["batches"],
            "batches_unanswered": answered["batches_unanswered"],
            "positions": sum(int(et._meta(f)["positions"]) for f in files["self-train"]),
            "supervised": supervised_in(files["self-train"]), "held_out_supervised": supervised_in(files["self-held"]),
            "max_new_tokens": args.max_new_tokens}
    _log(f"own answers: {data['supervised']:,} supervised of {data['positions']:,} positions in "
         f"{len(files['self-train'])} shards, {data['held_out_supervised']:,} held out ({time.time() - t0:.0f} s "
         f"this run) in {home}")
    results = {}
    for kind in kinds:
        init = package / kind
        cfg = et.TrainConfig(kind=kind, minutes=args.minutes, positions=10**9, lr=args.lr, warmup=0.05,
                             eval_windows=args.eval_windows)
        run_dir = cache_root() / kind / args.name
        before = et.score(init, model_dir, files["self-held"], cfg)
        _log(f"{kind} as shipped: held-out agreement per level {before['agreement']}, depth 1 by source "
             f"{before['depth1_agreement_by_source']}")
        if not (run_dir / "summary.json").exists():
            et.train(files["self-train"][0].parent, model_dir, run_dir, cfg, threads=args.threads,
                     held_out=files["self-held"], init_from=init)
        summary = json.loads((run_dir / "summary.json").read_text())
        after = summary["held_out"]
        improved = better(after, before)
        _log(f"{kind} fine-tuned ({summary['positions']:,} positions in {summary['seconds'] / 60:.0f} min): "
             f"held-out agreement per level {before['agreement']} -> {after['agreement']}"
             f"{'' if improved else ' (no better: the shipped drafter stays)'}")
        results[kind] = {"before": before, "after": after, "positions": summary["positions"],
                         "seconds": summary["seconds"], "improved": improved}
        if args.install and improved:
            record = {"command": "python -m entmtp_sglang.training.own_refresh " + " ".join(args.argv),
                      "what": "fine-tuned from the weights shipped before on more of the target's own greedy "
                              "answers (teacher-forced, the fixed-data shard format)",
                      "date": time.strftime("%Y-%m-%d"), "data": data, "config": summary["config"],
                      "positions": summary["positions"], "seconds": summary["seconds"],
                      "held_out_before": before, "held_out": after}
            size = install(run_dir, init, record)
            _log(f"{kind}: installed into {init} ({size / 1e6:.1f} MB)")
    (home / "refresh.json").write_text(json.dumps({"data": data, "results": results}, indent=1))
    _log(f"done in {(time.time() - t_all) / 60:.0f} min this run; summary in {home / 'refresh.json'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.own_refresh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="the target (default: smollm2, prepared on first use)")
    p.add_argument("--kinds", default="eagle,eagle3", help="drafters to fine-tune (default: eagle,eagle3)")
    p.add_argument("--name", default="refresh", help="$ENTMTP_CACHE/own/<name>/ and <kind>/<name>/ (resumed)")
    p.add_argument("--out", type=Path, default=None, help="the answers' folder instead of $ENTMTP_CACHE/own/<name>")
    p.add_argument("--package", type=Path, default=None,
                   help="the shipped drafters' folder (default: entmtp_sglang/models/<model>)")
    p.add_argument("--prompts", type=int, default=3000, help="training prompts to draw (default: 3000)")
    p.add_argument("--held-prompts", type=int, default=120, help="held-out prompts (default: 120)")
    p.add_argument("--seed", type=int, default=3,
                   help="prompt draw (default: 3; the shipped drafters' data used seeds 0-2)")
    p.add_argument("--generate-minutes", type=float, default=75.0,
                   help="stop generating training answers after this long and use what was answered (default: 75)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=112)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--minutes", type=float, default=12.0, help="each fine-tune's budget (default: 12)")
    p.add_argument("--lr", type=float, default=2e-4, help="the fine-tunes' peak learning rate (default: 2e-4)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows scored (default: 256)")
    p.add_argument("--install", action="store_true", help="replace a shipped drafter that improved")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--wheels", type=Path, default=None, help="the data wheels' cache (default: $ENTMTP_CACHE/wheels)")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
