"""The scheduler's resident memory over many short chat requests: ENTMTP beside plain SGLang (issue 57's leak check).

    .venv/bin/python bench/experiments/server_memory.py          # ~15 minutes on 2 cores; bench/results/server_memory/
    .venv/bin/python bench/experiments/server_memory.py --requests 64 --every 32 --out /tmp/mem   # a smoke run

Two SmolLM2-135M-Instruct servers, one after the other, as a user starts them: plain SGLang with this package on
`entmtp_torch` (overlap on, as plain SGLang runs) and ENTMTP as `make serve` starts it (float32, EAGLE drafter).
Each gets the same stream: short chat requests through the model's chat template, `--at-once` in flight, greedy,
`--max-new-tokens` each; every `--every` requests the scheduler process's resident memory (psutil, the
`sglang::scheduler` child of the server) is read, and for ENTMTP what its per-request table holds
(`/server_info`'s `entmtp_requests`: requests, owed positions and their bytes, the policy's per-request entries).
Before this fix the ENTMTP scheduler grew about 5 MiB per 100 requests (finished requests' owed positions).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import tempfile
import time
from pathlib import Path

import psutil

from entmtp_sglang.bench.sglang_benchmark import machine
from entmtp_sglang.calibrate.server import SGLangServer, cpu_args, free_port
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.tasks import load_prompts

ROOT = Path(__file__).resolve().parents[2]
ENTMTP_NAME = "entmtp (make serve)"


def scheduler_rss_mib(server: SGLangServer) -> float:
    """Resident memory of the server's scheduler process (the one that holds the model and the worker)."""
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    sched = [p for p in procs if "scheduler" in " ".join(p.cmdline()) or "scheduler" in p.name()]
    if not sched:
        raise RuntimeError(f"no scheduler process under pid {server.proc.pid}: {[p.name() for p in procs]}")
    return sum(p.memory_info().rss for p in sched) / 2**20


def chat_texts(model: Path, n: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [it["prompt"] for task in ("chat", "prose", "code") for it in load_prompts(task, "test", 64)]
    return [tok.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)][:400]}], tokenize=False,
                                    add_generation_prompt=True) for i in range(n)]


def soak(server: SGLangServer, texts: list[str], at_once: int, max_new: int, every: int, log) -> list[dict]:
    points = []

    def one(text: str) -> int:
        out = server.post("/generate", {"text": text, "sampling_params": {"temperature": 0,
                                                                           "max_new_tokens": max_new}})
        return len(out["output_ids"])

    warm = texts[:at_once]
    with cf.ThreadPoolExecutor(at_once) as pool:
        list(pool.map(one, warm))
        done, t0 = 0, time.monotonic()
        while done < len(texts):
            chunk = texts[done:done + every]
            tokens = sum(pool.map(one, chunk))
            done += len(chunk)
            info = server.server_info()
            p = {"requests": done, "rss_mib": round(scheduler_rss_mib(server), 1), "tokens": tokens,
                 "seconds": round(time.monotonic() - t0, 1), "entmtp_requests": info.get("entmtp_requests")}
            points.append(p)
            log(json.dumps(p))
    return points


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model directory or a preparable name (default smollm2)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--at-once", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--every", type=int, default=100, help="requests between two memory readings")
    ap.add_argument("--systems", default="plain,entmtp", help="which servers, in order (default plain,entmtp)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_memory")
    args = ap.parse_args(argv)
    model = resolve_alias(args.model)
    texts = chat_texts(model, args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    common = ("--dtype", "float32")
    known = {
        "plain": ("plain (package, entmtp_torch, overlap on)", None),
        "entmtp": (ENTMTP_NAME, "ENTMTP"),
    }
    logs = Path(tempfile.mkdtemp(prefix="entmtp-server-memory-"))   # (server logs stay out of the results)
    print(f"server logs in {logs}", flush=True)
    systems = {known[k][0]: SGLangServer(cpu_args(known[k][1], model=model, extra=common), free_port(),
                                         log_path=logs / f"{k}.log") for k in args.systems.split(",")}
    rows = {}
    for name, server in systems.items():
        print(f"== {name}", flush=True)
        with server:
            rows[name] = soak(server, texts, args.at_once, args.max_new_tokens, args.every, print)
    meta = {**machine(), "requests": args.requests, "at_once": args.at_once, "max_new_tokens": args.max_new_tokens,
            "model": str(model)}
    with open(args.out / "server_memory.jsonl", "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for name, pts in rows.items():
            for p in pts:
                f.write(json.dumps({"system": name, **p}) + "\n")
    lines = [f"# Scheduler resident memory over {args.requests} chat requests ({args.at_once} at once, "
             f"{args.max_new_tokens} new tokens, greedy, float32)", "",
             f"{meta['processor']}, commit {meta['commit'][:10]}. `{' '.join(['python', *map(str, (argv or []))])}`"
             if argv else f"{meta['processor']}, commit {meta['commit'][:10]}.", "",
             "| system | " + " | ".join(f"after {p['requests']}" for p in next(iter(rows.values()))) + " | growth |",
             "|---|" + "---|" * (len(next(iter(rows.values()))) + 1)]
    for name, pts in rows.items():
        grow = pts[-1]["rss_mib"] - pts[0]["rss_mib"]
        lines.append(f"| {name} | " + " | ".join(f"{p['rss_mib']:.1f}" for p in pts) + f" | {grow:+.1f} MiB |")
    last = rows[ENTMTP_NAME][-1]["entmtp_requests"] if ENTMTP_NAME in rows else None
    lines += ["", f"ENTMTP's per-request table after the last request: {json.dumps(last)}.",
              "Resident memory in MiB of the `sglang::scheduler` process; growth from the first reading (after the "
              "first batch of requests) to the last."]
    (args.out / "server_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
