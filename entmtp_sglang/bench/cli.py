"""The `entmtp bench` subcommand (wired into entmtp_sglang.cli)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EPILOG = """\
what it measures:
  every system on every task at every batch size, interleaved, repeated; greedy decoding on the held-out
  (test) prompts; tokens/s and its ratio to the same engine's plain decoding (median over repeats), mean
  accepted drafts per step, target tokens verified per token produced, time in the tree chooser per step,
  the trees chosen, and whether outputs equal plain decoding token for token.
outputs (in --out):
  bench_<name>.jsonl   one line for the run (config, commit, machine, measured costs) + one per result row
  bench_<name>.md      the tables printed at the end
  bench_<name>_speedup.png, _entropy_trace.png, _accepted_vs_entropy.png
  <name> is quick, full, or custom when --tasks/--systems/--batch-sizes change the defaults; --engines
  adds the engines to the name (bench_quick_sglang.md)
  --quick also runs its side-by-side on SmolLM2 (below): its tables are appended to bench_quick.md, its
  JSON lines go to bench_quick_side_by_side.jsonl
side by side:
  every report names the processor (model name and AVX2/AVX-512/AMX flags) and, where two engines ran, puts
  every system's tokens/s side by side at batch 1 with its ratio to transformers' generate in the same repeat
  and its outputs compared with each engine's plain decoding. --quick adds a run on SmolLM2 at batch 1 (the
  reference engine's plain and entmtp-hydra, transformers' greedy and prompt lookup; code, chat, JSON and the
  mixed session, 16 new tokens): a reference engine slower than transformers shows there
engines:
  reference     this package's pure-torch engine: plain, static/EAGLE-2/adaptive/EntMTP/oracle trees
  transformers  the outside peer: transformers greedy and prompt-lookup assisted generation (batch 1)
  sglang        SGLang 0.5.23 servers on this CPU: plain, static EAGLE, --speculative-adaptive, ENTMTP;
                started once per run, stopped at the end (also on errors and Ctrl-C); skipped with a
                message when SGLang is not installed (make sglang)
examples:
  entmtp bench --quick                               # about 10 minutes on 2 CPU cores (reference + transformers,
                                                     # then the side-by-side on SmolLM2)
  entmtp bench --quick --engines sglang              # the SGLang systems alone, quick settings
  entmtp bench                                       # the full run, all three engines (README: duration)
  entmtp bench --tasks code,json --systems plain,static-hydra,entmtp-hydra --batch-sizes 1,8
  entmtp bench --list-systems
"""


def _csv(kind):
    def parse(text: str):
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError("give a comma-separated list")
        try:
            return tuple(kind(x) for x in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of {kind.__name__}: {text!r}") from None
    return parse


def add_parser(sub) -> None:
    from .config import BenchConfig
    from .workload import TASKS

    d = BenchConfig.__dataclass_fields__
    p = sub.add_parser(
        "bench", help="benchmark systems x tasks x batch sizes; print a table, write JSON lines and plots",
        description="Benchmark decoding systems (plain, static Medusa/Hydra trees, EAGLE-2 dynamic trees, "
                    "SGLang's adaptive rule, EntMTP, the oracle, transformers prompt lookup on the reference "
                    "engine and transformers; SGLang plain, static EAGLE, --speculative-adaptive and the ENTMTP "
                    "plugin as SGLang servers) on the held-out prompt sets, side by side.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run (< 10 minutes on 2 cores): all tasks, batch 1 and 32, the Hydra drafter's "
                        "systems plus plain and transformers, 2 streams per task at batch 1, 16 new tokens, "
                        "prompts cut to 256 tokens, 2 repeats, the oracle at batch 1 only; the SGLang engine is "
                        "off (add --engines sglang to run its systems alone with these settings); explicit "
                        "options still override; then the side-by-side on SmolLM2 at batch 1 (--side-by-side)")
    p.add_argument("--tasks", type=_csv(str), default=None,
                   help=f"comma-separated tasks (default: all: {','.join(TASKS)})")
    p.add_argument("--systems", type=_csv(str), default=None,
                   help=f"comma-separated systems (default: {','.join(d['systems'].default)}; see "
                        "--list-systems); each system's baseline is added when missing")
    p.add_argument("--engines", type=_csv(str), default=None,
                   help="comma-separated engines whose systems run: reference, transformers, sglang "
                        "(default: all three; --quick: reference,transformers)")
    p.add_argument("--batch-sizes", type=_csv(int), default=None,
                   help=f"comma-separated batch sizes (default: {','.join(map(str, d['batch_sizes'].default))})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"interleaved repeats; the median is reported (default: {d['repeats'].default})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per request (default: {d['max_new_tokens'].default})")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"streams per task at batch 1; batch b uses max(prompts, b) (default: {d['prompts'].default})")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help=f"keep at most this many last tokens of each prompt (default: "
                        f"{d['max_prompt_tokens'].default}; 0: as many as fit the 512-token context with the new "
                        "tokens)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default: 1; 0 = torch's choice). One thread keeps "
                        "timings steady on a shared machine: with 2 intra-op threads and other jobs running, "
                        "steps were measured 5-8x slower than with 1")
    p.add_argument("--model", default=None,
                   help="smollm2 (default: SmolLM2-135M-Instruct, prepared on first use; with --quick the bundled "
                        "entmtp-tiny, which keeps the quick run under 10 minutes), entmtp-tiny (the bundled 6M "
                        "model), or a model directory with drafters and shipped tree sets")
    p.add_argument("--side-by-side", default=None, metavar="MODEL",
                   help="with --quick: the model of the side-by-side run at batch 1 against transformers (default: "
                        "smollm2; none: skip it; skipped anyway when --model is that model, or --engines names "
                        "neither reference nor transformers)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="directory for the JSON lines, Markdown and PNGs (default: bench/results)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list-systems", action="store_true", help="list the registered systems and exit")


def config_from_args(args):
    """The BenchConfig the options ask for (raises ValueError for a bad one)."""
    from .config import ENGINES, QUICK, BenchConfig

    kw = dict(QUICK) if args.quick else {}
    custom = False
    for opt, key in (("tasks", "tasks"), ("systems", "systems"), ("batch_sizes", "batch_sizes")):
        if getattr(args, opt) is not None:
            kw[key] = getattr(args, opt)
            custom = True
    for opt in ("repeats", "max_new_tokens", "prompts", "max_prompt_tokens"):
        if getattr(args, opt) is not None:
            kw[opt] = getattr(args, opt)
    if custom:
        kw["name"] = "custom"
    if args.systems is not None and args.engines is None:
        kw["engines"] = None  # systems named explicitly run whatever their engine
    if args.engines is not None:
        if tuple(args.engines) != (kw.get("engines") or ENGINES) and not custom:
            kw["name"] = kw.get("name", "full") + "_" + "_".join(args.engines)
        kw["engines"] = args.engines
    if args.threads is not None:
        kw["threads"] = args.threads
    # a preparable name (smollm2) is prepared when the run starts, not while parsing
    model = args.model or ("entmtp-tiny" if args.quick else "smollm2")
    kw["model_dir"] = None if model == "entmtp-tiny" else str(model)
    return BenchConfig(**kw)


def side_by_side_from_args(args, cfg):
    """The side-by-side run --quick adds (a BenchConfig), or None: not --quick, `--side-by-side none`, the quick run
    is already on that model, or its engines leave out both the reference engine and transformers."""
    from .config import SIDE_BY_SIDE_MODEL, side_by_side_config

    model = getattr(args, "side_by_side", None) or SIDE_BY_SIDE_MODEL
    if not args.quick or model.lower() == "none":
        return None
    main_model = args.model or "entmtp-tiny"
    if main_model == model or (cfg.engines is not None and not {"reference", "transformers"} & set(cfg.engines)):
        return None
    return side_by_side_config(model, cfg.threads)


def main(args) -> int:
    from .report import markdown, write_all, write_jsonl
    from .runner import run_bench
    from .systems import registry

    if args.list_systems:
        for name, spec in registry().items():
            print(f"{name:18s} [{spec.engine}] {spec.description}")
        return 0
    try:
        cfg = config_from_args(args)
        side = side_by_side_from_args(args, cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import signal

    def on_sigterm(signum, frame):  # unwind through the runner's finally, which stops the servers
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    t0 = time.perf_counter()
    try:
        result = run_bench(cfg)
        files = write_all(result, args.out, plots=not args.no_plots)
        if side is not None:
            t1 = time.perf_counter()
            print(f"bench {cfg.name}: {t1 - t0:.0f} s; now its side-by-side on {side.model_dir} at batch 1")
            extra = run_bench(side)
            files["side_by_side"] = args.out / f"bench_{side.name}.jsonl"
            write_jsonl(extra, files["side_by_side"])
            files["md"].write_text(files["md"].read_text() + "\n" + markdown(extra))
            print(f"bench {side.name}: {time.perf_counter() - t1:.0f} s")
    except KeyboardInterrupt:
        print("interrupted; every server the run started has been stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(files["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in files.values())}")
    print(f"bench {cfg.name}{' with its side-by-side' if side else ''}: {time.perf_counter() - t0:.0f} s")
    return 0
