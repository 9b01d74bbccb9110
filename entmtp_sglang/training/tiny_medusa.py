"""The bundled model's Medusa drafter (`entmtp_sglang/models/entmtp-tiny/medusa/`), made in one command:

    python -m entmtp_sglang.training.tiny_medusa            # the tiny fixed-data set (shared with tiny_eagle3), then
                                                            # about 4 min of training on 2 cores

Five heads in the form SmolLM2's Medusa drafter has: head k is a residual block over the target's final-normed
hidden state f_{n-1}, read by the target's own output layer (`MedusaHeads(..., draft_ids)`, a `DraftVocabHead`
shared with the target and frozen), so the checkpoint stores the five blocks only (under 1 MB in bf16, where
heads with output layers of their own took 11 MB). The draft vocabulary is the whole 4,096-token vocabulary:
the output layer costs no bytes either way, a 4,096-row output layer is as cheap to run as the old heads' own,
and a smaller one would cap agreement at its coverage and leave grammar-masked drafting (JSON) nothing to
propose where the grammar allows only tokens outside it.

Data: the fixed-data set of `tiny_eagle3` (`RECIPE`, `$ENTMTP_CACHE/tiny-distill/`, built once and reused: the
target's final-normed hidden states and top-32 next-token distributions, teacher-forced over the wheel corpus).
Labels, for the feature row i of a shard (f_{n-1}, position n-1 of its sequence):

    head k (k = 1..K) learns x_{n+k}: the target's top-k distribution at row i + k (the position whose next token
    is x_{n+k}; for head 1 the row EAGLE's entry n learns from), soft cross-entropy over the draft vocabulary,
    where row i + k is in the same sequence and its loss_mask is 1 (`head_label_rows`).

Only the blocks train (AdamW, cosine learning rate, `TRAIN`); the last shard is held out, and the held-out top-1
agreement of each head with the target (the draft's argmax against the target's most likely x_{n+k}) is measured
on the heads as shipped (bf16, loaded back with `load_drafter`) and, before they are replaced, on the heads that
were in the output folder. Both go into `training.json` beside the weights; the model card's Medusa section is
rewritten.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..model.drafters import MedusaHeads
from . import fixed_data as fd
from .eagle3_train import load_shard, shard_files, sparse_soft_ce, split
from .tiny_eagle3 import RECIPE

CARD_HEADING = "## Medusa drafter (`medusa/`)"


@dataclass(frozen=True)
class TrainConfig:
    heads: int = 5
    epochs: float = 2.0  # passes over the training rows
    batch_rows: int = 1024  # feature rows per optimizer step (each trains every head it has a label for)
    lr: float = 1e-2
    warmup: float = 0.03  # share of the run
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.heads < 1 or self.epochs <= 0 or self.batch_rows < 1 or self.lr <= 0:
            raise ValueError("heads >= 1, epochs > 0, batch_rows >= 1 and lr > 0")


TRAIN = TrainConfig()


# -- data ------------------------------------------------------------------------------------------------------

def head_label_rows(seq_lens: torch.Tensor, loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """For each row i of a shard (sequences back to back, `seq_lens`), the row whose next-token distribution head
    k learns from: i + k where that row is in i's sequence and its `loss_mask` is 1, else -1. (N,) int64."""
    n = int(loss_mask.shape[0])
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens.long())  # (N,) sequence of each row
    if seq.shape[0] != n:
        raise ValueError(f"seq_lens sum to {seq.shape[0]} rows, loss_mask has {n}")
    j = torch.arange(n) + k
    inside = j.clamp(max=n - 1)
    ok = (j < n) & (seq[inside] == seq) & loss_mask[inside].bool()
    return torch.where(ok, j, torch.full_like(j, -1))


@dataclass
class Rows:
    """Shards concatenated: feature rows and, per head, the row of its label (-1: none)."""

    features: torch.Tensor  # (N, d) float32, f at each position
    labels: torch.Tensor  # (K, N) int64 rows into topk_*
    topk_ids: torch.Tensor  # (N, k) int64, the target's next tokens, best first
    topk_probs: torch.Tensor  # (N, k) float32
    source: torch.Tensor  # (N,) int64 index into fixed_data.SOURCES


def load_rows(files: list[Path], heads: int) -> Rows:
    parts, base = [], 0
    for f in files:
        s = load_shard(f)
        n = int(s["input_ids"].shape[0])
        labels = torch.stack([head_label_rows(s["seq_lens"], s["loss_mask"], k) for k in range(1, heads + 1)])
        parts.append((s["hidden_states"].float(), torch.where(labels >= 0, labels + base, labels),
                      s["topk_ids"].long(), s["topk_probs"].float(),
                      torch.repeat_interleave(s["seq_source"].long(), s["seq_lens"].long())))
        base += n
    return Rows(*(torch.cat(p, dim=1 if i == 1 else 0) for i, p in enumerate(zip(*parts))))


# -- loss and agreement ------------------------------------------------------------------------------------------

def head_terms(heads: MedusaHeads, rows: Rows, idx: torch.Tensor, k: int, grad: bool = False):
    """Head k on feature rows idx that have a label: (soft cross-entropy per row (R,), agreement per row (R,) bool,
    the rows kept (R,)). The target's top-k renormalized is the label; agreement is the draft's argmax against the
    target's most likely token."""
    lab = rows.labels[k - 1, idx]
    keep = idx[lab >= 0]
    lab = lab[lab >= 0]
    with torch.set_grad_enabled(grad):
        logits = heads.head_logits(rows.features[keep], k).float()  # (R, V)
        prob = rows.topk_probs[lab]
        prob = prob / prob.sum(-1, keepdim=True).clamp(min=1e-6)
        loss = sparse_soft_ce(logits, rows.topk_ids[lab], prob)
    agree = logits.detach().argmax(-1) == rows.topk_ids[lab, 0]
    return loss, agree, keep


@torch.no_grad()
def evaluate(heads: MedusaHeads, rows: Rows, chunk: int = 8192) -> dict:
    """Held-out top-1 agreement and soft cross-entropy per head, over every labelled row; agreement per source."""
    num = rows.labels.shape[0]
    agree, loss, count = [0] * num, [0.0] * num, [0] * num
    by_source: dict[int, list[list[int]]] = {}
    for start in range(0, rows.features.shape[0], chunk):
        idx = torch.arange(start, min(start + chunk, rows.features.shape[0]))
        for k in range(1, num + 1):
            lo, ag, keep = head_terms(heads, rows, idx, k)
            agree[k - 1] += int(ag.sum())
            loss[k - 1] += float(lo.sum())
            count[k - 1] += int(keep.numel())
            src = rows.source[keep]
            for s in src.unique().tolist():
                acc = by_source.setdefault(s, [[0, 0] for _ in range(num)])
                acc[k - 1][0] += int(ag[src == s].sum())
                acc[k - 1][1] += int((src == s).sum())
    return {"agreement": [round(a / max(1, n), 4) for a, n in zip(agree, count)],
            "loss": [round(x / max(1, n), 4) for x, n in zip(loss, count)], "rows": count,
            "agreement_by_source": {fd.SOURCES[s]: [round(a / max(1, n), 4) for a, n in acc]
                                    for s, acc in sorted(by_source.items())}}


# -- training ----------------------------------------------------------------------------------------------------

def new_heads(target, cfg: TrainConfig) -> MedusaHeads:
    """Fresh heads over the target's whole vocabulary, the output layer the target's (frozen; not a parameter)."""
    shape = target.shape
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(shape.hidden_size, shape.vocab_size, cfg.heads, torch.arange(shape.vocab_size))
    heads.share_target(target)
    return heads


def train(heads: MedusaHeads, rows: Rows, cfg: TrainConfig, log=print) -> dict:
    """Train the residual blocks of `heads` on `rows`; returns the run's counts."""
    usable = torch.nonzero((rows.labels >= 0).any(0)).squeeze(1)  # rows some head learns from
    steps = max(1, int(cfg.epochs * usable.numel() / cfg.batch_rows))
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    log(f"{usable.numel()} training rows, {steps} steps of {cfg.batch_rows}, {cfg.heads} heads, "
        f"{sum(p.numel() for p in params)} trained parameters, {torch.get_num_threads()} threads")

    def lr_at(f: float) -> float:
        if f < cfg.warmup:
            return cfg.lr * f / cfg.warmup
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (f - cfg.warmup) / (1 - cfg.warmup))))

    t0 = last = time.time()
    order, pos = torch.randperm(usable.numel(), generator=gen), 0
    stats = [[0, 0] for _ in range(cfg.heads)]
    heads.train()
    for step in range(steps):
        if pos + cfg.batch_rows > order.numel():
            order, pos = torch.randperm(usable.numel(), generator=gen), 0
        idx = usable[order[pos:pos + cfg.batch_rows]]
        pos += cfg.batch_rows
        for g in opt.param_groups:
            g["lr"] = lr_at(step / steps)
        total = 0.0
        for k in range(1, cfg.heads + 1):  # independent heads: each one's mean, summed
            loss, agree, _ = head_terms(heads, rows, idx, k, grad=True)
            if loss.numel():
                total = total + loss.mean()
            stats[k - 1][0] += int(agree.sum())
            stats[k - 1][1] += int(agree.numel())
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        if time.time() - last > 30 or step in (0, steps - 1):
            el = time.time() - t0
            acc = "/".join(f"{a / max(1, n):.3f}" for a, n in stats)
            log(f"step {step + 1}/{steps}, lr {lr_at(step / steps):.2e}, loss {float(total.detach()):.3f}, training "
                f"agreement per head {acc}; {el:.0f} s, ETA {el * (steps - step - 1) / (step + 1):.0f} s")
            stats, last = [[0, 0] for _ in range(cfg.heads)], time.time()
    heads.eval()
    return {"rows": int(usable.numel()), "steps": steps, "seconds": round(time.time() - t0, 1)}


def save(heads: MedusaHeads, out: Path, target_info: dict) -> int:
    """The heads as `load_drafter` reads a shared-head Medusa drafter; returns the weights' bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    draft_ids = heads.head.draft_ids
    cfg = {"drafter": "medusa", "hidden_size": heads.blocks[0].linear.in_features,
           "vocab_size": heads.head.vocab_size, "draft_vocab_size": int(draft_ids.numel()), "target": target_info,
           "num_heads": heads.num_heads}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({"draft_ids": draft_ids.to(torch.int32).contiguous()}, str(out / "draft_vocab.safetensors"))
    return sum(v.numel() * v.element_size() for v in state.values())


# -- the model card ------------------------------------------------------------------------------------------------

def card_section(summary: dict) -> str:
    new, old = summary["held_out"], summary.get("replaced")
    fmt = lambda xs: " / ".join(f"{a:.3f}" for a in xs)  # noqa: E731
    by_source = "; ".join(f"{s} {fmt(v)}" for s, v in new["agreement_by_source"].items())
    replaced = (f"\n- the heads these replaced ({old['form']}, {old['bytes'] / 1e6:.1f} MB) on the same rows: "
                f"{fmt(old['held_out']['agreement'])}" if old else "")
    cfg = summary["train_config"]
    return f"""{CARD_HEADING}
- {cfg['heads']} residual blocks over the target's final-normed hidden state, read by the target's own output layer
  (shared and frozen, over the whole {summary['draft_vocab']:,}-token vocabulary: `draft_vocab.safetensors`) as in
  SmolLM2's Medusa drafter; head k predicts x_{{n+k}}; {summary['bytes'] / 1e6:.2f} MB of bf16 blocks
- trained by `python -m entmtp_sglang.training.tiny_medusa` on the fixed-data set the EAGLE-3 drafter was trained
  on ({RECIPE.positions:,} positions, the last shard held out): head k learns the target's top-{RECIPE.top_k}
  distribution of x_{{n+k}} where that is response text; {summary['steps']} steps of {cfg['batch_rows']:,} rows
  ({cfg['epochs']:g} passes over {summary['rows']:,} rows, lr {cfg['lr']}) in {summary['seconds']:.0f} s
- held-out agreement with the target's top token, heads 1-{cfg['heads']}: {fmt(new['agreement'])}
  ({new['rows'][0]:,} held-out positions for head 1){replaced}
- by source: {by_source}
- recipe and numbers: `medusa/training.json`
"""


def write_card(card: Path, summary: dict) -> None:
    from .tiny_eagle3 import replace_section

    replace_section(card, CARD_HEADING, card_section(summary))


# -- the run -------------------------------------------------------------------------------------------------------

def _replaced(out: Path, target, held: Rows, log) -> dict | None:
    """The held-out agreement of the heads now in `out` (the ones this run replaces), if any."""
    from ..model.load import load_drafter

    if not (out / "config.json").exists() or out.name != "medusa":
        return None
    old = load_drafter(out.parent, "medusa", target=target)
    form = "own output layers" if old.head is None else "the target's output layer"
    result = {"form": form, "bytes": (out / "model.safetensors").stat().st_size, "held_out": evaluate(old, held)}
    log(f"the heads in {out} ({form}): held-out agreement per head {result['held_out']['agreement']}")
    return result


def run(model_dir: Path, work: Path, out: Path, threads: int = 0, cfg: TrainConfig = TRAIN,
        card: bool = True, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    from ..model.load import load_drafter, load_target, target_fingerprint

    if threads:
        torch.set_num_threads(threads)
    data = fd.build(model_dir, RECIPE, work / "tiny-distill", threads=threads, self_distilled=[])
    train_files, held_files = split(shard_files(data))
    target = load_target(model_dir)
    held = load_rows(held_files, cfg.heads)
    replaced = _replaced(out, target, held, log)
    heads = new_heads(target, cfg)
    run_info = train(heads, load_rows(train_files, cfg.heads), cfg, log)
    target_info = {"name": model_dir.name, "fingerprint": target_fingerprint(target)}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    nbytes = save(heads, tmp, target_info)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shipped = load_drafter(out.parent, out.name, target=target) if out.name == "medusa" else heads
    summary = {"command": "python -m entmtp_sglang.training.tiny_medusa", "data_recipe": asdict(RECIPE),
               "data": json.loads((data / "summary.json").read_text())["positions_by_source"],
               "train_config": asdict(cfg), **run_info, "held_out_shards": [f.name for f in held_files],
               "draft_vocab": int(heads.head.draft_ids.numel()), "bytes": nbytes,
               "held_out": evaluate(shipped, held), "replaced": replaced}
    log(f"held-out agreement per head {summary['held_out']['agreement']} (the shipped bf16 heads)")
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    if card:
        write_card(model_dir / "MODEL_CARD.md", summary)
    return summary


def main(argv=None) -> int:
    from ..model.load import BUNDLED_MODEL
    from ..model.prepare import cache_root

    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.tiny_medusa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="the target (default: the bundled model)")
    p.add_argument("--work", type=Path, default=None, help="data folder (default: $ENTMTP_CACHE)")
    p.add_argument("--out", type=Path, default=None, help="where the drafter goes (default: MODEL/medusa)")
    p.add_argument("--epochs", type=float, default=TRAIN.epochs)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    cfg = TrainConfig(**{**asdict(TRAIN), "epochs": args.epochs})
    out = args.out or args.model / "medusa"
    summary = run(args.model, args.work or cache_root(), out, args.threads, cfg, card=args.out is None)
    print(json.dumps({"held_out": summary["held_out"]["agreement"],
                      "replaced": summary["replaced"] and summary["replaced"]["held_out"]["agreement"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
