"""Forced spans in the reference engine: JSON under held-out schemas with and without jump-forward drafting.

    .venv/bin/python bench/experiments/forced_spans.py                      # SmolLM2 + EAGLE, 4 schemas, 96 new tokens
    .venv/bin/python bench/experiments/forced_spans.py --model entmtp-tiny --drafter hydra --schemas 2

After one untimed warm-up, per prompt, greedy, batch 1, in each repeat and in this order: plain decoding under
the grammar, the policy without forced spans, the policy with the grammar's spans alone (no lookup spans), the
policy with them all but each of the grammar's texts ending in its last token as the tokenizer spells it alone
(`join_ends` off), and the policy with them all (`engine/forced.py`: the grammar's text, its last token the one the
model writes there joined to what follows, `forced_spans.SpanEnds`, and the request's own text repeating where the
grammar decides nothing). Every output must equal plain's (asserted).
Reports tokens/s (median over repeats of total tokens / total seconds), tokens per target pass, and for the
last run (lookup spans included) the share of output tokens that came from forced spans, their acceptance (per
token, from the first token of each span reached) and mean span length. Writes <out>.jsonl (one row per mode, with the
configuration and commit) and <out>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path

from entmtp_sglang.bench.workload import tool_calls
from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.forced import ForcedSpanConfig, ForcedSpans, ForcedStats
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.grammar import GrammarSpec, RequestGrammar, compile_grammar
from entmtp_sglang.model.load import load_bundle
from entmtp_sglang.policy.policies import entmtp_policy
from entmtp_sglang.tasks import load_prompts, load_schema
from entmtp_sglang.tree import Tree
from entmtp_sglang.tree.treeset import load_tree_set

ROOT = Path(__file__).resolve().parents[2]
TREE_SET = {"smollm2": "smollm2-135m-instruct", "entmtp-tiny": "entmtp-tiny"}


def schema_items(bundle, limit: int, compact: bool, workload: str = "json"):
    """(item with "id" and "ids" (the prompt), compiled grammar): the json task's held-out prompts under their
    schemas, or the tool calls of bench/workloads/tool_calls.json under the call's schema (as sglang_speed.py
    builds them)."""
    from entmtp_sglang.grammar import GrammarError
    from entmtp_sglang.tasks import render_messages

    vocab = bundle.target.shape.vocab_size
    compile_ = lambda schema: compile_grammar(GrammarSpec("json_schema", json.dumps(schema), compact=compact),  # noqa: E731
                                              str(bundle.path), vocab)
    out = []
    if workload == "tool-call":
        for k, call in enumerate(tool_calls(ROOT / "bench" / "workloads" / "tool_calls.json", limit)):
            messages = [{"role": "system", "content": call.system}, {"role": "user", "content": call.user}]
            text = (render_messages(bundle.chat_template, messages) if bundle.chat_template
                    else call.system + call.user)
            out.append(({"id": f"tool-{k}", "ids": bundle.tokenizer.encode(text).ids}, compile_(call.schema)))
        return out
    for item in load_prompts("json", "test"):
        try:
            compiled = compile_(load_schema(item))
        except GrammarError:
            continue
        out.append(({"id": item["id"], "ids": bundle.prompt_ids(item)}, compiled))
        if len(out) >= limit:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(TREE_SET))
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--workload", default="json", choices=["json", "tool-call"])
    ap.add_argument("--schemas", type=int, default=4, help="prompts (each under its schema)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-span", type=int, default=16, help="forced tokens per span (ForcedSpanConfig.max_tokens)")
    ap.add_argument("--max-nodes", type=int, default=48, help="forced nodes per tree and step (max_nodes)")
    ap.add_argument("--min-reach", type=float, default=ForcedSpanConfig.min_reach,
                    help="no span below a leaf the drafter gives less than this probability of being reached")
    ap.add_argument("--tree", default="", help="a static tree (e.g. chain:2) instead of the EntMTP policy")
    ap.add_argument("--free-whitespace", action="store_true", help="JSON with free whitespace (not compact)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "forced_spans")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    b = load_bundle(None if args.model == "entmtp-tiny" else Path(args.model), drafter=args.drafter)
    vocab = b.target.shape.vocab_size
    engine = Engine(b.target, args.drafter, b.drafter, b.eos_token_id)
    items = schema_items(b, args.schemas, compact=not args.free_whitespace, workload=args.workload)
    if args.tree:
        make_chooser = lambda: static_chooser(Tree.parse(args.tree))  # noqa: E731
    else:
        ts = load_tree_set(ROOT / "trees" / f"{TREE_SET[args.model]}-{args.drafter}-json-grammar.json",
                           drafter=args.drafter)
        make_chooser = lambda: entmtp_policy(ts)  # noqa: E731
    config = ForcedSpanConfig(max_tokens=args.max_span, max_nodes=max(args.max_nodes, args.max_span),
                              min_reach=args.min_reach)
    modes = ("plain", "policy", "policy + grammar spans", "policy + forced spans, spelled ends",
             "policy + forced spans")
    no_lookup = dataclasses.replace(config, lookup=False)
    spelled = dataclasses.replace(config, join_ends=False)
    seconds = {m: [] for m in modes}
    tokens = {m: 0 for m in modes}
    passes = {m: 0 for m in modes}
    forced_total = ForcedStats()
    plain_out: dict[str, list[int]] = {}
    item, compiled = items[0]  # warm-up (grammar compilation, kernels, caches), not timed
    generate_plain(b.target, item["ids"], 8, grammar=RequestGrammar(compiled, vocab))
    for spans in (None, *(ForcedSpans.for_tokenizer(b.tokenizer, c) for c in (no_lookup, spelled, config))):
        engine.generate([item["ids"]], 8, make_chooser(), grammars=[RequestGrammar(compiled, vocab)],
                        forced_spans=spans)
    for rep in range(args.repeats):
        spent = {m: 0.0 for m in modes}
        forced = ForcedSpans.for_tokenizer(b.tokenizer, config)  # a fresh calibration per repeat
        grammar_only = ForcedSpans.for_tokenizer(b.tokenizer, no_lookup)
        spelled_ends = ForcedSpans.for_tokenizer(b.tokenizer, spelled)
        for item, compiled in items:
            prompt = item["ids"]
            t0 = time.perf_counter()
            ref = generate_plain(b.target, prompt, args.max_new_tokens, eos_token_id=b.eos_token_id,
                                 grammar=RequestGrammar(compiled, vocab))
            spent["plain"] += time.perf_counter() - t0
            plain_out[item["id"]] = ref
            for mode, spans in (("policy", None), ("policy + grammar spans", grammar_only),
                                ("policy + forced spans, spelled ends", spelled_ends),
                                ("policy + forced spans", forced)):
                t0 = time.perf_counter()
                r = engine.generate([prompt], args.max_new_tokens, make_chooser(),
                                    grammars=[RequestGrammar(compiled, vocab)], forced_spans=spans)[0]
                spent[mode] += time.perf_counter() - t0
                assert r.output_ids == ref, f"{mode}: output differs from plain on {item['id']}"
                if rep == 0:
                    tokens[mode] += len(r.output_ids)
                    passes[mode] += 1 + len(r.steps)
                    if spans is forced:
                        forced_total.add(r.forced)
            if rep == 0:
                tokens["plain"] += len(ref)
                passes["plain"] += len(ref)
        for m in modes:
            seconds[m].append(spent[m])
        print(f"repeat {rep}: " + ", ".join(f"{m} {tokens[m] / spent[m]:.1f} tok/s" for m in modes), flush=True)
    tps = {m: statistics.median(tokens[m] / s for s in seconds[m]) for m in modes}
    common = {"model": args.model, "drafter": args.drafter, "workload": args.workload, "chooser": args.tree or "entmtp",
              "schemas": len(items), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "layout": "free whitespace" if args.free_whitespace else "compact", "max_span": args.max_span,
              "max_nodes": config.max_nodes, "min_reach": config.min_reach,
              "commit": commit}
    rows = []
    for m in modes:
        row = {**common, "mode": m, "tokens_per_s": round(tps[m], 2), "ratio_to_plain": round(tps[m] / tps["plain"], 3),
               "tokens_per_pass": round(tokens[m] / passes[m], 3), "outputs_equal_plain": True,
               "seconds": [round(s, 3) for s in seconds[m]]}
        if m == "policy + forced spans":
            row["forced"] = forced_total.to_json(tokens[m])
            row["ratio_to_grammar_spans"] = round(tps[m] / tps["policy + grammar spans"], 3)
            row["ratio_to_policy"] = round(tps[m] / tps["policy"], 3)
        rows.append(row)
    f = forced_total.to_json(tokens["policy + forced spans"])
    table = ["| mode | tok/s | vs plain | tokens per pass |", "|---|---|---|---|"]
    table += [f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['ratio_to_plain']:.2f}x | {r['tokens_per_pass']:.2f} |"
              for r in rows]
    table += ["", f"Forced spans: {f['share_of_output']:.0%} of the output, acceptance {f['acceptance']} per token, "
              f"mean span {f['mean_span']:.1f} tokens ({f['spans']} spans drafted, {f['spans_reached']} reached). "
              f"{args.model} + {args.drafter}, {common['chooser']}, {args.workload}: {len(items)} prompts under their "
              f"schemas ({common['layout']} JSON), {args.max_new_tokens} new tokens, greedy, batch 1, median of "
              f"{args.repeats} repeats; every output equal to plain decoding's. Commit {commit}."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
