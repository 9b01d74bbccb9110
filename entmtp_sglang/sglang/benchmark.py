"""Side-by-side SGLang benchmark: no speculation, EAGLE static (a small grid), --speculative-adaptive, ENTMTP.

Every system is the same SGLang build on the same machine with the same prompts: one server per system,
all started before measuring, then measured in turn (interleaved; median tokens/s over repeats), greedy,
at each batch size (batch b = b requests in flight at once, kept full until the prompt list is done). Reported per system and batch size: output tokens/s (wall clock
over the whole prompt list), mean accepted length (SGLang's `spec_accept_length`: tokens per verify step,
bonus included), and for ENTMTP the histogram of trees chosen. Also checks greedy equality with the
no-speculation server's outputs (float32 keeps ties out; see tests/test_sglang_server.py).

    .venv/bin/python bench/sglang_cpu.py            # writes bench/results/sglang_cpu.{jsonl,md}
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..tasks import load_prompts
from .serve import SGLangServer


@dataclass(frozen=True)
class SystemSpec:
    name: str
    speculative: str | None = None
    steps: int = 3
    topk: int = 1
    draft_tokens: int = 4
    adaptive: bool = False
    attention: str = "entmtp_torch"

    def server(self, log_dir: Path, device_args: tuple[str, ...]) -> SGLangServer:
        return SGLangServer.cpu(self.speculative, steps=self.steps, topk=self.topk,
                                draft_tokens=self.draft_tokens, adaptive=self.adaptive,
                                attention=self.attention, log_path=log_dir / f"{self.name}.log",
                                extra=device_args)


DEFAULT_SYSTEMS = (
    SystemSpec("plain", None, attention="torch_native"),
    SystemSpec("eagle-s2-k1-n3", "EAGLE", 2, 1, 3),
    SystemSpec("eagle-s3-k1-n4", "EAGLE", 3, 1, 4),
    SystemSpec("eagle-s3-k2-n6", "EAGLE", 3, 2, 6),
    SystemSpec("eagle-adaptive", "EAGLE", 3, 1, 4, adaptive=True),
    SystemSpec("entmtp", "ENTMTP"),
)


@dataclass
class Row:
    system: str
    batch: int
    tokens: int
    seconds: float
    accept_lengths: list[float] = field(default_factory=list)
    trees: collections.Counter = field(default_factory=collections.Counter)
    equal_to_plain: int | None = None
    requests: int = 0
    repeat_tokens_per_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_accept(self) -> float | None:
        return statistics.mean(self.accept_lengths) if self.accept_lengths else None


def bench_prompts(per_task: int) -> list[str]:
    out = []
    for task in ("code", "chat", "math", "prose", "json"):
        out += [it["prompt"][-600:] for it in load_prompts(task, "test", per_task)]
    return out


def run_batch(srv: SGLangServer, prompts: list[str], batch: int, max_new: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda p: srv.generate(p, max_new), prompts))
    return outs, time.perf_counter() - t0


def run(systems=DEFAULT_SYSTEMS, batches=(1, 8), per_task: int = 3, max_new: int = 64, repeats: int = 3,
        log_dir: Path = Path("runs/sglang-bench"), dtype: str = "float32", progress=print,
        on_repeat=None) -> list[Row]:
    """All servers up at once (idle ones sleep), measurements interleaved: for each repeat, each batch size,
    each system in turn; tokens/s is the median over repeats, so load from elsewhere hits all alike."""
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = bench_prompts(per_task)
    device_args = ("--dtype", dtype)
    servers = {}
    try:
        for spec in systems:
            servers[spec.name] = spec.server(log_dir, device_args).start(wait=False)
        for spec in systems:
            servers[spec.name].wait_ready()
            servers[spec.name].generate("warm up", 8)
            progress(f"{spec.name} ready")
        runs: dict[tuple[str, int], list[Row]] = collections.defaultdict(list)
        reference: dict[int, list] = {}
        for rep in range(repeats):
            for b in batches:
                for spec in systems:
                    outs, secs = run_batch(servers[spec.name], prompts, b, max_new)
                    row = Row(spec.name, b, sum(o["meta_info"]["completion_tokens"] for o in outs), secs,
                              requests=len(outs))
                    for o in outs:
                        m = o["meta_info"]
                        if m.get("spec_verify_ct"):
                            row.accept_lengths.append(m["spec_accept_length"])
                        row.trees.update(m.get("entmtp_trees", []))
                    ids = [o["output_ids"] for o in outs]
                    if spec.speculative is None:
                        reference.setdefault(b, ids)
                    elif b in reference:
                        row.equal_to_plain = sum(x == y for x, y in zip(ids, reference[b]))
                    runs[(spec.name, b)].append(row)
                    progress(f"repeat {rep} {spec.name} batch {b}: {row.tokens_per_s:.1f} tok/s, "
                             f"accept {row.mean_accept or 0:.2f}, equal {row.equal_to_plain}/{len(ids)}")
            if on_repeat is not None:
                on_repeat(_medians(runs, systems, batches), rep + 1)
    finally:
        for srv in servers.values():
            srv.stop()
    return _medians(runs, systems, batches)


def _medians(runs, systems, batches) -> list[Row]:
    rows = []
    for b in batches:
        for spec in systems:
            rs = runs[(spec.name, b)]
            med = sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2]
            eq = [r.equal_to_plain for r in rs if r.equal_to_plain is not None]
            med.equal_to_plain = min(eq) if eq else None
            med.repeat_tokens_per_s = [round(r.tokens_per_s, 2) for r in rs]
            rows.append(med)
    return rows


def machine() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": __import__("os").cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "commit": commit}


def to_markdown(rows: list[Row]) -> str:
    plain = {r.batch: r.tokens_per_s for r in rows if r.system == "plain"}
    lines = ["| system | batch | tokens/s (median) | vs plain | mean accepted length | greedy = plain | trees chosen |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.tokens_per_s / plain[r.batch]:.2f}x" if r.batch in plain else ""
        trees = ", ".join(f"{k} {v}" for k, v in r.trees.most_common(4))
        eq = "" if r.equal_to_plain is None else f"{r.equal_to_plain}/{r.requests}"
        acc = "" if r.mean_accept is None else f"{r.mean_accept:.2f}"
        lines.append(f"| {r.system} | {r.batch} | {r.tokens_per_s:.1f} | {ratio} | {acc} | {eq} | {trees} |")
    return "\n".join(lines)


def write(rows: list[Row], out_dir: Path, config: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**config, **machine()}
    with open(out_dir / "sglang_cpu.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**meta, "system": r.system, "batch": r.batch, "tokens": r.tokens,
                                "seconds": round(r.seconds, 3), "tokens_per_s": round(r.tokens_per_s, 2),
                                "mean_accept_length": r.mean_accept, "equal_to_plain": r.equal_to_plain,
                                "requests": r.requests, "trees": dict(r.trees),
                                "repeat_tokens_per_s": r.repeat_tokens_per_s}) + "\n")
    (out_dir / "sglang_cpu.md").write_text(to_markdown(rows) + "\n")
