"""Verification cost table: device time of one target pass over a token tree and of one drafter level, for
Llama-shaped models with random weights (costs depend on shapes, not weights). `entmtp calibrate
--cost-table` reads the JSON (format: `entmtp_sglang/calibrate/cost_table.py`).

    python3 bench/gpu_costs.py --out OUTDIR/gpu_costs.json              # CUDA: the three shapes, ~1-2 min
    python3 bench/gpu_costs.py --out /tmp/c.json --device cpu --shapes tiny --batches 1,2 --nodes 1,2,4 \\
        --context 16 --warmup 1 --repeats 2                             # a dry run on the CPU, seconds

Target: b requests (b in --batches), each with --context committed tokens in its KV cache, run one target
pass over an n-node tree (n in --nodes; node i's parent is (i - 1) // 2, a binary heap, with positions and
the ancestor mask built as the engine builds them) and the LM head at every node: what verifying the tree
costs. On CUDA with flashinfer importable it is timed with both tree-attention backends (flashinfer's
custom mask and torch SDPA with the mask). Each timed pass gets a fresh mask tensor, so FlashInfer plans
it anew as in an engine step.
Drafter level: each drafter kind called once on w rows per request (w in --nodes), with the log-softmax
and top-k that `engine/draft.py` applies to one level (EAGLE: one decoder layer over the context + the LM
head shared with the target).
Timer: CUDA events on CUDA (perf_counter on CPU), --warmup passes, then the median of --repeats. The file
is rewritten after every model, and --budget-s stops measuring in time (the table then says complete:
false); configurations that run out of memory are listed under "skipped".
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from entmtp_sglang.calibrate.cost_table import DRAFTER_LEVEL, DRAFTERS, FORMAT, SHAPE_KEYS, TARGET, VERSION
from entmtp_sglang.costs.provenance import git_commit
from entmtp_sglang.engine.batch_tree import pad_trees, tree_attention_mask
from entmtp_sglang.kernels import flashinfer_available
from entmtp_sglang.model.drafters import EagleDraft, HydraHead, MedusaHeads
from entmtp_sglang.model.eagle3 import Eagle3Draft
from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape, set_attention_backend
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tree import Tree

# name -> (LlamaShape fields without max_position_embeddings, dtype on CUDA)
SHAPES = {
    "entmtp-tiny": (None, torch.float16),  # the bundled model's config.json
    "smollm2-135m": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                          tie_word_embeddings=True), torch.float16),
    "llama-3.1-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                          tie_word_embeddings=False), torch.bfloat16),
    "tiny": (dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2), torch.float32),  # dry runs
}
TOP_K = 4  # children per parent drafted at one level (the top-k the engine takes per node)


def shape_of(name: str, max_positions: int) -> LlamaShape:
    fields, _ = SHAPES[name]
    if fields is None:
        cfg = json.loads((BUNDLED_MODEL / "config.json").read_text())
        cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_positions)
        return LlamaShape.from_config_dict(cfg)
    return LlamaShape(**fields, max_position_embeddings=max_positions)


def heap_tree(n: int) -> Tree:
    return Tree((-1,) + tuple((i - 1) // 2 for i in range(1, n)), name=f"heap:{n}")


class Timer:
    """Milliseconds of fn(): CUDA events on CUDA, perf_counter on CPU; median and min of `repeats`."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, fn) -> tuple[float, float]:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        times = []
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(times), min(times)


def _filled_cache(module, batch: int, capacity: int):
    """A KV cache with small random entries standing in for the committed context."""
    cache = module.new_cache(batch, capacity)
    for t in (*cache.k, *cache.v):
        t.normal_(0.0, 0.1)
    return cache


def _build(cls, dtype, device, *args):
    with torch.device(device):
        module = cls(*args)
    return module.to(dtype).eval().requires_grad_(False)


def _top(logits: torch.Tensor) -> None:
    torch.topk(torch.log_softmax(logits.float(), -1), min(TOP_K, logits.shape[-1]), dim=-1)


def measure_target(model, shape, batch, n, context, attention, timer, gen, cache) -> tuple[float, float]:
    tree = heap_tree(n)
    padded = pad_trees([tree] * batch)
    prefix = torch.full((batch,), context, dtype=torch.int64)
    mask = tree_attention_mask(prefix, padded).to(timer.device)  # (B, 1, n, context + n)
    tokens = torch.randint(0, shape.vocab_size, (batch, n), generator=gen).to(timer.device)
    positions = (prefix.view(batch, 1) + padded.depths).to(timer.device)
    start = prefix.to(timer.device)
    set_attention_backend(model, attention)

    def step():
        hidden = model(tokens, positions, mask.clone(), cache, start)  # a fresh mask: planned anew
        model.logits(hidden)

    with torch.no_grad():
        return timer(step)


def measure_level(kind, drafter, head, batch, w, context, timer, gen, cache, d) -> tuple[float, float]:
    dev = timer.device
    dtype = head.dtype
    feats = torch.randn(batch, w, d, generator=gen).to(dev, dtype)
    tok = torch.randint(0, head.shape[0], (batch, w), generator=gen).to(dev)
    if kind == "medusa":
        def step():  # one head's logits for the level, shared by its w parents
            _top(drafter.head_logits(feats[:, 0], 2).unsqueeze(1).expand(-1, w, -1))
    elif kind == "hydra":
        def step():
            _top(drafter.step(feats, tok, 2)[1])
    else:
        prefix = torch.full((batch,), context, dtype=torch.int64)
        slots = prefix.view(batch, 1) + torch.arange(w).view(1, w)  # (B, w): the level's nodes
        span = context + w
        mask = (torch.arange(span).view(1, 1, span) < context) | (
            torch.arange(span).view(1, 1, span) == slots.unsqueeze(-1))  # prefix + itself
        mask = mask.unsqueeze(1).to(dev)  # (B, 1, w, span)
        pos, slots = (slots + 1).to(dev), slots.to(dev)

        def step():   # EAGLE: the target's output layer; EAGLE-3: its own, over the draft vocabulary
            out = drafter(tok, feats, pos, mask.clone(), cache, slots)
            _top(drafter.draft_logits(out) if kind == "eagle3" else F.linear(out, head))

    with torch.no_grad():
        return timer(step)


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("triton", "flashinfer-python", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="entmtp-tiny,smollm2-135m,llama-3.1-8b",
                    help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256", help="tree sizes, also the drafter level widths")
    ap.add_argument("--context", type=int, default=1024, help="committed tokens per request")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop measuring after this long (0: no limit)")
    args = ap.parse_args(argv)

    try:
        names = [s for s in args.shapes.split(",") if s]
        bad = [s for s in names if s not in SHAPES]
        if bad:
            raise ValueError(f"unknown shape(s) {bad}; choose from {', '.join(SHAPES)}")
        batches = [int(x) for x in args.batches.split(",")]
        nodes = sorted({int(x) for x in args.nodes.split(",")})
        drafters = [k for k in args.drafters.split(",") if k]
        if any(k not in DRAFTERS for k in drafters):
            raise ValueError(f"--drafters must name some of {DRAFTERS}")
        if min(batches) < 1 or min(nodes) < 1 or args.context < 1 or args.repeats < 1 or args.warmup < 0:
            raise ValueError("batches, nodes, context and repeats must be >= 1, warmup >= 0")
    except ValueError as e:
        print(f"gpu_costs: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    attentions = ["flashinfer", "torch"] if cuda and flashinfer_available() else ["torch"]
    t_start = time.monotonic()
    table = {
        "format": FORMAT, "version": VERSION,
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()})",
        "versions": versions(), "timer": "cuda_events" if cuda else "perf_counter",
        "context_tokens": args.context, "warmup": args.warmup, "repeats": args.repeats,
        "tree": "binary heap: node i's parent is (i - 1) // 2", "drafter_top_k": TOP_K,
        "commit": git_commit(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "complete": False,
        "models": {}, "rows": [], "skipped": [],
    }

    def write():
        table["seconds"] = round(time.monotonic() - t_start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table, indent=1) + "\n")

    def out_of_time() -> bool:
        return args.budget_s > 0 and time.monotonic() - t_start > args.budget_s

    def run(row: dict, fn) -> None:
        try:
            median, low = fn()
        except torch.cuda.OutOfMemoryError:
            table["skipped"].append({**row, "reason": "out of memory"})
            torch.cuda.empty_cache()
            return
        table["rows"].append({**row, "median_ms": round(median, 4), "min_ms": round(low, 4)})
        print(f"{row}: {median:.3f} ms", flush=True)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    timer = Timer(device, args.warmup, args.repeats)
    stopped = False
    for name in names:
        dtype = SHAPES[name][1] if cuda else torch.float32
        capacity = args.context + max(nodes) + 1
        shape = shape_of(name, capacity + 1)
        table["models"][name] = {"shape": {k: getattr(shape, k) for k in SHAPE_KEYS}, "dtype": str(dtype)[6:]}
        model = _build(LlamaForCausalLM, dtype, device, shape)
        for b in batches:
            cache = _filled_cache(model, b, capacity)
            for attention in attentions:
                for n in nodes:
                    if out_of_time():
                        stopped = True
                        break
                    run({"model": name, "what": TARGET, "attention": attention, "batch": b, "nodes": n},
                        lambda m=model, a=attention, c=cache, b=b, n=n: measure_target(m, shape, b, n, args.context, a,
                                                                                       timer, gen, c))
            del cache
        head = model.lm_head_weight
        for kind in drafters:
            if kind == "medusa":
                drafter = _build(MedusaHeads, dtype, device, shape.hidden_size, shape.vocab_size, 2)
            elif kind == "hydra":
                drafter = _build(HydraHead, dtype, device, shape.hidden_size, shape.vocab_size, 2, shape.rms_norm_eps)
            else:   # EAGLE, EAGLE-3: one decoder layer with its KV cache (EAGLE-3's draft vocabulary up to 8k)
                one = LlamaShape(**{**shape.__dict__, "num_hidden_layers": 1})
                layers = shape.num_hidden_layers
                drafter = (_build(EagleDraft, dtype, device, one) if kind == "eagle" else
                           _build(Eagle3Draft, dtype, device, one, torch.arange(min(8192, shape.vocab_size)),
                                  (0, layers // 2, layers - 1)))
            autoregressive = kind in ("eagle", "eagle3")
            attention = "flashinfer" if autoregressive and "flashinfer" in attentions else (
                "torch" if autoregressive else "")
            if autoregressive:
                set_attention_backend(drafter, attention)
            for b in batches:
                cache = _filled_cache(drafter, b, capacity) if autoregressive else None
                for w in nodes:
                    if out_of_time():
                        stopped = True
                        break
                    run({"model": name, "what": DRAFTER_LEVEL, "drafter": kind, "attention": attention, "batch": b,
                         "width": w},
                        lambda k=kind, d=drafter, h=head, c=cache, b=b, w=w: measure_level(
                            k, d, h, b, w, args.context, timer, gen, c, shape.hidden_size))
                del cache
            del drafter
        del model, head
        if cuda:
            torch.cuda.empty_cache()
        write()
        if stopped:
            print(f"gpu_costs: --budget-s {args.budget_s} reached; the table is incomplete", file=sys.stderr)
            break
    table["complete"] = not stopped
    write()
    print(summary(table))
    print(f"wrote {args.out} ({len(table['rows'])} rows, {table['seconds']} s)")
    return 0


def summary(table: dict) -> str:
    """The target-pass curves as a markdown table: median ms per tree size, one line per model/attention/batch."""
    sizes = sorted({r["nodes"] for r in table["rows"] if r["what"] == TARGET})
    lines = [f"target pass after {table['context_tokens']} tokens of context, median ms ({table['device']})",
             "| model | attention | batch | " + " | ".join(f"n={n}" for n in sizes) + " |",
             "|---|---|---|" + "---|" * len(sizes)]
    keys = dict.fromkeys((r["model"], r["attention"], r["batch"]) for r in table["rows"] if r["what"] == TARGET)
    for model, attention, batch in keys:
        ms = {r["nodes"]: r["median_ms"] for r in table["rows"]
              if (r["what"], r["model"], r["attention"], r["batch"]) == (TARGET, model, attention, batch)}
        lines.append(f"| {model} | {attention} | {batch} | " + " | ".join(
            f"{ms[n]:.3g}" if n in ms else "-" for n in sizes) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
