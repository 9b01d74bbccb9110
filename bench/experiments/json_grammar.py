"""Structured output benchmark: JSON documents under held-out real schemas, greedy, batch 1.

    .venv/bin/python bench/experiments/json_grammar.py     # writes bench/results/json_grammar.{jsonl,md}

Modes, all on the same prompts and measured side by side (median over repeats):
  (a) static tree, grammar applied only at verification (what SGLang does)
  (b) static tree with grammar-aware drafting (drafts masked, illegal branches pruned)
  (c) grammar-aware drafting plus EntMTP on the grammar-masked entropy (json-grammar tree set)
Also reported: target entropy unmasked vs masked at the generated JSON positions, and the fraction of
forced positions (exactly one legal token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import jsonschema
import torch

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.grammar import GrammarError, GrammarSpec, RequestGrammar, compile_grammar
from entmtp_sglang.model.load import load_bundle
from entmtp_sglang.policy.policies import EntMTPPolicy
from entmtp_sglang.policy.signals import entropy_nats
from entmtp_sglang.tasks import load_prompts, load_schema
from entmtp_sglang.tree import from_sglang
from entmtp_sglang.tree.treeset import load_tree_set

ROOT = Path(__file__).resolve().parents[2]
STATIC = from_sglang(2, 5, 12)


def schemas(bundle, limit: int):
    out = []
    for item in load_prompts("json", "test"):
        schema = load_schema(item)
        try:
            compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(schema)), str(bundle.path), 4096)
        except GrammarError:
            continue
        out.append((item, schema, compiled))
        if len(out) >= limit:
            break
    return out


@torch.no_grad()
def entropy_report(bundle, prompt: list[int], output: list[int], compiled) -> tuple[list[float], list[float], int]:
    """Target entropy unmasked and masked at each generated position, and the count of forced ones."""
    ids = torch.tensor([prompt + output])
    logits = bundle.target.logits(bundle.target(ids))[0, len(prompt) - 1:-1]  # predicts each output token
    g = RequestGrammar(compiled, 4096)
    raw, masked, forced = [], [], 0
    for pos, tok in enumerate(output):
        m = g.root_mask()
        raw.append(float(entropy_nats(logits[pos])))
        masked.append(float(entropy_nats(logits[pos].masked_fill(~m, float("-inf")))))
        forced += int(m.sum()) == 1
        if not g.advance([tok]) or g.terminated:
            break
    return raw, masked, forced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", nargs="+", default=["hydra"])
    ap.add_argument("--schemas", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "json_grammar")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows, lines = [], []
    for drafter in args.drafters:
        b = load_bundle(drafter=drafter)
        engine = Engine(b.target, drafter, b.drafter, b.eos_token_id)
        items = schemas(b, args.schemas)
        ts = load_tree_set(ROOT / "trees" / f"entmtp-tiny-{drafter}-json-grammar.json", drafter=drafter)
        modes = {
            "a: static, grammar at verify only": (lambda: static_chooser(STATIC), False),
            "b: static, grammar-aware drafting": (lambda: static_chooser(STATIC), True),
            "c: grammar-aware drafting + EntMTP": (lambda: EntMTPPolicy(ts), True),
        }
        runs: dict[str, list] = {m: [] for m in modes}
        valid = {m: 0 for m in modes}
        outputs = {}
        for rep in range(args.repeats):
            for mode, (make, drafting) in modes.items():
                tokens, seconds, steps, acc = 0, 0.0, 0, 0
                for item, schema, compiled in items:
                    prompt = b.prompt_ids(item)
                    t0 = time.perf_counter()
                    r = engine.generate([prompt], args.max_new_tokens, make(),
                                        grammars=[RequestGrammar(compiled, 4096)], grammar_drafting=drafting)[0]
                    seconds += time.perf_counter() - t0
                    tokens += len(r.output_ids)
                    steps += len(r.steps)
                    acc += sum(s.accepted for s in r.steps)
                    if rep == 0:
                        prev = outputs.setdefault(item["id"], r.output_ids)
                        assert prev == r.output_ids, f"{mode}: output differs on {item['id']}"
                        if r.finish_reason == "grammar_complete":  # ends with the stop token (eos)
                            jsonschema.validate(json.loads(b.tokenizer.decode(r.output_ids[:-1])), schema)
                            valid[mode] += 1
                runs[mode].append((tokens / seconds, acc / max(1, steps)))
        raw_all, masked_all, forced, total = [], [], 0, 0
        for item, schema, compiled in items:
            prompt = b.prompt_ids(item)
            raw, masked, f = entropy_report(b, prompt, outputs[item["id"]], compiled)
            raw_all += raw
            masked_all += masked
            forced += f
            total += len(raw)
        med = {m: (statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)) for m, rs in runs.items()}
        a = med["a: static, grammar at verify only"][0]
        for mode, (tps, acc) in med.items():
            rows.append({"drafter": drafter, "mode": mode, "tokens_per_s": tps, "mean_accepted": acc,
                         "ratio_to_a": tps / a, "complete_and_valid": valid[mode], "schemas": len(items),
                         "repeats": [round(x[0], 2) for x in runs[mode]], "static_tree": STATIC.name,
                         "commit": commit})
        lines.append(f"| {drafter} | " + " | ".join(f"{med[m][0]:.1f} ({med[m][1]:.2f})" for m in modes)
                     + f" | {med['c: grammar-aware drafting + EntMTP'][0] / a:.2f}x | "
                     f"{statistics.fmean(raw_all):.2f} | {statistics.fmean(masked_all):.2f} | "
                     f"{forced / max(1, total):.0%} |")
        print(lines[-1], flush=True)
    table = ["| drafter | (a) verify-only grammar | (b) grammar-aware drafting | (c) + EntMTP | (c)/(a) | "
             "entropy unmasked | entropy masked | forced positions |", "|---|---|---|---|---|---|---|---|"]
    table += lines
    table += ["", f"Cells: tokens/s (mean accepted drafts per step), median of {args.repeats} repeats over "
              f"{args.schemas} held-out schemas, {args.max_new_tokens} new tokens, greedy, batch 1. Static tree "
              f"{STATIC.name}. Entropy in nats over the generated positions."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
