"""Benchmark outputs: the Markdown tables, JSON lines (configuration, commit, machine) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from .runner import OVERALL, BenchResult

PLOT_NAMES = ("speedup", "entropy_trace", "accepted_vs_entropy")
ENGINE_TITLES = {"reference": "reference engine", "transformers": "transformers", "sglang": "SGLang 0.5.23 servers"}


def _fmt_speed(row: dict | None) -> str:
    if row is None:
        return "-"
    if "skipped" in row:
        return "n/a"
    if row["system"] == row["baseline"]:
        return f"{row['tokens_per_s']:.1f} tok/s"
    acc = f" ({row['mean_accepted']:.2f})" if row["steps"] else ""
    return f"{row['speedup']:.2f}x{acc}" if row["speedup"] is not None else f"{row['tokens_per_s']:.1f} tok/s"


def _rows(result: BenchResult) -> dict[tuple, dict]:
    return {(r["task"], r["system"], r["batch"]): r for r in result.rows}


def markdown(result: BenchResult) -> str:
    cfg, meta = result.config, result.meta
    idx = _rows(result)
    systems = list(meta["systems"])
    tasks = list(cfg.tasks) + [OVERALL]
    out = [f"## entmtp bench ({cfg.name}): commit {meta['commit']}, {meta['started']}, "
           f"{meta['seconds'] / 60:.1f} min", ""]
    m = meta["machine"]
    load = m.get("load_avg")
    load = f", load average {load[0]:.1f} at start" if load else ""
    cpu = m.get("processor") or m.get("cpu") or m["machine"]
    model = cfg.model_dir or "the bundled entmtp-tiny"
    out.append(f"Model: {model}. Processor: {cpu}, {m['cpu_count']} CPUs{load}, torch {m['torch']} with "
               f"{m['torch_threads']} threads. Greedy; held-out (test) prompts; {cfg.max_new_tokens} new tokens "
               f"per request; {cfg.prompts} streams per task at batch 1 (max(prompts, b) at batch b); median of "
               f"{cfg.repeats} interleaved repeats.")
    servers = [info for info in meta["systems"].values() if info.get("server")]
    if servers:
        start = next((i["server_start_seconds"] for i in servers if i.get("server_start_seconds")), None)
        out.append("")
        out.append(f"SGLang: {len(servers)} servers (bundled model, its EAGLE drafter, float32, `--sleep-on-idle`), "
                   "started together once" + (f" in {start:.0f} s" if start else "") + "; batch b = b concurrent "
                   "HTTP requests on the same token ids as the reference engine, radix cache flushed before each "
                   "measurement.")
    out.append("")
    engines = list(dict.fromkeys(info["engine"] for info in meta["systems"].values()))
    out += side_by_side(result)
    out += overall_table(result)
    for b in cfg.batch_sizes:
        for engine in engines:  # one table per engine: ratios are within an engine only
            cols = [s for s in systems if meta["systems"][s]["engine"] == engine]
            if all((s, b) in result.skipped for s in cols):
                continue
            base = meta["systems"][cols[0]]["baseline"]
            out.append(f"### Batch {b}, {ENGINE_TITLES.get(engine, engine)}: speedup over `{base}` "
                       "(mean accepted drafts per step)")
            out.append("")
            out.append("| task | " + " | ".join(cols) + " |")
            out.append("|---|" + "---|" * len(cols))
            for t in tasks:
                cells = []
                for s in cols:
                    r = idx.get((t, s, b))
                    cells.append("n/a" if (s, b) in result.skipped else _fmt_speed(r))
                out.append(f"| {t} | " + " | ".join(cells) + " |")
            out.append("")
    baselines = ", ".join(f"`{x}`" for x in sorted({info["baseline"] for info in meta["systems"].values()}))
    note = (f"Baseline columns ({baselines}) show tokens/s; the others show the ratio of tokens/s to their own "
            "engine's baseline in the same repeat (median over repeats). Accepted drafts exclude the bonus token.")
    if result.skipped:
        note += " n/a: not run at that batch size (" + "; ".join(sorted(set(result.skipped.values()))) + ")."
    out.append(note)
    out.append("")
    out += entmtp_detail(result)
    bad = [r for r in result.rows if r.get("lossless") is not None and r["lossless"] < 1 and r["task"] != OVERALL]
    if bad:
        out.append("Outputs differing from the baseline (greedy should be lossless; float differences between "
                   "batch shapes can flip near-ties): " + ", ".join(
                       f"{r['system']}/{r['task']}/b{r['batch']} {r['lossless']:.0%} equal" for r in bad))
    else:
        out.append("Every speculative system's outputs equal its baseline's, token for token, on every request.")
    out.append("")
    return "\n".join(out)


PEER = "hf-greedy"   # transformers' generate: the outside reference the side-by-side divides by


def _paired(a: list[float], b: list[float]) -> float | None:
    """Median over repeats of a / b within each repeat; None without the same repeats on both sides."""
    if not a or len(a) != len(b) or not all(b):
        return None
    import statistics

    return statistics.median(x / y for x, y in zip(a, b))


def side_by_side(result: BenchResult) -> list[str]:
    """At the smallest batch size, every system of every engine side by side on tokens/s: each task's, all tasks',
    the ratio to transformers' greedy `generate` in the same repeat (across engines, unlike the tables below), and
    how many outputs equal each engine's plain decoding token for token. Empty unless two engines ran."""
    b = min(result.config.batch_sizes)
    idx = _rows(result)
    meta = result.meta
    names = [s for s in meta["systems"] if (s, b) not in result.skipped and (OVERALL, s, b) in idx]
    if len({meta["systems"][s]["engine"] for s in names}) < 2:
        return []
    tasks = list(result.config.tasks)
    refs = list(dict.fromkeys(meta["systems"][s]["baseline"] for s in names))
    peer = idx.get((OVERALL, PEER, b))
    model = result.config.model_dir or "the bundled entmtp-tiny"
    out = [f"### Side by side at batch {b} on {model}: tokens/s across engines", "",
           "| system | engine | " + " | ".join(tasks) + " | all tasks | vs `" + PEER + "` (same repeat) | "
           + " | ".join(f"outputs = `{r}`" for r in refs) + " |",
           "|---|---|" + "---|" * (len(tasks) + 2 + len(refs))]
    for s in names:
        row = idx[(OVERALL, s, b)]
        cells = [f"{idx[(t, s, b)]['tokens_per_s']:.1f}" if (t, s, b) in idx else "-" for t in tasks]
        ratio = _paired(row["repeats_tokens_per_s"], peer["repeats_tokens_per_s"]) if peer else None
        eq = [(row.get("equal_to") or {}).get(r) for r in refs]
        out.append(f"| {s} | {meta['systems'][s]['engine']} | " + " | ".join(cells)
                   + f" | {row['tokens_per_s']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                   + " | ".join("-" if e is None else f"{e[0]}/{e[1]}" for e in eq) + " |")
    out.append("")
    plain, ent = idx.get((OVERALL, "plain", b)), [s for s in names if s.startswith("entmtp")]
    if peer and plain:
        ratio = _paired(plain["repeats_tokens_per_s"], peer["repeats_tokens_per_s"])
        line = (f"The reference engine's plain decoding runs at {ratio:.2f}x transformers' greedy generate on this "
                "processor" if ratio is not None else "")
        if ent and ratio is not None:
            e = _paired(idx[(OVERALL, ent[0], b)]["repeats_tokens_per_s"], peer["repeats_tokens_per_s"])
            line += f", {ent[0]} at {e:.2f}x" if e is not None else ""
        if line:
            out += [line + " (all tasks, median over repeats of the ratio within a repeat).", ""]
    return out


def overall_table(result: BenchResult) -> list[str]:
    """One row per system, one column per batch size: all tasks pooled (the summary the README shows)."""
    idx = _rows(result)
    meta, bs = result.meta, result.config.batch_sizes
    out = ["### Overall (all tasks pooled): speedup over the engine's baseline (mean accepted drafts per step)", "",
           "| system | engine | " + " | ".join(f"batch {b}" for b in bs) + " |", "|---|---|" + "---|" * len(bs)]
    for s, info in meta["systems"].items():
        cells = ["n/a" if (s, b) in result.skipped else _fmt_speed(idx.get((OVERALL, s, b))) for b in bs]
        if all(c == "n/a" for c in cells):
            continue
        out.append(f"| {s} | {info['engine']} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def entmtp_detail(result: BenchResult) -> list[str]:
    idx = _rows(result)
    systems = list(result.meta["systems"])
    out = []
    for e in [s for s in systems if s.startswith("entmtp") or s == "sglang-entmtp"]:
        if e == "sglang-entmtp":  # SGLang's own static tree and adaptive rule, same server build
            statics = []
            cols = [("sglang-eagle", "vs sglang-eagle"), ("sglang-adaptive", "vs sglang-adaptive")]
        else:
            d = e.rsplit("-", 1)[1] if "-" in e else ""
            statics = [s for s in systems if s.startswith("static")]
            cols = [("static-" + d, f"vs static-{d}"), ("best-static", "vs best static"),
                    ("adaptive-" + d, f"vs adaptive-{d}"), ("oracle-" + d, f"vs oracle-{d}")]
        cols = [(k, h) for k, h in cols if k == "best-static" and statics or k in systems]
        out.append(f"### {e}: ratios, cost and choices")
        out.append("")
        heads = ["batch", "task"] + [h for _, h in cols] + ["verified / token", "chooser µs / step",
                                                          "trees chosen (share of steps)"]
        out.append("| " + " | ".join(heads) + " |")
        out.append("|" + "---|" * len(heads))
        for b in result.config.batch_sizes:
            for t in list(result.config.tasks) + [OVERALL]:
                r = idx.get((t, e, b))
                if r is None or "skipped" in r:
                    continue
                cells = []
                for k, _ in cols:
                    if k == "best-static":
                        cand = [idx.get((t, s, b)) for s in statics]
                        cand = [c for c in cand if c and c.get("speedup")]
                        o = max(cand, key=lambda c: c["speedup"]) if cand else None
                    else:
                        o = idx.get((t, k, b))
                    cells.append(f"{r['speedup'] / o['speedup']:.2f}x" + (f" ({o['system']})" if k == "best-static"
                                                                             else "")
                                 if o and o.get("speedup") and r.get("speedup") else "-")
                total = sum(r["trees_chosen"].values()) or 1
                top = ", ".join(f"{n} {c / total:.0%}" for n, c in list(r["trees_chosen"].items())[:3])
                pol = f"{r['policy_us_per_step']:.0f}" if r.get("policy_us_per_step") is not None else "-"
                ver = f"{r['verified_per_token']:.2f}" if r.get("verified_per_token") is not None else "-"
                out.append("| " + " | ".join([str(b), t] + cells + [ver, pol, top]) + " |")
        out.append("")
    return out


def write_jsonl(result: BenchResult, path: Path) -> None:
    run = {k: result.meta[k] for k in ("commit", "machine", "config", "started", "seconds", "systems",
                                      "prompt_sets")}
    run["default_trees"] = result.meta.get("default_trees", {})
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", **run, "step_costs": result.meta.get("step_costs", []),
                            "tree_sets": result.meta.get("tree_sets", {}),
                            "skipped": {f"{s}|b{b}": why for (s, b), why in result.skipped.items()}}) + "\n")
        for row in result.rows:
            f.write(json.dumps({"kind": "result", **row, "commit": run["commit"], "config": run["config"],
                                "machine": run["machine"], "started": run["started"]}) + "\n")


def plot_all(result: BenchResult, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    idx = _rows(result)
    cfg = result.config
    systems = [s for s, info in result.meta["systems"].items() if s != info["baseline"]
               and any((s, b) not in result.skipped for b in cfg.batch_sizes)]
    tasks = list(cfg.tasks) + [OVERALL]
    # 1. speedup bars per task and system, one panel per batch size
    fig, axes = plt.subplots(len(cfg.batch_sizes), 1, figsize=(max(8, 1.4 * len(tasks) + 2),
                                                             3.2 * len(cfg.batch_sizes)), squeeze=False)
    width = 0.8 / max(1, len(systems))
    for ax, b in zip(axes[:, 0], cfg.batch_sizes):
        for k, s in enumerate(systems):
            ys = [(idx.get((t, s, b)) or {}).get("speedup") or 0.0 for t in tasks]
            ax.bar([i + (k - (len(systems) - 1) / 2) * width for i in range(len(tasks))], ys, width, label=s,
                   color=plt.get_cmap("tab20")(k % 20))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel("speedup vs baseline")
        ax.set_title(f"batch {b}")
    axes[0, 0].legend(fontsize=7, ncol=min(6, len(systems)), loc="upper left")
    bases = ", ".join(sorted({info["baseline"] for info in result.meta["systems"].values()}))
    fig.suptitle(f"entmtp bench ({cfg.name}): tokens/s relative to the same engine's plain decoding "
                 f"({bases}), median of {cfg.repeats}")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_speedup.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    batch1 = [m for m in result.measurements if m.batch_size == min(cfg.batch_sizes)]
    last_rep = max((m.repeat for m in batch1), default=0)
    # 2. entropy trace with the chosen depth: EntMTP on one stream (the mixed session if benchmarked)
    entmtps = [s for s in systems if s.startswith("entmtp")]
    if entmtps:
        sysname = "entmtp-hydra" if "entmtp-hydra" in entmtps else entmtps[0]
        task = "mixed" if "mixed" in cfg.tasks else cfg.tasks[0]
        ms = [m for m in batch1 if m.system == sysname and m.task == task and m.repeat == last_rep]
        if ms:
            outs = sorted((o for o in ms[0].outcomes if o.stream == 0), key=lambda o: o.segment)
            fig, ax = plt.subplots(figsize=(11, 4))
            x, bounds = 0, []
            for o in outs:
                n = len(o.trace)
                xs = list(range(x, x + n))
                ax.plot(xs, [t[0] for t in o.trace], color="tab:blue", label="draft entropy (nats)" if x == 0 else None)
                ax.step(xs, [t[1] for t in o.trace], where="mid", color="tab:orange",
                        label="chosen tree depth" if x == 0 else None)
                ax.bar(xs, [t[2] for t in o.trace], color="tab:green", alpha=0.35,
                       label="accepted drafts" if x == 0 else None)
                bounds.append((x, x + n))
                x += n
            if task == "mixed":
                from .workload import MIXED_TURNS

                for (a, _), name in zip(bounds, MIXED_TURNS):
                    ax.axvline(a - 0.5, color="grey", ls=":")
                    ax.text(a, ax.get_ylim()[1] * 0.95, name, fontsize=8, va="top")
            ax.set_xlabel("decoding step")
            ax.set_title(f"{sysname}, task {task}, stream 0, batch {min(cfg.batch_sizes)}")
            ax.legend(fontsize=8, loc="upper right")
            fig.tight_layout()
            paths.append(out_dir / f"{stem}_entropy_trace.png")
            fig.savefig(paths[-1], dpi=100)
            plt.close(fig)
    # 3. accepted length vs entropy, per speculative reference system, all tasks at the smallest batch
    traced = [s for s in systems if any(o.trace for m in batch1 if m.system == s for o in m.outcomes)]
    if traced:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ents = [t[0] for m in batch1 if m.system in traced for o in m.outcomes for t in o.trace]
        lo, hi = min(ents), max(ents)
        nb = 12
        edges = [lo + (hi - lo) * i / nb for i in range(nb + 1)]
        for s in traced:
            pts = [t for m in batch1 if m.system == s and m.repeat == last_rep for o in m.outcomes for t in o.trace]
            xs, ys = [], []
            for i in range(nb):
                sel = [t[2] for t in pts if edges[i] <= t[0] < edges[i + 1] or (i == nb - 1 and t[0] == hi)]
                if len(sel) >= 3:
                    xs.append((edges[i] + edges[i + 1]) / 2)
                    ys.append(sum(sel) / len(sel))
            ax.plot(xs, ys, marker="o", ms=3, label=s)
        ax.set_xlabel("drafter entropy at the step (nats)")
        ax.set_ylabel("mean accepted drafts per step")
        ax.set_title(f"accepted length vs entropy (all tasks, batch {min(cfg.batch_sizes)}, bins with >= 3 steps)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"{stem}_accepted_vs_entropy.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_all(result: BenchResult, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{result.config.name}"
    files = {"jsonl": out_dir / f"{stem}.jsonl", "md": out_dir / f"{stem}.md"}
    write_jsonl(result, files["jsonl"])
    files["md"].write_text(markdown(result))
    if plots:
        for p in plot_all(result, out_dir, stem):
            files[p.stem.replace(stem + "_", "")] = p
    return files
