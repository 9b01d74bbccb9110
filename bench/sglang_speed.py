"""The product benchmark: ENTMTP as `make serve` starts it against plain SGLang, SGLang's EAGLE (the static grid)
and `--speculative-adaptive`, on SmolLM2-135M-Instruct on this CPU.

    .venv/bin/python bench/sglang_speed.py                  # 40-80 minutes; writes bench/results/sglang_speed.*
    .venv/bin/python bench/sglang_speed.py --render bench/results/sglang_speed.jsonl   # the table again, no servers

Systems: plain SGLang, SGLang's EAGLE over the static grid (s1-k1-n2, s2-k1-n3, s3-k1-n4, s3-k2-n6),
`--speculative-adaptive` and ENTMTP, all with the same EAGLE drafter. Each SmolLM2 server holds about 4 GiB here, so
no more than four are up at once (--at-once): plain and three others per wave, ENTMTP's wave first with adaptive
and the smallest static setting; plain runs again in every wave, and each paired ratio divides by the plain run
beside it. A second table gives ENTMTP's paired ratio over the best static EAGLE setting's and adaptive's.

Workloads (held-out prompts through the model's chat template, greedy, float32): code, chat, prose, JSON under a
schema (the json task's schemas), tool calls under a schema (bench/workloads/tool_calls.json), each at batch 1
and 4; the mixed stream (all of them) at batch 8 and 16, and at batch 1 and 4 as the sum of the five tasks' runs
(the same requests: tokens over seconds added up). The servers of a wave are measured interleaved
(entmtp_sglang/bench/sglang_benchmark.py); tokens/s is the median over repeats, and every output is compared with
plain decoding's. `plain-stock` is plain SGLang with SGLang's own CPU linear layers
(ENTMTP_ONEDNN=0); every other server uses the packed oneDNN layers the plugin installs (sglang/cpu_linear.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    ADAPTIVE,
    EAGLE_GRID,
    PLAIN,
    Row,
    SystemSpec,
    rows_from_jsonl,
    run_workloads,
    to_markdown,
    versus,
    write,
)
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.tasks import load_prompts, load_schema

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "bench" / "workloads" / "tool_calls.json"
ENTMTP = SystemSpec("entmtp", "ENTMTP")
STOCK = SystemSpec("plain-stock", None, attention="torch_native", env=(("ENTMTP_ONEDNN", "0"),))
# ENTMTP's wave first: measured beside the two systems it is closest to (adaptive, the smallest static tree)
SYSTEMS = (PLAIN, ENTMTP, ADAPTIVE, *EAGLE_GRID, STOCK)
DEFAULT = tuple(s.name for s in SYSTEMS if s is not STOCK)
AT_ONCE = 4   # each SmolLM2 server holds about 4 GiB here (front end, scheduler, detokenizer): four fit in 24 GiB


def chat(tokenizer, user: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def payload(text: str, max_new: int, schema: dict | None = None) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new}
    if schema is not None:
        params["json_schema"] = json.dumps(schema)
    return {"text": text, "sampling_params": params}


def workloads(tokenizer, per_task: int, max_new: int) -> dict[str, list[dict]]:
    """task -> /generate payloads (held-out test split; the JSON prompts under their schemas)."""
    out = {}
    for task in ("code", "chat", "prose"):
        items = load_prompts(task, "test", per_task)
        out[task] = [payload(chat(tokenizer, it["prompt"][-600:]), max_new) for it in items]
    out["json"] = [payload(chat(tokenizer, it["prompt"].removeprefix("User: ").split("\nAssistant:")[0]), max_new,
                           load_schema(it)) for it in load_prompts("json", "test", per_task)]
    spec = json.loads(TOOLS.read_text())
    out["tool-call"] = []
    for req in spec["requests"][:per_task]:
        tool = spec["tools"][req["tool"]]
        schema = {"type": "object", "properties": {"name": {"type": "string", "enum": [req["tool"]]},
                                                   "arguments": tool["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
        system = (f"You can call one tool, {req['tool']}: {tool['description']} Parameters: "
                  f"{json.dumps(tool['parameters'])}. Answer with the call as JSON: "
                  '{"name": ..., "arguments": ...}.')
        out["tool-call"].append(payload(chat(tokenizer, req["user"], system), max_new, schema))
    return out


def _per_repeat(parts: list[tuple[int, list[float]]]) -> list[float]:
    """Tokens/s of a sum of runs in each repeat: every part's tokens over its seconds in that repeat, added up
    (`parts`: (tokens, tokens/s per repeat)); empty when the parts' repeats do not line up."""
    reps = {len(per) for _, per in parts}
    if len(reps) != 1 or not all(all(per) for _, per in parts):
        return []
    return [round(sum(n for n, _ in parts) / sum(n / per[i] for n, per in parts), 2) for i in range(reps.pop())]


def mixed_rows(rows: list[Row], batches) -> list[Row]:
    """The mixed stream at `batches` from the per-task rows: each system's tokens and seconds added up, per repeat
    too, and so plain's runs beside them (their paired ratio)."""
    out = []
    for b in batches:
        plain = {r.task: r for r in rows if r.system == "plain" and r.batch == b}
        for system in dict.fromkeys(r.system for r in rows):
            part = [r for r in rows if r.system == system and r.batch == b and r.task not in ("", "mixed")]
            if part:
                eq = [r.equal_to_plain for r in part]
                trees = sum((r.trees for r in part), start=type(part[0].trees)())
                # per repeat: every task's tokens (the same each repeat, greedy) over its seconds in that repeat
                per_repeat = _per_repeat([(r.tokens, r.repeat_tokens_per_s) for r in part])
                beside = ([] if not all(r.plain_repeat_tokens_per_s and r.task in plain for r in part) else
                          _per_repeat([(plain[r.task].tokens, r.plain_repeat_tokens_per_s) for r in part]))
                out.append(Row(system, b, sum(r.tokens for r in part), sum(r.seconds for r in part),
                               [a for r in part for a in r.accept_lengths], trees,
                               None if None in eq else sum(eq), sum(r.requests for r in part), per_repeat,
                               task="mixed", plain_repeat_tokens_per_s=beside))
    return out


def tables(rows: list[Row]) -> str:
    """The results table, then ENTMTP against the best static EAGLE setting and adaptive."""
    names = {r.system for r in rows}
    statics = [s.name for s in EAGLE_GRID if s.name in names]
    text = to_markdown(rows)
    if "entmtp" in names and (statics or ADAPTIVE.name in names):
        text += ("\n\nENTMTP's paired ratio to plain over each system's (the best static EAGLE setting named):\n\n"
                 + versus(rows, "entmtp", {"best static EAGLE": statics, "adaptive": [ADAPTIVE.name]}))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--per-task", type=int, default=4, help="prompts per task (default 4; the mixed stream at batch "
                    "16 needs 16)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(DEFAULT), help="comma-separated, from: " + ", ".join(
        s.name for s in SYSTEMS) + " (default: %(default)s)")
    ap.add_argument("--at-once", type=int, default=AT_ONCE, help="the most servers up together; more systems run "
                    "in waves, plain decoding in each (default %(default)s: each server holds about 4 GiB)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render", type=Path, metavar="JSONL",
                    help="start no server: draw the Markdown table again from a run's JSON lines (into --out)")
    args = ap.parse_args()
    if args.render is not None:
        rows = [r for r in rows_from_jsonl(args.render) if not (r.task == "mixed" and r.batch in (1, 4))]
        rows += mixed_rows(rows, (1, 4))
        args.out.mkdir(parents=True, exist_ok=True)
        args.out.joinpath("sglang_speed.md").write_text(tables(rows) + "\n")
        print(tables(rows))
        return
    from transformers import AutoTokenizer

    model = resolve_alias(args.model)
    names = [n for n in args.systems.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in SYSTEMS})
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}")
    kv = ("--max-total-tokens", "6000")   # the longest batch here needs under 5k tokens of KV
    systems = [dataclasses.replace(s, args=s.args + kv) for s in SYSTEMS if not names or s.name in names]
    tasks = workloads(AutoTokenizer.from_pretrained(str(model)), args.per_task, args.max_new_tokens)
    work = {task: (items, (1, 4)) for task, items in tasks.items()}
    work["mixed"] = ([p for items in tasks.values() for p in items], (8, 16))
    t0 = time.time()
    config = {"model": model.name, "per_task": args.per_task, "max_new_tokens": args.max_new_tokens,
              "systems": [s.name for s in systems], "workloads": {k: list(v[1]) for k, v in work.items()}}

    def save(rows, done):
        rows = rows + mixed_rows(rows, (1, 4))
        write(rows, args.out, {**config, "repeats": args.repeats, "repeats_done": done,
                               "duration_s": round(time.time() - t0)}, name="sglang_speed")
        args.out.joinpath("sglang_speed.md").write_text(tables(rows) + "\n")

    rows = run_workloads(systems, work, args.repeats, ROOT / "runs" / "sglang-speed", on_repeat=save, model=model,
                         starts_at_once=2, at_once=args.at_once)
    save(rows, args.repeats)
    print(tables(rows + mixed_rows(rows, (1, 4))))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
