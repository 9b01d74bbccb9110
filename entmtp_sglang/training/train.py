"""Reproducible, seeded training of the bundled model: tokenizer, target, then drafters on the frozen target.

    python -m entmtp_sglang.training.train --out entmtp_sglang/models/entmtp-tiny

Stage 1 trains a `LlamaForCausalLM`; stage 2 freezes it and trains the Medusa heads, the Hydra head and
the EAGLE layer together (one target forward per batch feeds all three), distilling the target's own
next-token distribution. Weights are rounded to bfloat16 once at the end and saved in Hugging Face layout.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model.drafters import EagleDraft, HydraHead, MedusaHeads
from ..model.llama import LlamaForCausalLM, LlamaShape, init_weights
from .corpus import read_docs
from .tokenizer import EOS, train_tokenizer

DOMAINS = ("code", "json", "prose", "math")
MIX = {"code": 0.35, "json": 0.25, "prose": 0.30, "math": 0.10}

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
}


def log(path: Path, msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def tokenize_domains(tok, corpus: Path) -> dict[str, np.ndarray]:
    eos = tok.token_to_id(EOS)
    out = {}
    for name in [d for d in DOMAINS] + [d + "_val" for d in DOMAINS]:
        ids: list[int] = []
        for enc in tok.encode_batch(read_docs(corpus / f"{name}.jsonl")):
            ids.extend(enc.ids)
            ids.append(eos)
        out[name] = np.asarray(ids, dtype=np.int16 if len(tok.get_vocab()) < 32768 else np.int32)
    return out


class Batches:
    def __init__(self, streams: dict[str, np.ndarray], seq: int, batch: int, seed: int):
        self.streams, self.seq, self.batch = streams, seq, batch
        self.rng = np.random.default_rng(seed)
        self.names = list(MIX)
        self.p = np.array([MIX[n] for n in self.names])

    def __call__(self) -> torch.Tensor:
        rows = []
        for name in self.rng.choice(self.names, size=self.batch, p=self.p):
            s = self.streams[name]
            i = int(self.rng.integers(0, len(s) - self.seq - 1))
            rows.append(torch.from_numpy(s[i:i + self.seq + 1].astype(np.int64)))
        return torch.stack(rows)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_target(model, batches, steps, lr, logf, ckpt: Path):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(logf, f"resumed target training at step {start}")

    def loss_fn(x):
        h = model(x[:, :-1])
        return F.cross_entropy(model.logits(h).flatten(0, 1), x[:, 1:].flatten())

    step_fn = torch.compile(loss_fn)
    t0, tokens = time.time(), 0
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, 100)
        x = batches()
        loss = step_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x[:, 1:].numel()
        if step % 25 == 0 or step == steps - 1:
            log(logf, f"target step {step}/{steps} loss {loss.item():.3f} "
                      f"tok/s {tokens / (time.time() - t0):.0f}")
        if (step + 1) % 200 == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * F.log_softmax(logits.float(), -1)).sum(-1).mean()


def drafter_losses(target, medusa, hydra, eagle, x, sample_frac: float, gen: torch.Generator):
    """x (B, T+1). Distil the target's next-token distribution into each drafter."""
    with torch.no_grad():
        f = target(x[:, :-1])  # (B, T, d): f_t, final-normed
    b, t, _ = f.shape
    k_max = medusa.num_heads
    # positions t whose targets t+k+1 (k <= K) exist inside the window
    n_pos = t - k_max - 1
    pick = torch.randperm(n_pos, generator=gen)[: max(1, int(n_pos * sample_frac))]
    with torch.no_grad():
        # target distribution over x_{t+j} given the true prefix, at the picked positions, j = 1..K+1
        probs = [F.softmax(target.logits(f[:, pick + j - 1]).float(), -1) for j in range(1, k_max + 2)]
    losses = {}
    feat = f[:, pick]  # f_{n-1} with n-1 = pick
    # Medusa head k predicts x_{n+k} (= position pick + k + 1); the target's view of it is probs[k]
    losses["medusa"] = sum(soft_ce(medusa.head_logits(feat, k), probs[k]) for k in range(1, k_max + 1)) / k_max
    # Hydra: tokens on the path are the real text x_n .. x_{n+k-1}
    state, hl = feat, 0.0
    for k in range(1, k_max + 1):
        state, logits = hydra.step(state, x[:, pick + k], k)
        hl = hl + soft_ce(logits, probs[k])
    losses["hydra"] = hl / k_max
    # EAGLE: token x_p with feature f_{p-1} -> out_p ~ f_p; logits(out_p) ~ target's p(x_{p+1})
    feats_in = f[:, :-1]
    noise = (torch.rand(feats_in.shape, generator=gen) - 0.5) * 0.2 * feats_in.std()
    out = eagle(x[:, 1:t], feats_in + noise, torch.arange(1, t).expand(b, t - 1))
    reg = F.smooth_l1_loss(out, f[:, 1:])
    sel = pick[pick < t - 1]
    with torch.no_grad():
        p_next = F.softmax(target.logits(f[:, 1:][:, sel]).float(), -1)
    losses["eagle"] = soft_ce(target.logits(out[:, sel]), p_next) + reg
    return losses


def train_drafters(target, drafters, batches, steps, lr, logf, seed):
    params = [p for d in drafters for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, 50)
        x = batches()
        losses = drafter_losses(target, *drafters, x, 0.25, gen)
        total = sum(losses.values())
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            parts = " ".join(f"{k} {v.item():.3f}" for k, v in losses.items())
            log(logf, f"drafters step {step}/{steps} {parts} s/step {(time.time() - t0) / (step + 1):.2f}")


def to_bf16_state(module: torch.nn.Module, drop=()) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()
            if not any(k.startswith(d) for d in drop)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("runs/corpus"), help="output of the corpus builder")
    ap.add_argument("--out", type=Path, required=True, help="model directory to write (HF layout)")
    ap.add_argument("--work", type=Path, default=Path("runs/train"), help="checkpoints and logs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=1000)
    ap.add_argument("--drafter-steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    logf = args.work / "train.log"
    from tokenizers import Tokenizer

    if not (args.out / "tokenizer.json").exists():
        texts = []
        for d in DOMAINS:
            docs = read_docs(args.corpus / f"{d}.jsonl")
            texts.extend(docs[: 4000])
        train_tokenizer(texts, args.out, TARGET_CONFIG["vocab_size"], args.seed)
        log(logf, "tokenizer trained")
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    streams = tokenize_domains(tok, args.corpus)
    counts = {k: int(len(v)) for k, v in streams.items()}
    log(logf, f"tokens per stream: {counts}")
    (args.work / "token_counts.json").write_text(json.dumps(counts, indent=1))

    shape = LlamaShape.from_config_dict(TARGET_CONFIG)
    target = LlamaForCausalLM(shape)
    init_weights(target)
    batches = Batches(streams, args.seq, args.batch, args.seed)
    train_target(target, batches, args.target_steps, 3e-3, logf, args.work / "target.pt")
    # round to bf16 once: the bundled model is exactly what is saved
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    target.requires_grad_(False)
    target.eval()

    medusa = MedusaHeads(shape.hidden_size, shape.vocab_size, 5)
    hydra = HydraHead(shape.hidden_size, shape.vocab_size, 5, shape.rms_norm_eps)
    eagle_shape = LlamaShape.from_config_dict({**TARGET_CONFIG, "num_hidden_layers": 1})
    eagle = EagleDraft(eagle_shape)
    init_weights(eagle)
    with torch.no_grad():
        for head in list(medusa.lm_heads) + [hydra.lm_head]:
            head.weight.copy_(target.lm_head_weight)
        hydra.embed.weight.copy_(target.model.embed_tokens.weight)
        eagle.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    eagle.embed_tokens.requires_grad_(False)
    batches = Batches(streams, 256, args.batch, args.seed + 1)
    train_drafters(target, (medusa, hydra, eagle), batches, args.drafter_steps, 2e-3, logf, args.seed)

    save_model(args.out, target, medusa, hydra, eagle)
    meta = {"seed": args.seed, "target_steps": args.target_steps, "drafter_steps": args.drafter_steps,
            "batch": args.batch, "seq": args.seq, "mix": MIX, "tokens_per_stream": counts}
    (args.out / "training.json").write_text(json.dumps(meta, indent=1))
    log(logf, "saved")


def save_model(out: Path, target, medusa, hydra, eagle) -> None:
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": False}, indent=1))
    save_file(to_bf16_state(target), str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, module, extra in (
        ("medusa", medusa, {"num_heads": medusa.num_heads}),
        ("hydra", hydra, {"num_heads": hydra.num_heads}),
    ):
        d = out / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({"drafter": name, "hidden_size": 256, "vocab_size": 4096,
                                                   **extra}, indent=1))
        save_file(to_bf16_state(module), str(d / "model.safetensors"), metadata={"format": "pt"})
    d = out / "eagle"
    d.mkdir(exist_ok=True)
    # Untied: SGLang gives the draft the target's embedding and head (set_embed_and_head), which fails
    # on a draft whose head is its embedding.
    cfg = {**TARGET_CONFIG, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1,
           "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    # SGLang's LlamaForCausalLMEagle checkpoints carry names without the "model." prefix; no embedding: it is the
    # target's (frozen in training), which SGLang and the loader (`EagleDraft.target_shared`) share
    save_file(to_bf16_state(eagle, drop=("embed_tokens", "rotary")), str(d / "model.safetensors"),
              metadata={"format": "pt"})


if __name__ == "__main__":
    main()
