"""How fast are the CPU linear paths? `F.linear`, oneDNN on a packed weight (padded to 6 rows) and the few-row
kernel (`kernels/fewrow_linear.cpp`), side by side in one run, for each of SmolLM2's weight shapes at 1-24 rows, for
all of SmolLM2's linear layers at once (every layer's own weights: the memory a real step reads), and for whole
decoding steps of the reference engine (plain decoding and chains of 1-4 EAGLE drafts) on each path.

    .venv/bin/python bench/experiments/linear_head.py [--model smollm2] [--threads 2]     # about 3 minutes
    # writes bench/results/linear_paths.{md,jsonl}; --out DIR elsewhere

Each cell is the median over repeats; the paths alternate call by call. `batch-invariant` says whether a row's
result was bit-identical alone and among 2-16 others on every shape (the few-row kernel is by construction).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from entmtp_sglang.bench.sglang_benchmark import machine
from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.kernels import fewrow_linear as fewrow
from entmtp_sglang.model import linear as L
from entmtp_sglang.model.load import load_bundle
from entmtp_sglang.model.prepare import resolve_model
from entmtp_sglang.tree import Tree

ROOT = Path(__file__).resolve().parents[2]
ROWS = (1, 2, 4, 6, 8, 12, 16, 24)   # past 8 rows: a verify over a tree with spans, a batch of 12-24 requests


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms per function, calls alternating so a noisy moment hits every path alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def model_weights(bundle) -> dict[str, list[torch.Tensor]]:
    """Every linear layer of the target, as the packed paths call them (q/k/v and gate/up stacked)."""
    out = {"qkv": [], "o_proj": [], "gate_up": [], "down_proj": []}
    for layer in bundle.target.model.layers:
        a, m = layer.self_attn, layer.mlp
        out["qkv"].append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        out["o_proj"].append(a.o_proj.weight)
        out["gate_up"].append(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        out["down_proj"].append(m.down_proj.weight)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per timed generate call")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="writes linear_paths.{md,jsonl}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_bundle(resolve_model(args.model), args.drafter)
    paths = [p for p in ("torch", "onednn", "fewrow") if p in L._candidates()]
    layers = model_weights(bundle)
    shapes = {name: ws[0] for name, ws in layers.items()}
    shapes["output layer"] = bundle.target.lm_head_weight
    shapes["draft output layer"] = bundle.target.lm_head_weight[:8192]  # the EAGLE drafter's 8,192-token vocabulary
    fc = getattr(bundle.drafter, "fc", None)   # EAGLE's fc (a torch Linear inside SGLang: `pack_torch_linears`)
    if fc is not None:
        shapes["drafter fc"] = fc.weight.detach()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cpu = fewrow._cpu_key().split("|")[1]
    header = {**machine(), "commit": commit, "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "cpu": cpu,
              "isa": fewrow.isa()}
    records = []
    lines = [f"# CPU linear paths on {header.get('cpu', '?')}, {args.threads} threads, commit {commit}, "
             f"{header['date']}", "",
             "ms per call, median of " + str(args.repeats) + "; in brackets each path's cost over its own 1-row cost",
             "", "| weight | shape | rows | " + " | ".join(paths) + " |", "|---|---|---|" + "---|" * len(paths)]
    label = {"torch": "F.linear", "onednn": "oneDNN packed", "fewrow": "few-row kernel"}
    lines[4] = "| weight | shape | rows | " + " | ".join(label[p] for p in paths) + " |"
    with torch.no_grad():
        invariant = {p: L.batch_invariant(p, list(shapes.values())) for p in paths}
        for name, w in shapes.items():
            packed = {p: L._packer(p)(w.contiguous()) for p in paths}
            one = {}
            for rows in ROWS:
                x = torch.randn(rows, w.shape[1])
                ms = interleaved_ms({p: (lambda p=p: L._multiply(p)(x, packed[p], None)) for p in paths},
                                    args.repeats)
                one = one or ms
                records.append({"kind": "shape", "weight": name, "shape": list(w.shape), "rows": rows, "ms": ms})
                lines.append(f"| {name} | {tuple(w.shape)} | {rows} | "
                             + " | ".join(f"{ms[p]:.3f} ({ms[p] / one[p]:.2f}x)" for p in paths) + " |")
        # the whole model's linear layers, each layer's own weights (what a decoding step reads)
        packed = {p: [(L._packer(p)(w.contiguous())) for ws in layers.values() for w in ws] + [
            L._packer(p)(bundle.target.lm_head_weight.contiguous())] for p in paths}
        widths = [w.shape[1] for ws in layers.values() for w in ws] + [bundle.target.lm_head_weight.shape[1]]
        lines += ["", "All of the target's linear layers and its output layer (30 layers' own weights), ms per pass:",
                  "", "| rows | " + " | ".join(label[p] for p in paths) + " |", "|---|" + "---|" * len(paths)]
        one = {}
        for rows in ROWS:
            xs = {k: torch.randn(rows, k) for k in set(widths)}

            def whole(p):
                mul = L._multiply(p)
                for k, pw in zip(widths, packed[p]):
                    mul(xs[k], pw, None)
            ms = interleaved_ms({p: (lambda p=p: whole(p)) for p in paths}, max(5, args.repeats // 3))
            one = one or ms
            records.append({"kind": "model", "rows": rows, "ms": ms})
            lines.append(f"| {rows} | " + " | ".join(f"{ms[p]:.2f} ({ms[p] / one[p]:.2f}x)" for p in paths) + " |")
    lines += ["", "Batch-invariant on every shape above (rows alone and among 2-16 others bit-identical): "
              + ", ".join(f"{label[p]} {'yes' if invariant[p] else 'no'}" for p in paths)]
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, None)
    prompt = [bundle.text_ids("Explain how a bicycle stays upright, step by step.")]
    calls = max(3, args.repeats // 6)
    lines += ["", f"Reference engine steps ({args.drafter}, batch 1, {args.tokens} new tokens, median step over "
              f"{calls} calls, ms):", "", "| tree | " + " | ".join(label[p] for p in paths) + " |",
              "|---|" + "---|" * len(paths)]
    chosen = L.choose_path
    try:
        for depth in (0, 1, 2, 4):
            step = {p: [] for p in paths}
            for _ in range(calls):
                for p in paths:
                    L.choose_path = lambda p=p: p
                    res = engine.generate(prompt, args.tokens, static_chooser(Tree.chain(depth)))
                    step[p] += [s.seconds for s in res[0].steps[1:]]
            ms = {p: 1e3 * statistics.median(step[p]) for p in paths}
            records.append({"kind": "engine_step", "tree": f"chain:{depth}", "ms": ms})
            lines.append(f"| chain:{depth} | " + " | ".join(f"{ms[p]:.1f}" for p in paths) + " |")
    finally:
        L.choose_path = chosen
    lines += ["", f"This machine's choice (`entmtp kernels`): {L.choose_path()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_paths.md").write_text(text)
    with open(args.out / "linear_paths.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({**header, "invariant": invariant, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
