"""How fast is the output layer? `F.linear` against `model.llama.output_layer` (oneDNN on CPU), and what that
does to whole decoding steps: plain decoding and chains of 1-4 drafts on SmolLM2 with its EAGLE drafter.

    .venv/bin/python bench/linear_head.py [--model smollm2] [--threads 2]   # about 2 minutes

Medians over repeats, both paths timed side by side in one run (alternating)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.model import llama
from entmtp_sglang.model.load import load_bundle
from entmtp_sglang.model.prepare import resolve_model
from entmtp_sglang.tree import Tree


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per timed generate call")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_bundle(resolve_model(args.model), args.drafter)
    w = bundle.target.lm_head_weight
    print(f"output layer {tuple(w.shape)}, {args.threads} threads")
    with torch.no_grad():
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, w.shape[1])
            a = median_ms(lambda: F.linear(x, w), args.repeats)
            llama.ONEDNN_HEAD = True
            b = median_ms(lambda: llama.output_layer(x, w), args.repeats)
            print(f"  rows {rows:2d}: F.linear {a:6.2f} ms   output_layer {b:6.2f} ms   {a / b:.2f}x")
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, None)
    prompt = [bundle.text_ids("Explain how a bicycle stays upright, step by step.")]
    calls = max(3, args.repeats // 6)
    print(f"engine steps ({args.drafter}, batch 1, {args.tokens} new tokens, median step over {calls} calls)")
    for depth in (0, 1, 2, 4):
        step = {"F.linear": [], "output_layer": []}
        for _ in range(calls):
            for name in step:
                llama.ONEDNN_HEAD = name == "output_layer"
                res = engine.generate(prompt, args.tokens, static_chooser(Tree.chain(depth)))
                step[name] += [s.seconds for s in res[0].steps[1:]]
        a, b = (1e3 * statistics.median(step[k]) for k in ("F.linear", "output_layer"))
        llama.ONEDNN_HEAD = True
        print(f"  chain:{depth}: F.linear {a:6.1f} ms   output_layer {b:6.1f} ms   {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
