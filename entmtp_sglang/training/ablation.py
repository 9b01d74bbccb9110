"""Which data makes the better drafter: fixed text, the target's own responses, or both (issue 38's ablation).

    python -m entmtp_sglang.training.ablation --fixed ~/.cache/entmtp/distill/fixed-<hash> --positions 150000

Three EAGLE-3 drafters for the same target, trained the same way (`eagle3_train`, one pass, the same draft
vocabulary, seed and configuration) on the same number of *supervised* positions (positions whose next token is
response text, the only ones with a loss):
    fixed            teacher-forced fixed text (`fixed_data.py`'s shards, in their order, the last shard never)
    self-distilled   the target's own greedy responses to training prompts (`distill_data.py`: ShareGPT first turns,
                     standard-library functions to complete, templated word problems, train-split schemas answered
                     under their grammar), teacher-forced through the same forward into the same shard format
    mix              half of each
and each is scored on two held-out sets: the fixed set's last shard (fixed text) and the target's own responses to
prompts none of the runs saw (`distill_data --exclude`). The score is the depth-1 (and deeper, training-time test)
agreement of the drafter's argmax with the target's within the draft vocabulary, at supervised positions.

Everything lives in `$ENTMTP_CACHE/ablation/<name>/`: `self-train/` and `self-held/` (generation work and shards),
`data-<arm>/` (each arm's shards), `run-<arm>/` (eagle3_train runs), `ablation.json` and `ablation.md` (the table,
for docs/drafters.md), `ablation.log`. Every step resumes from what a stopped run left.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

ARMS = ("fixed", "self-distilled", "mix")
TASK_SOURCE = {"chat": "chat", "code": "code-qa", "math": "math", "json": "json-schema"}  # distill_data task -> source


class _Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} ablation: {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, file=sys.stderr, flush=True)


# --- the target's own responses, in the fixed-data shard format ---------------------------------------------

def generated_sequences(work: Path) -> list[tuple[list[int], list[int], int]]:
    """(token ids, loss mask, source index) per response of a distill_data work directory, in shard order: the
    prompt as the chat template rendered it, then the response; the mask is 1 where the next token is response."""
    import torch

    from .fixed_data import SOURCES

    out = []
    for sh in sorted((work / "gen").glob("shard-*.pt")):
        for row in torch.load(sh, weights_only=True):
            prompt, resp = list(row["prompt"]), list(row["response"])
            if not resp:
                continue
            ids = prompt + resp
            mask = [0] * len(ids)
            for j in range(len(prompt) - 1, len(ids) - 1):
                mask[j] = 1
            out.append((ids, mask, SOURCES.index(TASK_SOURCE[row["task"]])))
    return out


def write_shards(fwd, seqs: list[tuple[list[int], list[int], int]], out: Path, top_k: int, batch_tokens: int,
                 shard_positions: int, meta: dict, log) -> list[Path]:
    """Teacher-force `seqs` into shards of about `shard_positions` positions (skipping shards already written)."""
    import torch
    from safetensors.torch import save_file

    from .fixed_data import compute_shard, shard_path

    out.mkdir(parents=True, exist_ok=True)
    groups, cur, n = [], [], 0
    for s in seqs:
        cur.append(s)
        n += len(s[0])
        if n >= shard_positions:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    files = []
    for i, group in enumerate(groups):
        path = shard_path(out, i)
        files.append(path)
        if path.exists():
            continue
        t0 = time.time()
        tensors = compute_shard(fwd, [g[0] for g in group], top_k, batch_tokens)
        tensors.update({
            "input_ids": torch.tensor([t for g in group for t in g[0]], dtype=torch.int32),
            "loss_mask": torch.tensor([m for g in group for m in g[1]], dtype=torch.uint8),
            "seq_lens": torch.tensor([len(g[0]) for g in group], dtype=torch.int32),
            "seq_source": torch.tensor([g[2] for g in group], dtype=torch.uint8)})
        npos = int(tensors["input_ids"].numel())
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={**meta, "positions": str(npos), "sequences": str(len(group)),
                                               "loss_mask_positions": str(int(tensors["loss_mask"].sum()))})
        os.replace(tmp, path)
        log(f"{out.name}: shard {i + 1}/{len(groups)}, {npos} positions in {time.time() - t0:.1f} s")
    return files


def own_responses(model_dir: Path, home: Path, fixed: Path, prompts: int, held_prompts: int, batch_size: int,
                  max_new_tokens: int, max_prompt_tokens: int, threads: int, wheels: Path,
                  log, seed: int = 0, stop_after_s: float | None = None) -> dict[str, list[Path]]:
    """The target's greedy responses to `prompts` training prompts (`home/self-train/`, drawn with `seed`) and to
    `held_prompts` others (`home/self-held/`, seed + 1, none repeating a training one), teacher-forced into the
    shard format of the fixed set `fixed` (its `recipe.json`: capture layers, top-k, target): {"self-train":
    shards, "self-held": shards}. Resumes. `stop_after_s`: the training answers' generation stops starting batches
    after that long and what was answered is used (`home/self-train/answered.json` records it, so that a rerun
    teacher-forces the same answers instead of generating on)."""
    import torch

    from ..model.load import load_target, target_fingerprint
    from . import distill_data
    from .fixed_data import TeacherForward

    recipe = json.loads((Path(fixed) / "recipe.json").read_text())
    for work, n, exclude, s, budget in ((home / "self-train", prompts, [], seed, stop_after_s),
                                        (home / "self-held", held_prompts, [home / "self-train"], seed + 1, None)):
        if (work / "answered.json").exists():
            continue
        log(f"generating {work.name} ({n} prompts, greedy, {max_new_tokens} new tokens at most)")
        left = distill_data.generate(model_dir, work, n, s, batch_size, max_new_tokens, max_prompt_tokens, threads,
                                     wheels, log=log, exclude=exclude, stop_after_s=budget)
        (work / "answered.json").write_text(json.dumps({"batches_unanswered": left,
                                                        "batches": len(list((work / "gen").glob("shard-*.pt")))}))
    target = load_target(model_dir, torch.float32)
    if target_fingerprint(target) != recipe["fingerprint"]:
        raise SystemExit(f"error: {fixed} was built from another target than {model_dir}")
    fwd = TeacherForward(target, tuple(recipe["capture_layers"]))
    meta = {"capture_layers": json.dumps(recipe["capture_layers"]), "fingerprint": recipe["fingerprint"],
            "kind": "self-distilled"}
    files = {}
    for part in ("self-train", "self-held"):
        seqs = generated_sequences(home / part)
        out = home / part / "shards"
        files[part] = write_shards(fwd, seqs, out, recipe["top_k"], recipe["batch_tokens"],
                                   recipe["shard_positions"], meta, log)
        (out / "recipe.json").write_text(json.dumps({**recipe, "kind": "self-distilled", "work": str(home / part)}))
    return files


# --- equal supervised positions ------------------------------------------------------------------------------

def take(files: list[Path], supervised: int, out: Path, meta: dict) -> dict:
    """Copy whole sequences of `files`, in order, into `out` until `supervised` loss positions are reached; returns
    counts. A sequence that would overshoot is cut (its remaining supervised positions masked off)."""
    from safetensors.torch import load_file, save_file

    from .fixed_data import shard_path

    out.mkdir(parents=True, exist_ok=True)
    got = {"supervised": 0, "positions": 0, "sequences": 0}
    for i, f in enumerate(files):
        if got["supervised"] >= supervised:
            break
        s = load_file(str(f))
        lens = s["seq_lens"].tolist()
        keep, p = 0, 0
        mask = s["loss_mask"].clone()
        for ln in lens:
            left = supervised - got["supervised"]
            if left <= 0:
                break
            seg = mask[p:p + ln]
            m = int(seg.sum())
            if m > left:  # cut the supervision at the budget
                on = seg.nonzero().flatten()
                seg[on[left:]] = 0
                m = left
            got["supervised"] += m
            got["positions"] += ln
            got["sequences"] += 1
            keep += 1
            p += ln
        part = {"input_ids": s["input_ids"][:p], "loss_mask": mask[:p], "seq_lens": s["seq_lens"][:keep],
                "seq_source": s["seq_source"][:keep]}
        for k in ("aux_hidden_states", "hidden_states", "topk_ids", "topk_probs"):
            part[k] = s[k][:p].contiguous()
        path = shard_path(out, i)
        save_file({k: v.contiguous() for k, v in part.items()}, str(path),
                  metadata={**meta, "positions": str(p), "sequences": str(keep)})
    if got["supervised"] < supervised:
        raise ValueError(f"{out.name}: only {got['supervised']} supervised positions in {len(files)} shards, "
                         f"{supervised} asked")
    (out / "take.json").write_text(json.dumps(got))
    return got


def supervised_in(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), "pt") as s:
            total += int(s.get_tensor("loss_mask").sum())
    return total


# --- the runs -----------------------------------------------------------------------------------------------

def evaluate_on(run_dir: Path, model_dir: Path, files: list[Path], windows_max: int = 512) -> dict:
    """A finished run's drafter scored on the held-out shards `files` (all their windows up to windows_max)."""
    from dataclasses import replace

    import torch

    from .eagle3_train import TrainConfig, score

    cfg = TrainConfig(**torch.load(run_dir / "ckpt.pt", weights_only=False)["config"])
    return score(run_dir, model_dir, files, replace(cfg, eval_windows=windows_max))


def markdown(result: dict) -> str:
    lines = [f"Equal supervised positions per arm: {result['supervised']:,} (one pass each; EAGLE-3, "
             f"{result['config']['steps']} training-time-test levels, the same draft vocabulary of "
             f"{result['draft_vocab']} tokens, seed {result['config']['seed']}).", "",
             "| data | positions (supervised) | held-out fixed text: agreement d1 / d2 / d3 | "
             "held-out own responses: agreement d1 / d2 / d3 | training time |", "|---|---|---|---|---|"]
    for arm in ARMS:
        r = result["arms"][arm]
        f = " / ".join(f"{a:.3f}" for a in r["held_fixed"]["agreement"])
        s = " / ".join(f"{a:.3f}" for a in r["held_self"]["agreement"])
        lines.append(f"| {arm} | {r['positions']:,} ({r['supervised']:,}) | {f} | {s} | {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import torch

    from ..model.prepare import cache_root, resolve_model
    from .eagle3_train import TrainConfig, draft_vocabulary, shard_files, train

    if args.threads:
        torch.set_num_threads(args.threads)
    fixed = Path(args.fixed)
    recipe = json.loads((fixed / "recipe.json").read_text())
    model_dir = resolve_model(args.model or recipe["model"], log=lambda m: print(m, file=sys.stderr))
    home = Path(args.out or cache_root() / "ablation" / args.name)
    home.mkdir(parents=True, exist_ok=True)
    log = _Log(home / "ablation.log")
    t_all = time.time()
    fixed_files = shard_files(fixed)
    fixed_held = fixed_files[-1:]
    wheels = Path(args.wheels or cache_root() / "wheels")
    # 1. the target's own responses: training prompts, and held-out prompts none of them repeat
    self_files = own_responses(model_dir, home, fixed, args.prompts, args.held_prompts, args.batch_size,
                               args.max_new_tokens, args.max_prompt_tokens, args.threads, wheels, log)
    # 2. equal supervised positions per arm
    budget = args.positions or supervised_in(self_files["self-train"])
    log(f"{budget} supervised positions per arm")
    halves = {"fixed": [(fixed_files[:-1], budget)], "self-distilled": [(self_files["self-train"], budget)],
              "mix": [(fixed_files[:-1], budget // 2), (self_files["self-train"], budget - budget // 2)]}
    data = {}
    for arm in ARMS:
        d = home / f"data-{arm}"
        if not (d / "done.json").exists():
            counts = {"supervised": 0, "positions": 0, "sequences": 0}
            for k, (files, n) in enumerate(halves[arm]):
                got = take(files, n, d / f"part{k}", {"arm": arm})
                for key in counts:
                    counts[key] += got[key]
            for k in range(len(halves[arm])):  # one folder of shards: part0's, then part1's
                for f in sorted((d / f"part{k}").glob("shard-*.safetensors")):
                    f.rename(d / f"shard-{k}{f.name[len('shard-'):]}")
            (d / "recipe.json").write_text(json.dumps({**recipe, "arm": arm}))
            (d / "done.json").write_text(json.dumps(counts))
        data[arm] = json.loads((d / "done.json").read_text())
    # 3. one vocabulary for all arms (the full fixed set's), the same configuration, one pass each
    vocab = draft_vocabulary(fixed_files[:-1], args.draft_vocab,
                             json.loads((model_dir / "config.json").read_text())["vocab_size"])
    cfg = TrainConfig(minutes=1e6, positions=0, draft_vocab=args.draft_vocab, seed=0,
                      intermediate_size=args.intermediate_size)
    result = {"name": args.name, "fixed": str(fixed), "supervised": budget, "config": asdict(cfg),
              "draft_vocab": int(len(vocab)), "arms": {}}
    for arm in ARMS:
        run_dir = home / f"run-{arm}"
        if not (run_dir / "summary.json").exists():
            log(f"training {arm} ({data[arm]['supervised']} supervised of {data[arm]['positions']} positions)")
            train(home / f"data-{arm}", model_dir, run_dir, cfg, args.threads, echo=False, held_out=fixed_held,
                  draft_ids=vocab)
        summary = json.loads((run_dir / "summary.json").read_text())
        held_fixed = evaluate_on(run_dir, model_dir, fixed_held)
        held_self = evaluate_on(run_dir, model_dir, self_files["self-held"])
        result["arms"][arm] = {**data[arm], "seconds": summary["seconds"], "held_fixed": held_fixed,
                               "held_self": held_self}
        log(f"{arm}: held-out fixed {held_fixed['agreement']}, own responses {held_self['agreement']}")
    result["seconds"] = round(time.time() - t_all, 1)
    (home / "ablation.json").write_text(json.dumps(result, indent=1))
    (home / "ablation.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixed", type=Path, required=True, help="a fixed-data set's folder (entmtp distill fixed-data)")
    p.add_argument("--model", default=None, help="the target (default: the fixed set's)")
    p.add_argument("--name", default="smollm2", help="$ENTMTP_CACHE/ablation/<name>/ (resumed if present)")
    p.add_argument("--out", type=Path, default=None, help="the ablation's folder instead")
    p.add_argument("--positions", type=int, default=0,
                   help="supervised positions per arm (default: all the self-distilled training responses)")
    p.add_argument("--prompts", type=int, default=1600, help="self-distilled training prompts (default: 1600)")
    p.add_argument("--held-prompts", type=int, default=160, help="held-out prompts (default: 160)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=112)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--intermediate-size", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--wheels", type=Path, default=None, help="the data wheels' cache (default: $ENTMTP_CACHE/wheels)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
