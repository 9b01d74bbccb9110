"""What ENTMTP's back-off to plain decoding costs inside SGLang on this CPU, and where it does not come from.

    .venv/bin/python bench/experiments/sglang_backoff.py [--model smollm2] [--repeats 3]   # about 7 minutes

Three servers side by side (greedy, float32, measured interleaved, median over repeats):
* `plain`: SGLang without speculation (`torch_native` attention, as in every SGLang benchmark here);
* `plain-entmtp-attn`: the same with ENTMTP's attention backend (`entmtp_torch`), which every speculative
  server on this CPU uses, so its own cost shows;
* `entmtp-chain0`: ENTMTP with a tree set holding only chain:0 (derived from the model's shipped EAGLE mixed
  set), so every step is a back-off: SGLang's speculative step with no draft (verify one token, then the
  draft model's extend pass for the next root).
Writes bench/results/sglang_backoff.{jsonl,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import PLAIN, SystemSpec, run, to_markdown, write
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.tree.treeset import load_tree_set

ROOT = Path(__file__).resolve().parents[2]


def chain0_only(shipped: Path, out: Path) -> Path:
    """`shipped` reduced to its chain:0 entry (one signal bin, no predictor); checked by the loader."""
    data = json.loads(shipped.read_text())
    entry = next(t for t in data["trees"] if t["name"] == "chain:0")
    data.update(trees=[{**entry, "expected_accepted": [0.0]}], bin_edges=[])
    data.pop("predictor", None)
    out.write_text(json.dumps(data))
    load_tree_set(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--per-task", type=int, default=2, help="test prompts per task (5 tasks)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    model = resolve_alias(args.model)
    shipped = ROOT / "trees" / f"{model.name}-eagle-mixed.json"
    if not shipped.exists():
        ap.error(f"no shipped EAGLE mixed set for {model.name} ({shipped})")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        chain0 = chain0_only(shipped, Path(tmp) / "chain0.json")
        env = (("ENTMTP_TREE_SET", str(chain0)), ("ENTMTP_FORCE_TREE_SET", "1"))
        kv = ("--max-total-tokens", "6000")
        systems = [PLAIN, SystemSpec("plain-entmtp-attn", None, attention="entmtp_torch"),
                   SystemSpec("entmtp-chain0", "ENTMTP", env=env)]
        systems = [dataclasses.replace(s, args=s.args + kv) for s in systems]
        rows = run(systems, (1,), args.per_task, args.max_new_tokens, args.repeats,
                   log_dir=ROOT / "runs" / "sglang-backoff", model=model, starts_at_once=2)
    write(rows, args.out, {"model": model.name, "per_task": args.per_task, "max_new_tokens": args.max_new_tokens,
                           "repeats": args.repeats, "duration_s": round(time.time() - t0)}, name="sglang_backoff")
    print(to_markdown(rows))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
