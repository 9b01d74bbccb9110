"""`entmtp` command line: generate text with tree speculation on the bundled (or any Llama) model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .drafting import drafter_names
from .policy.registry import CLI_POLICIES, POLICIES, policy_help

GENERATE_EPILOG_TEMPLATE = """\
trees:
  chain:N          a chain of N drafted tokens after the root (chain:0 = plain decoding)
  -1,0,0,1         a parent array: node 0 is the root, each later node names its parent
                   (write --tree=-1,0,0,1: argparse reads a value starting with '-' as a flag)
  NAME             with --tree-set: one tree of the set, by its name (static)
  --tree-set TASK  the EntMTP policy over the tree set shipped for this model, drafter and task
  --tree-set FILE  ... or over a tree-set file (trees/*.json)
policies (--policy):
{policies}
models:
  --model smollm2  SmolLM2-135M-Instruct, converted on first use (entmtp model prepare smollm2); its
                   prompts go through its chat template (--raw-prompt feeds them as they are)
examples:
  entmtp generate --model smollm2 --drafter eagle --tree-set code --prompt 'Write a Python function ...'
  entmtp generate --model smollm2 --drafter eagle --tree-set json-grammar --json-schema person.json \\
      --prompt 'Write a JSON object describing a person.'
  entmtp generate --prompt 'def fibonacci(n):' --drafter medusa --tree chain:4
  entmtp generate --model smollm2 --drafter hydra --tree-set math --policy entmtp-paper --prompt 'What is 12*7?'
  entmtp generate --prompt 'User: Tell me a story.\\nAssistant: ' --drafter eagle --tree=-1,0,0,1,1,2
"""
GENERATE_EPILOG = GENERATE_EPILOG_TEMPLATE.replace("{policies}", policy_help())


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text with tree speculative decoding",
        description="Generate text with tree speculative decoding and print a stats line.",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True,
                   help="input text; repeat the flag for a batch of prompts")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory in Hugging Face layout, or smollm2 (default: smollm2, SmolLM2-135M-Instruct, "
                        "prepared on first use)")
    p.add_argument("--drafter", choices=drafter_names(), default="medusa",
                   help="which multi-token-prediction drafter proposes tokens (default: medusa)")
    p.add_argument("--tree", default=None,
                   help="draft tree: chain:N, a comma-separated parent array, or (with --tree-set) the name of "
                        "one of the set's trees (default: chain:4)")
    p.add_argument("--tree-set", default=None, metavar="TASK|FILE",
                   help="run an EntMTP policy over a tree set instead of one --tree: a task name (code, math, "
                        "chat, prose, json, json-grammar, mixed) picks the set shipped for this model and "
                        "drafter, or give a tree-set JSON file")
    p.add_argument("--policy", choices=CLI_POLICIES, default=None,
                   help="how each step's tree is chosen (default: entmtp with --tree-set, else static); see "
                        "'policies' below")
    p.add_argument("--keep", type=int, default=8,
                   help="eagle2: nodes verified per step, root included (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples with exact rejection-sampling verification")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k best tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--raw-prompt", action="store_true",
                   help="feed --prompt as it is; by default a model with a chat template (SmolLM2) gets it as "
                        "one user turn through the template")
    p.add_argument("--no-speculation", action="store_true",
                   help="plain one-token-per-pass decoding, for comparison")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=Path, metavar="FILE",
                   help="constrain the output to JSON valid under this JSON Schema (xgrammar)")
    g.add_argument("--json", action="store_true", help="constrain the output to any JSON value")
    g.add_argument("--regex", help="constrain the output to match this regular expression")
    g.add_argument("--ebnf", type=Path, metavar="FILE", help="constrain the output to this EBNF grammar")
    p.add_argument("--any-whitespace", action="store_true",
                   help="JSON: allow any whitespace (default: compact layout, which keeps small models "
                        "out of runs of newlines)")
    p.add_argument("--grammar-at-verify-only", action="store_true",
                   help="apply the grammar only when verifying (SGLang's behaviour); by default drafts "
                        "are masked too and illegal branches pruned")
    p.add_argument("--forced-spans", action="store_true",
                   help="draft below the tree's leaves, without running the drafter, the text a grammar decides "
                        "(its jump-forward string as the tokenizer spells it) and, where it decides nothing or "
                        "there is no grammar, the request's own text repeating (lookup spans, as ENTMTP inside "
                        "SGLang); verified like any draft, so the output is unchanged")
    p.add_argument("--max-span", type=int, default=16, metavar="N",
                   help="with --forced-spans: forced tokens per span at most (default: 16)")


def _generate(args) -> int:
    import torch

    from .engine.engine import Engine, RequestError
    from .engine.sampling import SamplingParams
    from .model.load import load_bundle
    from .tree import TreeError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .model.load import ModelDirError
    from .model.prepare import PrepareError

    model = args.model
    if model is None:
        from .model.prepare import DEFAULT_GENERATE_MODEL, model_spec

        model = DEFAULT_GENERATE_MODEL
        print(f"entmtp generate: no --model given, using {model_spec(model).name} (--model {model}); --model DIR "
              "runs another", file=sys.stderr)
    try:
        bundle = load_bundle(model, args.drafter)
    except (ModelDirError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [bundle.text_ids(p, chat=not args.raw_prompt) for p in args.prompt]
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    try:
        chooser, tree_name = _chooser(args, bundle)
    except (ValueError, TreeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    observer = getattr(chooser, "observe", None)
    try:
        grammars = _grammars(args, bundle, len(prompts))
        forced = None
        if args.forced_spans:
            from .engine.forced import ForcedSpanConfig, ForcedSpans

            config = ForcedSpanConfig(max_tokens=args.max_span, max_nodes=max(ForcedSpanConfig.max_nodes,
                                                                              args.max_span))
            forced = ForcedSpans.for_tokenizer(bundle.tokenizer, config)
        t0 = time.perf_counter()
        results = engine.generate(prompts, args.max_new_tokens, chooser, sampling, args.seed, observer=observer,
                                  grammars=grammars, grammar_drafting=not args.grammar_at_verify_only,
                                  forced_spans=forced)
        seconds = time.perf_counter() - t0
    except (RequestError, TreeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, r in zip(args.prompt, results):
        out = [t for t in r.output_ids if t != bundle.eos_token_id]
        reply = bundle.tokenizer.decode(out)
        print(f"> {text}\n{reply}" if bundle.chat_template and not args.raw_prompt else text + reply)
        print(f"-- finish: {r.finish_reason}")
    tokens = sum(len(r.output_ids) for r in results)
    passes = sum(1 + len(r.steps) for r in results) / len(results)
    steps = [s for r in results for s in r.steps]
    mean_acc = sum(s.accepted for s in steps) / max(1, len(steps))
    print(f"[stats] drafter={args.drafter} tree={tree_name} batch={len(results)} tokens={tokens} "
          f"time={seconds:.2f}s tokens/s={tokens / seconds:.1f} mean_accepted={mean_acc:.2f} "
          f"tokens_per_target_pass={tokens / len(results) / passes:.2f} "
          f"steps_without_drafter={sum(s.rested for s in steps)}/{len(steps)}")
    if forced is not None:
        stats = [r.forced for r in results if r.forced is not None]
        kept = sum(st.output_tokens for st in stats)
        tried, accepted = sum(st.tried for st in stats), sum(st.accepted for st in stats)
        print(f"[forced] spans={sum(st.spans for st in stats)} forced_tokens_in_output={kept} "
              f"share_of_output={kept / max(1, tokens):.2f} "
              f"acceptance={accepted / tried if tried else float('nan'):.2f}")
    return 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="build a task's tree set from calibration prompts",
        description="Decode a task's calibration prompts, record drafter acceptance by signal bin (draft entropy "
                    "or margin, or a target-entropy window: the best predictor), "
                    "measure verification cost on this machine, and write a tree set of Pareto-optimal "
                    "trees (JSON) with a Pareto-frontier plot (PNG).")
    p.add_argument("--engine", choices=("reference", "sglang"), default="reference",
                   help="reference (default): decode with this package's engine and its model layout (--model, "
                        "--drafter); sglang: start sglang.launch_server with ENTMTP in recording mode on the "
                        "model and drafter you serve (--model-path, --speculative-draft-model-path) and build "
                        "the set from what its verification records and its timed steps")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: bundled entmtp-tiny)")
    p.add_argument("--drafter", choices=drafter_names(), default=None,
                   help="the reference engine's drafter (required with --engine reference)")
    p.add_argument("--task", default=None,
                   help="code, math, chat, prose, json, json-grammar (json under each prompt's schema, as "
                        "--grammar) or mixed; a comma-separated list runs several "
                        "(costs are measured once per tree shape). With --engine sglang: the prompts' task, or "
                        "a label for --prompt-file (default: custom)")
    g = p.add_argument_group("with --engine sglang")
    g.add_argument("--model-path", type=Path, default=None, help="the served model's directory (as sglang's)")
    g.add_argument("--speculative-draft-model-path", type=Path, default=None, help="the drafter's directory")
    g.add_argument("--speculative-algorithm", default="EAGLE", choices=("EAGLE", "EAGLE3", "NEXTN"),
                   help="what kind of drafter it is (default: EAGLE)")
    g.add_argument("--prompt-file", type=Path, default=None,
                   help="JSONL prompts: a string, {\"prompt\"|\"text\": ...} or {\"messages\": [...]} per line "
                        "(default: the --task's shipped calibration prompts)")
    g.add_argument("--device", default="cpu", help="sglang --device (default: cpu)")
    g.add_argument("--attention-backend", default=None,
                   help="sglang --attention-backend (default: entmtp_torch on CPU)")
    g.add_argument("--dtype", default="float32", help="sglang --dtype (default: float32)")
    g.add_argument("--batch-sizes", default="1,8", help="batch sizes to time trees at (default: 1,8)")
    g.add_argument("--concurrency", type=int, default=8, help="requests decoded at once (default: 8)")
    g.add_argument("--sglang-arg", action="append", default=[], metavar="ARG",
                   help="another sglang.launch_server argument, repeatable (e.g. --sglang-arg=--tp-size=2)")
    p.add_argument("--prompts", type=int, default=24, help="calibration prompts to decode (default: 24)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default: 96)")
    p.add_argument("--bins", type=int, default=4, help="signal bins (default: 4)")
    p.add_argument("--grammar", action="store_true",
                   help="json task only: decode under each prompt's JSON schema (xgrammar) and calibrate on "
                        "grammar-masked entropy and ranks; writes ...-json-grammar.json")
    p.add_argument("--out", type=Path, default=None,
                   help="output JSON (default: trees/<model>-<drafter>-<task>.json in the repository; with "
                        "--engine sglang: <model>-<eagle or eagle3, the draft's kind>-<task>-sglang.json here, "
                        "the name ENTMTP serves first when it is in trees/)")
    p.add_argument("--from-records", action="store_true",
                   help="reuse the acceptance records saved next to the output (...records.jsonl; else those of "
                        "the default output) instead of decoding again; only the step costs are measured anew")
    p.add_argument("--records-only", action="store_true",
                   help="decode and save the acceptance records (...records.jsonl, with per-depth draft "
                        "probabilities) and refit the existing tree set's per-node acceptance predictor from them; "
                        "its trees, bins and costs stay as they are")
    p.add_argument("--cost-table", type=Path, default=None, metavar="FILE",
                   help="take step costs from a measured cost table (bench/gpu_costs.py's JSON, e.g. from the "
                        "GPU check) instead of timing this machine; default output "
                        "trees/<model>-<drafter>-<task>-<device>.json")
    p.add_argument("--cost-model", default=None, metavar="NAME",
                   help="with --cost-table: the table's model to cost (default: the one with this model's shape)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")


def _calibrate(args) -> int:
    if args.engine == "sglang":
        return _calibrate_sglang(args)
    if args.drafter is None or args.task is None:
        print("error: --engine reference needs --drafter and --task", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    from .calibrate.build import build_tree_set, plot_pareto
    from .calibrate.records import CalibrationConfig, load_records, record_positions, records_file, save_records
    from .model.load import load_bundle
    from .tasks import TASKS, interleave, load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.model, args.drafter)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    for task in tasks:
        if task not in ("mixed", "json-grammar") and task not in TASKS:
            print(f"error: unknown task {task!r}; choose from {', '.join(TASKS)}, mixed", file=sys.stderr)
            return 2
    if args.out and len(tasks) > 1:
        print("error: --out needs a single --task", file=sys.stderr)
        return 2
    models = cost_source = None
    if args.cost_table:
        from .calibrate.cost_table import CostTableError, load_cost_table, step_cost_models_from_table
        from .calibrate.costs import COST_BATCHES

        try:
            table = load_cost_table(args.cost_table)
            depth = min(CalibrationConfig.max_depth, getattr(bundle.drafter, "max_depth", 64))
            models, cost_source = step_cost_models_from_table(table, bundle.target.shape, args.drafter, COST_BATCHES,
                                                              depth, args.cost_model, log=tqdm.write)
        except CostTableError as e:
            print(f"error: --cost-table: {e}", file=sys.stderr)
            return 2
    elif args.cost_model:
        print("error: --cost-model needs --cost-table", file=sys.stderr)
        return 2
    if args.records_only and args.from_records:
        print("error: --records-only decodes; it cannot be combined with --from-records", file=sys.stderr)
        return 2
    for task in tasks:
        cfg = CalibrationConfig(args.drafter, task, args.prompts, args.max_new_tokens, num_bins=args.bins)
        if task == "mixed":
            items = interleave(("prose", "json", "code"), "calib", args.prompts // 3 + 1)[: args.prompts]
        else:
            items = load_prompts("json" if task == "json-grammar" else task, "calib", args.prompts)
        room = bundle.target.shape.max_position_embeddings - args.max_new_tokens - 40
        prompts = [bundle.prompt_ids(it, room) for it in items]
        make_grammars = None
        if args.grammar or task == "json-grammar":
            if task not in ("json", "json-grammar"):
                print("error: --grammar applies to the json task only", file=sys.stderr)
                return 2
            items, make_grammars = _schema_grammars(items, bundle)
            prompts = [bundle.prompt_ids(it, room) for it in items]
            cfg = CalibrationConfig(args.drafter, "json-grammar", len(prompts), args.max_new_tokens,
                                    num_bins=args.bins)
        default_out = Path("trees") / f"{bundle.path.name}-{args.drafter}-{cfg.task}.json"
        if cost_source and not args.out:
            import re

            device = re.sub(r"[^a-z0-9]+", "-", cost_source["device"].lower()).strip("-")
            default_out = default_out.with_name(f"{default_out.stem}-{device}.json")
        out = args.out or default_out
        if args.from_records:
            shipped = Path("trees") / f"{bundle.path.name}-{args.drafter}-{cfg.task}.records.jsonl"
            found = [records_file(p) for p in (out.with_suffix(".records.jsonl"),
                                               default_out.with_suffix(".records.jsonl"), shipped)
                     if records_file(p).exists()]
            try:
                records = load_records(found[0] if found else out.with_suffix(".records.jsonl"))
            except OSError as e:
                print(f"error: --from-records: {e}", file=sys.stderr)
                return 2
        else:
            with tqdm(total=len(prompts), desc=f"calibrate {args.drafter}/{cfg.task}", unit="prompt") as bar:
                records = record_positions(bundle, prompts, cfg, bar, make_grammars)
        if args.records_only:
            out.parent.mkdir(parents=True, exist_ok=True)
            save_records(records, out.with_suffix(".records.jsonl"))
            print(f"wrote {out.with_suffix('.records.jsonl')} ({len(records)} positions)", flush=True)
            if out.exists():
                import dataclasses

                from .tree.acceptance import fit_predictor
                from .tree.treeset import load_tree_set

                ts = load_tree_set(out)
                fitted = fit_predictor(records, ts.max_depth or None, cfg.max_rank)
                dataclasses.replace(ts, predictor=fitted.to_json()).save(out)
                print(f"refitted the acceptance predictor of {out} on {fitted.positions} positions", flush=True)
            continue
        ts, points = build_tree_set(bundle, records, prompts, cfg, log=tqdm.write, models=models,
                                    cost_source=cost_source)
        out.parent.mkdir(parents=True, exist_ok=True)
        ts.save(out)
        plot_pareto(points, ts, out.with_suffix(".png"))
        save_records(records, out.with_suffix(".records.jsonl"))
        print(f"wrote {out} ({len(ts.trees)} trees, signal {ts.signal}, bins "
              f"{[round(e, 3) for e in ts.bin_edges]}) and {out.with_suffix('.png')}", flush=True)
    return 0


def _calibrate_sglang(args) -> int:
    from tqdm import tqdm

    from .calibrate.through_sglang import SGLangCalibration, load_prompt_items, run

    if args.model_path is None or args.speculative_draft_model_path is None:
        print("error: --engine sglang needs --model-path and --speculative-draft-model-path", file=sys.stderr)
        return 2
    task = args.task or ("custom" if args.prompt_file else "mixed")
    try:
        sizes = tuple(sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()}))
        cal = SGLangCalibration(args.model_path, args.speculative_draft_model_path, args.speculative_algorithm,
                                args.device, args.attention_backend, args.dtype, args.max_new_tokens, sizes,
                                args.concurrency, bins=args.bins, task=task, extra_args=tuple(args.sglang_arg))
        items = load_prompt_items(str(args.prompt_file) if args.prompt_file else task, args.prompts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or Path(f"{cal.model_name}-{cal.drafter_kind}-{task}-sglang.json")   # the shipped name
    with tqdm(total=len(items), desc=f"calibrate {cal.model_name} through SGLang", unit="prompt") as bar:
        try:
            ts = run(cal, items, out, log=tqdm.write, progress=bar)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"wrote {out} ({len(ts.trees)} trees: {', '.join(e.tree.name for e in ts.trees)}; signal {ts.signal}) "
          f"and {out.with_suffix('.png')}\nserve it: ENTMTP_TREE_SET={out} python -m sglang.launch_server "
          f"--model-path {cal.model_path} --speculative-algorithm ENTMTP --speculative-draft-model-path "
          f"{cal.draft_path} ...", flush=True)
    return 0


def _schema_grammars(items: list[dict], bundle):
    """Keep the prompts whose schema xgrammar compiles; return them and a grammar factory."""
    from .grammar import schema_prompt_grammars

    kept, make = schema_prompt_grammars(items, str(bundle.path), bundle.target.shape.vocab_size)
    return kept, lambda idx: [make(i) for i in idx]


def _grammars(args, bundle, n: int):
    """One compiled grammar per request, or None; errors name the problem before generation starts."""
    from .grammar import GrammarError, GrammarSpec, RequestGrammar, compile_grammar

    if args.json_schema:
        try:
            spec = GrammarSpec("json_schema", args.json_schema.read_text(), compact=not args.any_whitespace)
        except OSError as e:
            raise GrammarError(f"cannot read the JSON schema file: {e}") from None
    elif args.json:
        spec = GrammarSpec("json", compact=not args.any_whitespace)
    elif args.regex is not None:
        spec = GrammarSpec("regex", args.regex)
    elif args.ebnf:
        try:
            spec = GrammarSpec("ebnf", args.ebnf.read_text())
        except OSError as e:
            raise GrammarError(f"cannot read the EBNF file: {e}") from None
    else:
        return None
    vocab = bundle.target.shape.vocab_size
    compiled = compile_grammar(spec, str(bundle.path), vocab)
    return [RequestGrammar(compiled, vocab) for _ in range(n)]


def _chooser(args, bundle):
    """(tree chooser, its name for the stats line) from --policy, --tree, --tree-set; ValueError names a
    bad combination."""
    from .engine.engine import static_chooser
    from .policy.eagle2 import Eagle2Policy
    from .policy.policies import AdaptiveEMAPolicy, EntMTPPolicy, entmtp_policy
    from .tree import Tree
    from .tree.treeset import TreeSetError, load_tree_set, shipped_tree_set

    if args.no_speculation:
        return static_chooser(Tree.chain(0)), "chain:0"
    policy = args.policy or ("entmtp" if args.tree_set else "static")
    ts = path = None
    if args.tree_set:
        path = Path(args.tree_set)
        if not args.tree_set.endswith(".json"):
            path = shipped_tree_set(args.drafter, args.tree_set, bundle.path.name)
        try:
            ts = load_tree_set(path, model=bundle.path.name, drafter=args.drafter)
        except TreeSetError as e:
            raise ValueError(f"--tree-set: {e}") from None
    if POLICIES[policy].tree_set:
        if ts is None:
            raise ValueError(f"--policy {policy} chooses among the trees of a set: give --tree-set TASK|FILE")
        if args.tree:
            raise ValueError(f"--tree fixes one tree; --policy {policy} chooses among the set's (use --policy "
                             "static --tree NAME for one of them)")
        if POLICIES[policy].rebuilds_set:
            from .calibrate.build import paper_tree_set
            from .calibrate.records import records_file

            records = records_file(path.with_suffix(".records.jsonl"))
            if not records.exists():
                raise ValueError(f"entmtp-paper rebuilds the set from its calibration records, and {records} "
                                 "does not exist (a repository checkout ships them; or run entmtp calibrate)")
            chooser = EntMTPPolicy(paper_tree_set(bundle, ts, records))
        else:
            chooser = entmtp_policy(ts, policy)
        return chooser, f"{chooser.name}:{path.stem}"
    tree = _read_tree(args.tree or "chain:4", ts)
    if policy == "static":
        return static_chooser(tree), tree.name
    if policy == "adaptive":
        return AdaptiveEMAPolicy(min(5, getattr(bundle.drafter, "max_depth", 5))), "adaptive-ema"
    if args.keep < 1:
        raise ValueError(f"--keep must be at least 1, got {args.keep}")
    chooser = Eagle2Policy(tree, min(args.keep, tree.num_nodes))
    return chooser, chooser.name


def _read_tree(spec: str, tree_set=None):
    """chain:N, a parent array, or the name of one of the tree set's trees."""
    from .tree import Tree

    if tree_set is not None:
        for entry in tree_set.trees:
            if entry.tree.name == spec:
                return entry.tree
    if spec.endswith(".json"):
        what = "is a file" if Path(spec).exists() else "does not exist"
        raise ValueError(f"--tree {spec!r}: {what}; --tree takes chain:N, a comma-separated parent array or, with "
                         "--tree-set, the name of one of the set's trees (a tree-set file goes to --tree-set FILE)")
    try:
        return Tree.parse(spec)
    except ValueError as e:
        names = f"; the set's trees: {', '.join(t.tree.name for t in tree_set.trees)}" if tree_set else ""
        raise ValueError(f"--tree {spec!r}: {e}{names}") from None


def _add_model(sub) -> None:
    from .model.prepare import CACHE_ENV, MODELS

    p = sub.add_parser(
        "model", help="prepare a pretrained target model that installs from PyPI",
        description="Check, convert (once) and cache a pretrained target model, and print its directory. "
                    f"The cache is ${CACHE_ENV}, default ~/.cache/entmtp. Every --model flag also accepts "
                    "the model's short name and prepares it on first use.")
    msub = p.add_subparsers(dest="model_command", required=True)
    q = msub.add_parser("prepare", help="check the GGUF's sha256, convert it to a HF checkpoint, print where")
    q.add_argument("name", choices=sorted(MODELS), help="model to prepare")
    q.add_argument("--force", action="store_true", help="convert again even if a prepared copy exists")
    w = msub.add_parser("path", help="print the prepared directory (preparing it if needed)")
    w.add_argument("name", choices=sorted(MODELS))
    t = msub.add_parser("token-map", help="print the path of a drafter's SGLang --speculative-token-map file",
                        description="Write once and print the SGLang --speculative-token-map file of a prepared "
                                    "model's drafter (its draft vocabulary's token ids), so that SGLang drafts over "
                                    "the vocabulary the drafter was trained on.")
    t.add_argument("name", choices=sorted(MODELS))
    t.add_argument("--drafter", default="eagle", help="drafter directory inside the model (default: eagle)")


def _model(args) -> int:
    from .model.prepare import PrepareError, prepare

    def log(msg):
        print(msg, file=sys.stderr)

    from .model.load import ModelDirError, draft_token_map

    try:
        path = prepare(args.name, force=getattr(args, "force", False), log=log)
        if args.model_command == "token-map":
            path = draft_token_map(path / args.drafter)
    except (PrepareError, ModelDirError) as e:
        print(f"entmtp model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _add_kernels(sub) -> None:
    p = sub.add_parser(
        "kernels", help="build the CPU few-row linear kernel and show the linear path this machine takes",
        description="Build (once, into $ENTMTP_CACHE/kernels) the batch-invariant few-row linear kernel with this "
                    "machine's C++ compiler, then measure the batch-invariant linear paths (the kernel, oneDNN on a "
                    "packed weight, F.linear where it is invariant) and print the one this machine takes, with the "
                    "probe's timings. `make install` runs it; the reference engine and every SGLang process with "
                    "the plugin read the cached choice. ENTMTP_LINEAR=fewrow|onednn|torch forces a path.")
    p.add_argument("--remeasure", action="store_true", help="forget this machine's cached choice and measure again")


def _kernels(args) -> int:
    import json

    from .kernels import fewrow_linear as fewrow
    from .model import linear

    if args.remeasure:
        try:
            known = json.loads(linear._cache_file().read_text())
            known.pop(linear._machine_key(), None)
            linear._cache_file().write_text(json.dumps(known, indent=1))
        except (OSError, ValueError):
            pass
    if fewrow.available():
        print(f"few-row kernel: built for {fewrow.isa()} in {fewrow.build_dir()}", file=sys.stderr)
    else:
        print(f"few-row kernel: unavailable ({fewrow.unavailable_reason()}); the linear layers take another "
              "path", file=sys.stderr)
    d = linear.describe()
    for path, ok in (d["invariant"] or {}).items():
        ms = (d["probe_ms"] or {}).get(path)
        times = " / ".join(f"{v:.2f}" for v in ms.values()) + " ms at " + "/".join(ms) + " rows" if ms else ""
        print(f"  {path:7s} {'batch-invariant' if ok else 'not batch-invariant'}  {times}", file=sys.stderr)
    print(d["path"] + (" (forced by the environment)" if d["forced"] else ""))
    return 0


def _add_bench(sub) -> None:
    from .bench.cli import add_parser

    add_parser(sub)


def _add_distill(sub) -> None:
    from .training.fixed_data import add_parser

    add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="entmtp", description="EntMTP: entropy-guided tree speculation for multi-token-prediction models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_calibrate(sub)
    _add_bench(sub)
    _add_model(sub)
    _add_kernels(sub)
    _add_distill(sub)
    args = parser.parse_args(argv)
    if args.command == "model":
        return _model(args)
    if args.command == "kernels":
        return _kernels(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "distill":
        from .training.fixed_data import run

        return run(args)
    if args.command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
