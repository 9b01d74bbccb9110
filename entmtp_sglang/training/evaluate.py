"""Held-out evaluation of the bundled model and the model card.

    python -m entmtp_sglang.training.evaluate --model entmtp_sglang/models/entmtp-tiny

Per domain (code, json, prose, math) on held-out text: the target's loss and top-1 accuracy, and the
top-1 accuracy of each drafter head, teacher-forced on the text: Medusa head k and Hydra depth k
predict x_{t+k+1} from f_t (Hydra also sees x_{t+1} .. x_{t+k}); EAGLE depth 1 predicts x_{t+2} from
(x_{t+1}, f_t).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model.load import load_bundle
from .corpus import read_docs
from .train import DOMAINS

WINDOW = 256


@torch.no_grad()
def evaluate(model_dir: Path, corpus: Path, windows: int = 24, seed: int = 0) -> dict:
    bundles = {k: load_bundle(model_dir, k) for k in ("medusa", "hydra", "eagle")}
    target = bundles["medusa"].target
    tok = bundles["medusa"].tokenizer
    rng = np.random.default_rng(seed)
    out = {}
    for domain in DOMAINS:
        ids: list[int] = []
        for d in read_docs(corpus / f"{domain}_val.jsonl"):
            ids.extend(tok.encode(d).ids + [bundles["medusa"].eos_token_id])
        ids_t = torch.tensor(ids)
        starts = rng.integers(0, len(ids) - WINDOW - 1, size=windows)
        x = torch.stack([ids_t[s:s + WINDOW] for s in starts])  # (W, T)
        f = target(x)  # (W, T, d)
        logits = target.logits(f)
        res = {"tokens": len(ids),
               "target_loss": float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())),
               "target_top1": float((logits[:, :-1].argmax(-1) == x[:, 1:]).float().mean())}
        k_max = 5
        t_max = WINDOW - k_max - 1
        med = bundles["medusa"].drafter
        res["medusa_top1"] = [float((med.head_logits(f[:, :t_max], k).argmax(-1) == x[:, k + 1:k + 1 + t_max])
                                    .float().mean()) for k in range(1, k_max + 1)]
        hyd = bundles["hydra"].drafter
        z, accs = f[:, :t_max], []
        for k in range(1, k_max + 1):
            z, lg = hyd.step(z, x[:, k:k + t_max], k)
            accs.append(float((lg.argmax(-1) == x[:, k + 1:k + 1 + t_max]).float().mean()))
        res["hydra_top1"] = accs
        eag = bundles["eagle"].drafter
        o = eag(x[:, 1:], f[:, :-1], torch.arange(1, WINDOW).expand(windows, WINDOW - 1))
        lg = target.logits(o[:, :-1])
        res["eagle_top1"] = [float((lg.argmax(-1) == x[:, 2:]).float().mean())]
        out[domain] = res
    return out


def model_card(model_dir: Path, evals: dict, train_log: Path | None) -> str:
    meta = json.loads((model_dir / "training.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    n_params = cfg["vocab_size"] * cfg["hidden_size"] + cfg["num_hidden_layers"] * (
        4 * cfg["hidden_size"] ** 2 + 3 * cfg["hidden_size"] * cfg["intermediate_size"] + 2 * cfg["hidden_size"])
    last = {}
    if train_log and train_log.exists():
        for line in train_log.read_text().splitlines():
            m = re.search(r"(target|drafters) step (\d+)/\d+ (.*?)(?: tok/s| s/step)", line)
            if m:
                last[m.group(1)] = f"step {m.group(2)}: {m.group(3)}"
    lines = [
        "# entmtp-tiny",
        "",
        "A small Llama (`LlamaForCausalLM`) trained on this project's CPU machine, with three",
        "multi-token-prediction drafters trained on the frozen target. It exists so that the EntMTP",
        "engine, its tests and its benchmarks have a real model whose drafts are sometimes accepted and",
        "sometimes not. It is not a useful assistant.",
        "",
        "## Architecture",
        f"- target: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads, MLP {cfg['intermediate_size']}, vocabulary {cfg['vocab_size']} "
        f"(byte-level BPE), context {cfg['max_position_embeddings']}, tied embeddings, ~{n_params / 1e6:.1f}M "
        "parameters; weights stored in bfloat16",
        "- `medusa/`: 5 parallel heads (residual block + own output layer); head k predicts x_{n+k}",
        "- `hydra/`: 5 sequentially dependent heads (recurrent state over the drafted path, own output layer)",
        "- `eagle/`: one Llama decoder layer over [embedding, previous feature] in SGLang's",
        "  `LlamaForCausalLMEagle` layout (`--speculative-draft-model-path`)",
        "",
        "## Training (reproducible: `make model`, seed " + str(meta["seed"]) + ")",
        f"- target: {meta['target_steps']} steps of {meta['batch']} x {meta['seq']} tokens, AdamW, cosine LR; "
        f"mix {meta['mix']}",
        f"- drafters: {meta['drafter_steps']} steps on the frozen target, distilling its next-token "
        "distribution (soft cross-entropy); EAGLE also regresses the target feature",
        f"- final logged losses: target {last.get('target', '?')}; drafters {last.get('drafters', '?')}",
        "- corpus tokens per stream: " + ", ".join(f"{k} {v:,}" for k, v in meta["tokens_per_stream"].items()),
        "- sources and splits: see `entmtp_sglang/training/corpus.py` and `data_manifest.json` (every",
        "  stdlib file with its hash, the wheels with their sha256)",
        "",
        "## Held-out accuracy (teacher-forced top-1 on held-out text)",
        "",
        "| domain | target loss | target top-1 | Medusa heads 1-5 | Hydra heads 1-5 | EAGLE depth 1 |",
        "|---|---|---|---|---|---|",
    ]
    for d, r in evals.items():
        fmt = lambda xs: " / ".join(f"{a:.2f}" for a in xs)  # noqa: E731
        lines.append(f"| {d} | {r['target_loss']:.2f} | {r['target_top1']:.2f} | {fmt(r['medusa_top1'])} | "
                     f"{fmt(r['hydra_top1'])} | {fmt(r['eagle_top1'])} |")
    lines += ["", "Produced by `python -m entmtp_sglang.training.evaluate`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate the bundled model and write its model card.")
    ap.add_argument("--model", type=Path, default=Path("entmtp_sglang/models/entmtp-tiny"))
    ap.add_argument("--corpus", type=Path, default=Path("runs/corpus"))
    ap.add_argument("--train-log", type=Path, default=Path("runs/train/train.log"))
    args = ap.parse_args(argv)
    evals = evaluate(args.model, args.corpus)
    (args.model / "eval.json").write_text(json.dumps(evals, indent=1))
    (args.model / "MODEL_CARD.md").write_text(model_card(args.model, evals, args.train_log))
    print((args.model / "MODEL_CARD.md").read_text())


if __name__ == "__main__":
    main()
