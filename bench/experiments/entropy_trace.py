"""Entropy trace: for one code and one prose prompt, the entropy window (mean target entropy over the
last 8 positions), the drafter's entropy, the signal the tree set bins on (when it is not an entropy, on
a second axis with its bin edges), the tree EntMTP chose and the accepted length at every step.

    .venv/bin/python bench/experiments/entropy_trace.py --drafter hydra     # writes bench/results/entropy_trace.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from entmtp_sglang.engine.engine import Engine  # noqa: E402
from entmtp_sglang.model.load import load_bundle  # noqa: E402
from entmtp_sglang.policy.policies import EntMTPPolicy  # noqa: E402
from entmtp_sglang.policy.signals import recent_target_entropies, signal_value, window_mean  # noqa: E402
from entmtp_sglang.tasks import load_prompts  # noqa: E402
from entmtp_sglang.tree.treeset import load_tree_set  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class TracingPolicy(EntMTPPolicy):
    def __init__(self, tree_set):
        super().__init__(tree_set)
        self.trace = []

    def __call__(self, view):
        tree = super().__call__(view)
        h = signal_value(self.tree_set.signal, view.draft_value(self.tree_set.signal), view.history,
                         self.window)
        window = window_mean(recent_target_entropies(view.history, self.window), view.draft_entropy)
        self.trace.append({"signal": h, "draft_entropy": view.draft_entropy, "target_window": window,
                           "tree": tree.name, "nodes": tree.num_nodes, "depth": tree.max_depth})
        return tree


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="hydra")
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "entropy_trace.png")
    args = ap.parse_args(argv)
    b = load_bundle(drafter=args.drafter)
    engine = Engine(b.target, args.drafter, b.drafter, b.eos_token_id)
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=False)
    dump = {}
    for ax, task in zip(axes, ("code", "prose")):
        ts = load_tree_set(ROOT / "trees" / f"entmtp-tiny-{args.drafter}-{task}.json")
        item = load_prompts(task, "test", 1)[0]
        pol = TracingPolicy(ts)
        r = engine.generate([b.prompt_ids(item, 300)], args.max_new_tokens, pol)[0]
        steps = range(len(r.steps))
        ax.plot(steps, [t["target_window"] for t in pol.trace], label="entropy window (target, 8 tokens, nats)",
                color="tab:blue")
        ax.plot(steps, [t["draft_entropy"] for t in pol.trace], label="draft entropy (nats)", color="tab:purple",
                lw=0.8, alpha=0.7)
        ax.step(steps, [t["depth"] for t in pol.trace], where="mid", label="chosen tree depth", color="tab:orange")
        ax.bar(steps, [s.accepted for s in r.steps], alpha=0.3, label="accepted drafts", color="tab:green")
        signal_ax = ax
        if ts.signal == "draft_margin":  # not in nats: its own axis
            signal_ax = ax.twinx()
            signal_ax.plot(steps, [t["signal"] for t in pol.trace], label="draft margin (set's signal)",
                           color="tab:red", lw=0.9)
            signal_ax.set_ylabel("draft top-1 minus top-2 probability")
            signal_ax.set_ylim(0, 1)
            signal_ax.legend(fontsize=7, loc="upper left")
        for e in ts.bin_edges:
            signal_ax.axhline(e, color="grey", lw=0.5, ls=":")
        ax.set_title(f"{task}: {item['id']} ({args.drafter}, {len(r.output_ids)} tokens in {len(r.steps)} steps)")
        ax.set_xlabel("decode step")
        ax.legend(fontsize=7, loc="upper right")
        dump[task] = {"trace": pol.trace, "accepted": [s.accepted for s in r.steps]}
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    args.out.with_suffix(".json").write_text(json.dumps(dump))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
