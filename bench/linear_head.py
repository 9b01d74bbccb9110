"""How fast are the linear layers? `F.linear` against `model.linear.linear` (oneDNN on a packed weight, CPU), for
each of SmolLM2's layer shapes (the decoder's projections and the 49k-token output layer) at 1-16 rows, and
what that does to whole decoding steps: plain decoding and chains of 1-4 drafts with its EAGLE drafter.

    .venv/bin/python bench/linear_head.py [--model smollm2] [--threads 2]   # about 2 minutes

Medians over repeats, both paths timed side by side in one run (alternating)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.model import linear as L
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
    layer = bundle.target.model.layers[0]
    weights = {"q_proj": layer.self_attn.q_proj.weight, "k_proj": layer.self_attn.k_proj.weight,
               "gate_proj": layer.mlp.gate_proj.weight, "down_proj": layer.mlp.down_proj.weight,
               "output layer": bundle.target.lm_head_weight}
    print(f"{args.threads} threads; ms per call, F.linear vs linear (speed-up)")
    L.ONEDNN = True
    with torch.no_grad():
        for name, w in weights.items():
            cells = []
            for rows in (1, 2, 3, 4, 8, 16):
                x = torch.randn(rows, w.shape[1])
                a = median_ms(lambda: F.linear(x, w), args.repeats)
                b = median_ms(lambda: L.linear(x, w), args.repeats)
                cells.append(f"{rows}: {a:.3f}/{b:.3f} ({a / b:.2f}x)")
            print(f"  {name} {tuple(w.shape)}  " + "  ".join(cells))
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, None)
    prompt = [bundle.text_ids("Explain how a bicycle stays upright, step by step.")]
    calls = max(3, args.repeats // 6)
    print(f"engine steps ({args.drafter}, batch 1, {args.tokens} new tokens, median step over {calls} calls)")
    for depth in (0, 1, 2, 4):
        step = {"F.linear": [], "linear": []}
        for _ in range(calls):
            for name in step:
                L.ONEDNN = name == "linear"
                res = engine.generate(prompt, args.tokens, static_chooser(Tree.chain(depth)))
                step[name] += [s.seconds for s in res[0].steps[1:]]
        a, b = (1e3 * statistics.median(step[k]) for k in ("F.linear", "linear"))
        L.ONEDNN = True
        print(f"  chain:{depth}: F.linear {a:6.1f} ms   linear {b:6.1f} ms   {a / b:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
