"""ENTMTP next to plain SGLang and SGLang's static EAGLE on a CUDA host (run by bench/gpu_sglang_check.sh).

    python bench/gpu_sglang_check.py --model-dir DIR --token-map FILE --out OUTDIR [--dry-run]

Three servers with SGLang's default flags for the GPU (CUDA graphs, overlap scheduling, the default attention
backend): `plain` (no speculation), `eagle-s3-k1-n4` (EAGLE, steps 3, top-k 1, 4 draft tokens) and `entmtp`
(`--speculative-algorithm ENTMTP`, nothing else: ENTMTP adjusts what it cannot serve under, with a warning in
its log). Both speculative servers draft with DIR/eagle over its draft vocabulary (`--speculative-token-map`).
One server at a time (SGLang sizes its KV pool from the free GPU memory): started, warmed up, then the same
greedy prompts at each batch size (b requests in flight over HTTP /generate, token ids compared with plain
decoding's at that batch size), then stopped. Prints and writes (OUTDIR/gpu_sglang_check.{md,jsonl}) tokens/s,
mean accepted length and greedy equality; server logs go to OUTDIR/NAME.log.

Exit status: 0 when every server started and ENTMTP's greedy outputs equal plain decoding's at least as often
as EAGLE's do (all of them with --strict: in bfloat16 a verify pass and a one-token decode round differently,
so EAGLE itself may differ on a near-tie); 1 otherwise. --dry-run prints the launch lines and the requests.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    ENTMTP,
    PLAIN,
    Row,
    SystemSpec,
    bench_prompts,
    generate_payload,
    measure,
    to_markdown,
    write,
)
from entmtp_sglang.bench.sglang_systems import EAGLE_STATIC
from entmtp_sglang.calibrate.server import ServerError, SGLangServer, free_port

SYSTEMS = (PLAIN, EAGLE_STATIC, ENTMTP)
BATCHES = (1, 8, 32)


def gpu_args(spec: SystemSpec, model: Path, token_map: Path | None, extra: tuple[str, ...] = ()) -> list[str]:
    """sglang.launch_server arguments: the model, the speculative flags of `spec`, and nothing for the device."""
    args = ["--model-path", str(model), "--log-level", "info"]
    if spec.speculative:
        args += ["--speculative-algorithm", spec.speculative, "--speculative-draft-model-path", str(model / "eagle")]
        args += ["--speculative-token-map", str(token_map)] if token_map else []
    if spec.static_tree_nodes:
        args += ["--speculative-num-steps", str(spec.steps), "--speculative-eagle-topk", str(spec.topk),
                 "--speculative-num-draft-tokens", str(spec.draft_tokens)]
    return args + list(extra)


def problems(rows: list[Row], started: dict[str, str | None], strict: bool = False) -> list[str]:
    """What fails the check: a server that did not start or serve, and ENTMTP's greedy outputs equal to plain
    decoding's less often than EAGLE's at some batch size (than all of them, with `strict`)."""
    out = [f"{name}: {why}" for name, why in started.items() if why]
    by = {(r.system, r.batch): r for r in rows}
    for (name, b), r in sorted(by.items()):
        if name != ENTMTP.name:
            continue
        eagle = by.get((EAGLE_STATIC.name, b))
        need = r.requests if strict or eagle is None or eagle.equal_to_plain is None else eagle.equal_to_plain
        if r.equal_to_plain is None or r.equal_to_plain < need:
            ref = f"EAGLE {eagle.equal_to_plain}/{eagle.requests}" if eagle else "no EAGLE row"
            out.append(f"batch {b}: ENTMTP's greedy output equals plain decoding's for {r.equal_to_plain}/"
                       f"{r.requests} prompts ({ref})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True, help="prepared model (`entmtp model path smollm2`)")
    ap.add_argument("--token-map", type=Path, help="the drafter's --speculative-token-map (`entmtp model token-map`)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="requests in flight (default 1,8,32)")
    ap.add_argument("--prompts", type=int, default=32, help="test prompts, from 5 tasks (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", help="--dtype for every server (default: SGLang's, the model's)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to start")
    ap.add_argument("--strict", action="store_true", help="every ENTMTP output must equal plain decoding's")
    ap.add_argument("--dry-run", action="store_true", help="print the launch lines and requests; start nothing")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = bench_prompts(-(-args.prompts // 5))[: args.prompts]
    extra = ("--dtype", args.dtype) if args.dtype else ()
    servers = [(spec, SGLangServer(gpu_args(spec, args.model_dir, args.token_map, extra), free_port(),
                                   log_path=args.out / f"{spec.name}.log", timeout_s=args.start_timeout))
               for spec in SYSTEMS]
    for spec, srv in servers:
        print(f"launch {spec.name}: {shlex.join(srv.command())}")
    example = generate_payload(prompts[0], args.max_new_tokens)
    example["text"] = f"<prompt 1, {len(prompts[0])} characters>"
    print(f"requests: {len(prompts)} greedy POST /generate per server and batch size, e.g. {json.dumps(example)}")
    print(f"batches: {', '.join(map(str, batches))} requests in flight; output token ids compared with plain's")
    if args.dry_run:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    reference: dict[tuple[str, int], list] = {}
    started: dict[str, str | None] = {}
    t0 = time.time()
    for spec, srv in servers:
        try:
            with srv:
                srv.generate("warm up", 8)
                for b in batches:
                    row = measure(srv, spec, [generate_payload(p, args.max_new_tokens) for p in prompts], b, reference)
                    rows.append(row)
                    print(f"{spec.name} batch {b}: {row.tokens_per_s:.1f} tok/s, accept {row.mean_accept or 0:.2f}, "
                          f"equal to plain {row.equal_to_plain}/{row.requests}", flush=True)
            started[spec.name] = None
        except (ServerError, OSError) as e:
            last = (srv.log_tail(1) or "").strip()
            started[spec.name] = f"failed: {str(e).splitlines()[0]} (log {srv.log_path}: {last})"
            print(f"{spec.name}: {started[spec.name]}", file=sys.stderr, flush=True)
    write(rows, args.out, {"model": args.model_dir.name, "prompts": len(prompts), "batches": batches,
                           "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                           "duration_s": round(time.time() - t0)}, name="gpu_sglang_check")
    print(to_markdown(rows))
    found = problems(rows, started, args.strict)
    for p in found:
        print(f"FAILED {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
