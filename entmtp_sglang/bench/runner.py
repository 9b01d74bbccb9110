"""The benchmark loop: every system on every task at every batch size, interleaved, repeated.

    prepare   build the task streams (held-out split), let each system set up (untimed)
    warm up   one short untimed call per system and batch size
    measure   for each repeat: for each batch size: for each task: every system once, the system order
              rotated each repeat (so no system always runs first or right after another)
    summarise per (task, system, batch): median tokens/s over repeats; speedup = median over repeats of
              tokens/s / tokens/s of the system's baseline in the same repeat; accepted drafts per
              step; target tokens verified per token produced; chooser time per step; trees chosen;
              whether the outputs equal the baseline's token for token (greedy must be lossless)
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .config import QUICK, BenchConfig
from .systems import RequestOutcome, System, TaskStreams, make_system
from .workload import BenchContext, build_streams, prompt_set_digests

OVERALL = "overall"
__all__ = ["QUICK", "BenchConfig", "run_bench", "BenchResult", "Measurement"]


@dataclass
class Measurement:
    """One system's run of one task at one batch size in one repeat."""

    task: str
    system: str
    batch_size: int
    repeat: int
    outcomes: list[RequestOutcome]

    @property
    def tokens(self) -> int:
        return sum(len(o.output_ids) for o in self.outcomes)

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.outcomes)


@dataclass
class BenchResult:
    config: BenchConfig
    meta: dict
    rows: list[dict] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # (system, batch) -> reason


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available()}
    from .processor import describe, processor_info

    info.update(processor_info())   # "cpu" (model name) and "cpu_flags" (AVX2, AVX-512, AMX, ...)
    info["processor"] = describe(info)
    try:
        info["load_avg"] = os.getloadavg()
    except OSError:
        pass
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
        return (out.stdout.strip() + ("+dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_bench(cfg: BenchConfig, progress: bool = True, log=None) -> BenchResult:
    from tqdm import tqdm

    from .reference import Resources

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.time()
    from ..model.prepare import resolve_alias

    ctx = BenchContext(resolve_alias(cfg.model_dir) if cfg.model_dir else None, cfg.cost_steps, cfg.cost_rounds,
                       cfg.oracle_max_batch, cfg.max_prompt_tokens, log=log or tqdm.write)
    names = list(cfg.run_systems())
    systems: dict[str, System] = {n: make_system(n, ctx) for n in names}
    for s in list(systems.values()):  # every speedup needs its baseline in the same run
        if s.baseline not in systems:
            systems[s.baseline] = make_system(s.baseline, ctx)
    order = list(systems)
    meta = {"config": asdict(cfg), "commit": git_commit(), "machine": machine_info(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "prompt_sets": {"split": "test", "sha256": prompt_set_digests()},
            "systems": {n: {"engine": s.engine, "baseline": s.baseline, "description": s.description}
                        for n, s in systems.items()}}
    res = Resources.of(ctx)
    n_streams = max(cfg.streams_at(b) for b in cfg.batch_sizes)
    result = BenchResult(cfg, meta)
    for name in order:  # say once, up front, what will not run and why
        why = {b: systems[name].supports(b) for b in cfg.batch_sizes}
        if all(why.values()):
            ctx.log(f"skipping {name}: {why[cfg.batch_sizes[0]]}")
    try:
        work = _prepare(cfg, ctx, systems, order, res, n_streams, progress)
        total = cfg.repeats * len(cfg.batch_sizes) * len(cfg.tasks) * len(order)
        with tqdm(total=total, desc=f"bench {cfg.name}", unit="run", disable=not progress) as bar:
            for rep in range(cfg.repeats):
                rotated = order[rep % len(order):] + order[:rep % len(order)]
                for b in cfg.batch_sizes:
                    for task in cfg.tasks:
                        streams = work[task].head(cfg.streams_at(b))
                        for name in rotated:
                            bar.set_postfix_str(f"rep {rep + 1} b{b} {task} {name}")
                            why = systems[name].supports(b)
                            if why is None:
                                outcomes = systems[name].run(streams, b, cfg.max_new_tokens)
                                result.measurements.append(Measurement(task, name, b, rep, outcomes))
                            else:
                                result.skipped[(name, b)] = why
                            bar.update()
        for name, s in systems.items():
            meta["systems"][name].update(s.record())
    finally:  # servers and other resources are released whatever happened (error, Ctrl-C)
        _close_all(systems.values(), ctx.log)
    meta["tree_sets"] = {f"{d}/{t}/b{','.join(map(str, bs))}": [
        {"name": e.tree.name, "nodes": e.tree.num_nodes, "depth": e.tree.max_depth,
         "cost_seconds": {str(b): round(c, 6) for b, c in e.cost_seconds.items()}} for e in ts.trees]
        for (d, t, bs), ts in res._sets.items()}
    meta["step_costs"] = [  # keys: (drafter, parents, batch), or ("plain", batch) for decoding without a drafter
        {"drafter": k[0], "batch": k[2], "parents": list(k[1]), "seconds": round(c, 6)} if len(k) == 3 else
        {"drafter": None, "batch": k[-1], "parents": [-1], "seconds": round(c, 6)}
        for k, c in res._costs.items() if isinstance(c, float)]
    meta["default_trees"] = {d: list(t.parents) for d, t in res._default.items()}
    meta["seconds"] = round(time.time() - started, 1)
    result.rows = summarise(result, systems, work)
    return result


def _prepare(cfg: BenchConfig, ctx: BenchContext, systems: dict[str, System], order: list[str], res,
             n_streams: int, progress: bool) -> dict[str, TaskStreams]:
    """Untimed: build each task's streams, let every system prepare, warm every system up."""
    from tqdm import tqdm

    with tqdm(total=len(cfg.tasks) * (len(order) + 1), desc="prepare", unit="step", disable=not progress) as bar:
        work: dict[str, TaskStreams] = {}
        for task in cfg.tasks:
            work[task] = build_streams(task, n_streams, res.tokenizer, res.context_tokens, cfg.max_new_tokens,
                                       res.plain_generate, res.bundle().eos_token_id, cfg.max_prompt_tokens)
            bar.update()
            for name in order:
                bar.set_postfix_str(f"{task}/{name}")
                served = tuple(b for b in cfg.batch_sizes if systems[name].supports(b) is None)
                if served:  # the streams the largest batch it serves will use
                    need = max(cfg.streams_at(b) for b in served)
                    systems[name].prepare(work[task].head(need), served, cfg.max_new_tokens)
                bar.update()
    for name in order if cfg.warmup else ():  # warm-up, untimed (the first SGLang call starts its servers)
        for b in cfg.batch_sizes:
            if systems[name].supports(b) is None:
                systems[name].run(work[cfg.tasks[0]].head(b), b, 4)
    return work


def _close_all(systems, log) -> None:
    """close() every system; one failing to close does not keep the others open."""
    for s in systems:
        try:
            s.close()
        except Exception as e:  # noqa: BLE001 - report and go on closing the rest
            log(f"closing {s.name} failed: {type(e).__name__}: {e}")


def _stats(ms: list[Measurement]) -> dict:
    outs = [o for m in ms for o in m.outcomes]
    steps = sum(o.steps for o in outs)
    produced = sum(o.accepted_drafts for o in outs) + steps
    pol = [o.policy_seconds for o in outs if o.policy_seconds is not None]
    trees = Counter()
    for o in outs:
        trees.update(o.trees)
    return {
        "tokens": sum(len(o.output_ids) for o in outs),
        "steps": steps,
        "mean_accepted": sum(o.accepted_drafts for o in outs) / max(1, steps),
        "verified_per_token": (sum(o.verified_tokens for o in outs) / max(1, produced)
                               if all(o.verified_tokens is not None for o in outs) else None),
        "policy_us_per_step": (1e6 * sum(pol) / max(1, steps)) if len(pol) == len(outs) and outs else None,
        "trees_chosen": dict(trees.most_common()),
    }


def summarise(result: BenchResult, systems: dict[str, System], work: dict[str, TaskStreams]) -> list[dict]:
    cfg = result.config
    by: dict[tuple, dict[int, Measurement]] = {}
    for m in result.measurements:
        by.setdefault((m.task, m.system, m.batch_size), {})[m.repeat] = m
    references = list(dict.fromkeys(s.baseline for s in systems.values()))   # every engine's plain decoding
    rows = []
    for b in cfg.batch_sizes:
        for name, system in systems.items():
            if (name, b) in result.skipped:
                rows.append({"task": OVERALL, "system": name, "batch": b, "skipped": result.skipped[(name, b)]})
                continue
            per_rep_total: dict[int, list[Measurement]] = {}
            for task in cfg.tasks + (OVERALL,):
                if task == OVERALL:
                    reps = {r: ms for r, ms in per_rep_total.items()}
                    base_reps: dict[int, list[Measurement]] = {}
                    for t in cfg.tasks:
                        for r, m in by.get((t, system.baseline, b), {}).items():
                            base_reps.setdefault(r, []).append(m)
                else:
                    reps = {r: [m] for r, m in by.get((task, name, b), {}).items()}
                    base_reps = {r: [m] for r, m in by.get((task, system.baseline, b), {}).items()}
                    for r, ms in reps.items():
                        per_rep_total.setdefault(r, []).extend(ms)
                if not reps:
                    continue
                tps = {r: sum(m.tokens for m in ms) / sum(m.seconds for m in ms) for r, ms in reps.items()}
                base = {r: sum(m.tokens for m in ms) / sum(m.seconds for m in ms) for r, ms in base_reps.items()}
                ratios = [tps[r] / base[r] for r in tps if r in base]
                last = reps[max(reps)]
                row = {"task": task, "system": name, "engine": system.engine, "baseline": system.baseline,
                       "batch": b, "tokens_per_s": statistics.median(tps.values()),
                       "speedup": statistics.median(ratios) if ratios else None,
                       "repeats_tokens_per_s": [round(tps[r], 2) for r in sorted(tps)],
                       "repeats_speedup": [round(x, 4) for x in ratios], **_stats(last),
                       "lossless": _lossless(last, base_reps.get(max(reps), [])),
                       "equal_to": _equal_to(last, by, task, b, cfg.tasks, references),
                       "streams": len(work[task]) if task in work else sum(
                           len(work[t].head(cfg.streams_at(b))) for t in cfg.tasks),
                       "max_new_tokens": cfg.max_new_tokens}
                if task in work:
                    row["streams"] = min(len(work[task]), cfg.streams_at(b))
                    row["unique_prompts"] = len({s.source_ids for s in work[task].streams[:row["streams"]]})
                rows.append(row)
    return rows


def _equal_to(ms: list[Measurement], by: dict, task: str, batch: int, tasks: tuple[str, ...],
              references: list[str]) -> dict[str, list[int]]:
    """For every engine's plain decoding (`references`) measured at this batch size, [outputs equal to its outputs
    token for token, outputs compared] (its last repeat; all tasks for the overall row): outputs are compared across
    engines too (the same prompt token ids), not only with the system's own baseline."""
    out = {}
    for ref in references:
        if ms and all(m.system == ref for m in ms):
            continue
        base = []
        for t in (tasks if task == OVERALL else (task,)):
            reps = by.get((t, ref, batch), {})
            if reps:
                base.append(reps[max(reps)])
        want = {(m.task, o.stream, o.segment): o.output_ids for m in base for o in m.outcomes}
        pairs = [(o.output_ids, want.get((m.task, o.stream, o.segment))) for m in ms for o in m.outcomes]
        pairs = [(a, w) for a, w in pairs if w is not None]
        if pairs:
            out[ref] = [sum(a == w for a, w in pairs), len(pairs)]
    return out


def _lossless(ms: list[Measurement], base: list[Measurement]) -> float | None:
    """Fraction of requests whose output equals the baseline's token for token (None: no baseline)."""
    want = {(m.task, o.stream, o.segment): o.output_ids for m in base for o in m.outcomes}
    pairs = [(o.output_ids, want.get((m.task, o.stream, o.segment))) for m in ms for o in m.outcomes]
    pairs = [(a, w) for a, w in pairs if w is not None]
    if not pairs:
        return None
    return sum(a == w for a, w in pairs) / len(pairs)
