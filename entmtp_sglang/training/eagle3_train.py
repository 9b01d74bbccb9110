"""Train an EAGLE-3 drafter on the fixed-data shards (`training/fixed_data.py`) with training-time test.

    python -m entmtp_sglang.training.eagle3_train --data ~/.cache/entmtp/distill/fixed-<hash> --minutes 38

Each position p of a sequence (token x_p, the target's fused features a_{p-1}, the target's top-k distribution of
x_{p+1}) is one training row. Training-time test (EAGLE-3) unrolls `--steps` drafting levels over every window,
each level reading the previous level's own outputs, exactly as drafting inside a tree does:

    level 0: entry p reads fc(a_{p-1}), attends level-0 entries j <= p                    (the committed context)
    level k: entry p reads out^{k-1}_{p-1}, attends level-0 entries j <= p-k and the level-m entries at p-k+m,
             m = 1..k (its ancestors in a draft chain, itself last)
    every level's entry p predicts x_{p+1}: soft cross-entropy against the target's top-k (restricted to the draft
    vocabulary and renormalized), weighted 0.8^k, where the next token is response text (`loss_mask`).

The draft vocabulary (`--draft-vocab` tokens) is the target's most frequent next tokens over the training shards,
as EAGLE-3 and FR-Spec choose it. The embedding is the target's and frozen; the head is the target's output rows
of the draft vocabulary, frozen by default (`--train-head` trains it, and the shipped checkpoint then has to carry
it). Everything lives in `$ENTMTP_CACHE/eagle3/<run>/`: `ckpt.pt` (resumable: model, optimizer, data cursor and
clock, saved every `--save-every-s` seconds), `train.log` (progress and an ETA), and at the end `sglang/` (the
checkpoint SGLang loads, head included, bf16), `shipped/` (bf16, the head left out when frozen) and `summary.json`
(held-out agreement per level and per source). The last shard is held out (with one shard, its last sequences).

`--kind eagle` trains the EAGLE drafter (model/drafters.py `EagleDraft`: fc([E(x_p), f_{p-1}]) with the target's
last feature, no final norm) the same way on the same shards, into `$ENTMTP_CACHE/eagle/<run>/` in the layout the
shipped EAGLE drafter has.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..model.drafters import EagleDraft
from ..model.eagle3 import Eagle3Draft, checkpoint_state, export
from ..model.llama import LlamaShape, init_weights
from .fixed_data import SOURCES

STEP_WEIGHT = 0.8  # EAGLE-3's per-level loss decay


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3  # training-time-test levels
    window: int = 512  # positions per training window
    batch_tokens: int = 2048  # padded positions per optimizer step
    lr: float = 6e-4
    warmup: float = 0.03  # share of the run
    weight_decay: float = 0.0
    clip: float = 1.0
    draft_vocab: int = 8192
    minutes: float = 38.0  # wall-clock budget of the run (resumed runs count the time already spent)
    positions: int = 0  # stop after this many training positions (0: one pass over the training shards)
    train_head: bool = False
    seed: int = 0
    eval_windows: int = 64
    intermediate_size: int = 0  # 0: the target's
    kind: str = "eagle3"  # or "eagle": the EAGLE drafter over the target's last feature, trained the same way

    def __post_init__(self):
        if self.kind not in FEATURES:
            raise ValueError(f"kind must be one of {', '.join(FEATURES)}, got {self.kind!r}")
        if self.steps < 1 or self.window < 8 or self.batch_tokens < self.window or self.draft_vocab < 2:
            raise ValueError("steps >= 1, window >= 8, batch_tokens >= window and draft_vocab >= 2")


# -- data ------------------------------------------------------------------------------------------------------

def shard_files(data: Path) -> list[Path]:
    files = sorted(Path(data).glob("shard-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no shards in {data} (build them with `entmtp distill fixed-data`)")
    return files


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training shards, held-out shards): the last shard is held out when there are several."""
    return (files[:-1], files[-1:]) if len(files) > 1 else (files, files)


def draft_vocabulary(files: list[Path], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target next tokens (top-1 of the target's distribution) over the shards, ids
    ascending; ties and unseen tokens filled by id."""
    from safetensors import safe_open

    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for f in files:
        with safe_open(str(f), "pt") as s:
            top1 = s.get_tensor("topk_ids")[:, 0].long()
        counts += torch.bincount(top1, minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # deterministic ties: lower id first
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


@dataclass
class Window:
    shard: int
    start: int  # index of the window's first entry (token x_p) in the shard
    length: int
    position: int  # p of the first entry within its sequence
    source: int


def windows(seq_lens: list[int], sources: list[int], shard: int, window: int) -> list[Window]:
    """Cut each sequence into windows of entries p = 1 .. len-1 (entry p needs the features of p-1)."""
    out, base = [], 0
    for n, src in zip(seq_lens, sources):
        p = 1
        while p < n:
            length = min(window, n - p)
            out.append(Window(shard, base + p, length, p, src))
            p += length
        base += n
    return out


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def batch_of(shard: dict, ws: list[Window], t2d_index: torch.Tensor, features: str = "aux_hidden_states"
             ) -> dict[str, torch.Tensor]:
    """Padded tensors for windows of one shard: tokens, positions, features (of p-1), valid, loss weight, and the
    target distribution over the draft vocabulary (as (index, prob) pairs of the top-k)."""
    b, t = len(ws), max(w.length for w in ws)
    k = shard["topk_ids"].shape[1]
    d3 = shard[features].shape[1]
    tokens = torch.zeros(b, t, dtype=torch.int64)
    pos = torch.zeros(b, t, dtype=torch.int64)
    feats = torch.zeros(b, t, d3, dtype=torch.float32)
    valid = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    tidx = torch.zeros(b, t, k, dtype=torch.int64)
    tprob = torch.zeros(b, t, k, dtype=torch.float32)
    for i, w in enumerate(ws):
        s, n = w.start, w.length
        tokens[i, :n] = shard["input_ids"][s:s + n].long()
        pos[i, :n] = torch.arange(w.position, w.position + n)
        feats[i, :n] = shard[features][s - 1:s - 1 + n].float()
        valid[i, :n] = True
        mask[i, :n] = shard["loss_mask"][s:s + n].bool()
        ids = t2d_index[shard["topk_ids"][s:s + n].long()]  # (n, k): draft index or -1
        probs = shard["topk_probs"][s:s + n].float() * (ids >= 0)
        tidx[i, :n] = ids.clamp(min=0)
        tprob[i, :n] = probs
    mass = tprob.sum(-1, keepdim=True)
    mask &= mass.squeeze(-1) > 0.05  # too little of the target's mass inside the draft vocabulary to learn from
    tprob = tprob / mass.clamp(min=1e-6)
    return {"tokens": tokens, "positions": pos, "features": feats, "valid": valid, "loss_mask": mask,
            "target_idx": tidx, "target_prob": tprob}


# -- training-time test --------------------------------------------------------------------------------------

def _heads(x: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, n, hd).transpose(1, 2)  # (B, n, T, hd)


def _shift(x: torch.Tensor, by: int, dim: int = 2) -> torch.Tensor:
    """x moved `by` places to higher indices along dim (zeros in front)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - by)), dim=dim)


class Parts:
    """How one drafter kind's layer is computed, piece by piece, for training-time test."""

    def __init__(self, draft):
        self.draft = draft
        self.eagle3 = isinstance(draft, Eagle3Draft)
        self.layer = draft.midlayer if self.eagle3 else draft.layers[0]
        self.attn = self.layer.self_attn

    def first(self, features):
        """Level 0's feature input: EAGLE-3 fuses the target's layers (fc); EAGLE reads the target's feature."""
        return self.draft.fc(features) if self.eagle3 else features

    def level_input(self, embeds, g):
        """(what the attention reads, the residual it adds to)."""
        if self.eagle3:
            return self.layer.attention_input(embeds, g), g
        x = self.draft.fc(torch.cat((embeds, g), dim=-1))  # EAGLE: fc([E(x_p), f]); the layer has no input norm
        return x, x

    def finish(self, base, a):
        h = base + a
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def draft_logits(self, out):
        return self.draft.draft_logits(out) if self.eagle3 else self.draft.head.draft_logits(out)


FEATURES = {"eagle3": "aux_hidden_states", "eagle": "hidden_states"}  # what each kind reads of a shard


def ttt_forward(draft, tokens, positions, features, valid, steps: int) -> list[torch.Tensor]:
    """Training-time test: the drafter's outputs out^k (B, T, d) for levels k = 0 .. steps-1 (see the module
    docstring for who attends to whom). Level k's entry i is meaningful where i >= k and valid. `draft`: an
    `Eagle3Draft` (features: the target's fused layers) or an `EagleDraft` (the target's last feature)."""
    parts = Parts(draft)
    attn = parts.attn
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    rep = nh // nkv
    b, t = tokens.shape
    embeds = draft.embed_tokens(tokens)
    rot = draft.rotary
    keys, values, outs = [], [], []
    g = parts.first(features)
    idx = torch.arange(t)
    key_ok = valid.view(b, 1, 1, t)
    for k in range(steps):
        if k > 0:
            g = _shift(outs[-1], 1, dim=1)
        x, base = parts.level_input(embeds, g)
        q = rot(_heads(attn.q_proj(x), nh, hd), positions)
        kk = rot(_heads(attn.k_proj(x), nkv, hd), positions).repeat_interleave(rep, dim=1)
        vv = _heads(attn.v_proj(x), nkv, hd).repeat_interleave(rep, dim=1)
        keys.append(kk)
        values.append(vv)
        scale = 1.0 / math.sqrt(hd)
        s0 = (q @ keys[0].transpose(-1, -2)) * scale  # (B, nh, T, T) against the committed (level-0) entries
        allowed = (idx.view(1, t) <= idx.view(t, 1) - k).view(1, 1, t, t) & key_ok
        s0 = s0.masked_fill(~allowed, float("-inf"))
        diag = [((q * _shift(keys[m], k - m)).sum(-1) * scale).masked_fill((idx < k - m).view(1, 1, t), float("-inf"))
                for m in range(1, k + 1)]  # (B, nh, T): the level-m ancestor at i-k+m
        scores = torch.cat([s0] + [d.unsqueeze(-1) for d in diag], dim=-1)
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype).nan_to_num(0.0)
        y = p[..., :t] @ values[0]
        for m in range(1, k + 1):
            y = y + p[..., t + m - 1].unsqueeze(-1) * _shift(values[m], k - m)
        a = attn.o_proj(y.transpose(1, 2).reshape(b, t, nh * hd))
        outs.append(parts.finish(base, a))
    return outs


def sparse_soft_ce(logits: torch.Tensor, idx: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (R, V) against a distribution given as its support idx (R, k) and probabilities
    prob (R, k) summing to 1: logsumexp(logits) - sum_j prob_j * logits[idx_j] (a top-k index may repeat where
    it was clamped; its probability is then 0)."""
    return torch.logsumexp(logits, -1) - (torch.gather(logits, 1, idx) * prob).sum(-1)


def level_losses(draft: Eagle3Draft, batch: dict, steps: int) -> tuple[torch.Tensor, list[dict]]:
    """The weighted training loss and, per level, (loss sum, agreement count, rows) for the log."""
    outs = ttt_forward(draft, batch["tokens"], batch["positions"], batch["features"], batch["valid"], steps)
    parts = Parts(draft)
    t = batch["tokens"].shape[1]
    total, stats = 0.0, []
    for k, out in enumerate(outs):
        rows = batch["loss_mask"] & (torch.arange(t) >= k).view(1, t)
        if not bool(rows.any()):
            stats.append({"loss": 0.0, "agree": 0, "rows": 0})
            continue
        logits = parts.draft_logits(out[rows]).float()  # (R, Vd)
        idx, prob = batch["target_idx"][rows], batch["target_prob"][rows]  # (R, k): the target's top-k
        loss = sparse_soft_ce(logits, idx, prob)
        n = int(rows.sum())
        total = total + STEP_WEIGHT ** k * loss.mean()
        best = torch.gather(idx, 1, prob.argmax(-1, keepdim=True)).squeeze(1)  # the target's top token in vocab
        agree = int((logits.detach().argmax(-1) == best).sum())
        stats.append({"loss": float(loss.detach().sum()), "agree": agree, "rows": n})
    return total, stats


# -- the run ---------------------------------------------------------------------------------------------------

class _Log:
    def __init__(self, path: Path, echo=True, name: str = "eagle3"):
        self.path, self.echo, self.name = path, echo, name

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def held_windows(shards: dict[int, dict], window: int, count: int) -> list[Window]:
    """The held-out windows a run is scored on: `count` of every window of `shards`, drawn with a fixed seed."""
    ws = []
    for i, s in shards.items():
        ws += windows(s["seq_lens"].tolist(), s["seq_source"].tolist(), i, window)
    return random.Random(1).sample(ws, min(count, len(ws)))


def load_init(path: Path, target_cfg: dict) -> dict:
    """What a fine-tune starts from: a run's folder (its `ckpt.pt`) or a drafter as shipped or installed (the
    folder with `config.json` and `model.safetensors`: `LlamaForCausalLMEagle3` with its `d2t`, or the EAGLE layout
    with `draft_vocab.safetensors`), as {"model", "draft_ids", "config": {"kind", "intermediate_size"},
    "positions"}. A shipped checkpoint's head (if it carries one) is dropped: the head trains frozen on the
    target's rows unless a run's checkpoint says otherwise."""
    path = Path(path)
    if (path / "ckpt.pt").exists():
        return torch.load(path / "ckpt.pt", weights_only=False)
    if not (path / "model.safetensors").exists() or not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: neither a training run (ckpt.pt) nor a drafter (config.json and "
                                f"model.safetensors)")
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    arch = (cfg.get("architectures") or [""])[0]
    if arch == "LlamaForCausalLMEagle3":
        kind, draft_ids = "eagle3", state["d2t"].long() + torch.arange(len(state["d2t"]))
    elif arch == "LlamaForCausalLMEagle" and (path / "draft_vocab.safetensors").exists():
        kind = "eagle"
        draft_ids = load_file(str(path / "draft_vocab.safetensors"))["draft_ids"].long()
    else:
        raise ValueError(f"{path}: a {arch or 'drafter of no architecture'} checkpoint; a fine-tune starts from an "
                         f"EAGLE-3 drafter or an EAGLE drafter with its draft_vocab.safetensors")
    inter = int(cfg.get("intermediate_size", target_cfg["intermediate_size"]))
    positions = 0
    if (path / "training.json").exists():
        record = json.loads((path / "training.json").read_text())
        own = record.get("self_distilled")
        positions = int(record.get("positions", 0)) + (int(own["positions"]) if isinstance(own, dict) else 0)
    return {"model": {k: v.float() if v.is_floating_point() else v for k, v in state.items()
                      if not k.startswith("lm_head")},
            "draft_ids": draft_ids, "positions": positions,
            "config": {"kind": kind, "intermediate_size": 0 if inter == target_cfg["intermediate_size"] else inter}}


def load_weights(draft: torch.nn.Module, model: dict, source) -> None:
    """`model` into `draft`; every trained weight must be there (the embedding, the head and the rotary tables
    come from the target)."""
    missing, unexpected = draft.load_state_dict(model, strict=False)
    shared = ("embed_tokens.", "lm_head.", "head.", "rotary.")
    missing = [k for k in missing if not k.startswith(shared)]
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not fit this drafter (missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]})")


def _hms(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def new_drafter(target_cfg: dict, capture: tuple[int, ...], draft_ids: torch.Tensor, cfg: TrainConfig,
                target=None) -> torch.nn.Module:
    """A fresh drafter of `cfg.kind` sharing the target's embedding and (frozen unless `train_head`) output rows."""
    shape = LlamaShape.from_config_dict({**target_cfg, "num_hidden_layers": 1,
                                         "intermediate_size": cfg.intermediate_size or target_cfg["intermediate_size"]})
    torch.manual_seed(cfg.seed)
    if cfg.kind == "eagle":
        draft = EagleDraft(shape, draft_ids)
        init_weights(draft, std=0.02)
        torch.nn.init.ones_(draft.layers[0].post_attention_layernorm.weight)
        if target is not None:
            draft.share_target(target)
        draft.embed_tokens.weight.requires_grad_(False)
        return draft
    draft = Eagle3Draft(shape, draft_ids, capture)
    init_weights(draft, std=0.02)
    for n in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.midlayer.post_attention_layernorm,
              draft.norm):
        torch.nn.init.ones_(n.weight)
    if target is not None:
        draft.target_shared({})
        draft.share_target(target)
        with torch.no_grad():  # the head reads the target's output rows: start at the target's final-norm scale
            draft.norm.weight.copy_(target.model.norm.weight)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(cfg.train_head)
    return draft


def _batches(ws: list[Window], batch_tokens: int, rng: random.Random) -> list[list[Window]]:
    """Windows grouped by length into batches of about batch_tokens padded positions, in random order."""
    ws = sorted(ws, key=lambda w: w.length)
    out, cur = [], []
    for w in ws:
        if cur and (len(cur) + 1) * max(cur[-1].length, w.length) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(w)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def evaluate(draft, shards: dict[int, dict], ws: list[Window], t2d_index, steps: int,
             features: str = "aux_hidden_states") -> dict:
    """Held-out agreement (draft argmax == target argmax within the draft vocabulary) per level and, at level 0,
    per source; plus the loss per level."""
    per_level = [{"loss": 0.0, "agree": 0, "rows": 0} for _ in range(steps)]
    per_source: dict[str, list[int]] = {}
    with torch.no_grad():
        for w in ws:
            batch = batch_of(shards[w.shard], [w], t2d_index, features)
            _, stats = level_losses(draft, batch, steps)
            for acc, s in zip(per_level, stats):
                for key in acc:
                    acc[key] += s[key]
            src = per_source.setdefault(SOURCES[w.source], [0, 0])
            src[0] += stats[0]["agree"]
            src[1] += stats[0]["rows"]
    return {"agreement": [round(s["agree"] / max(1, s["rows"]), 4) for s in per_level],
            "loss": [round(s["loss"] / max(1, s["rows"]), 4) for s in per_level],
            "rows": [s["rows"] for s in per_level],
            "depth1_agreement_by_source": {k: round(a / max(1, n), 4) for k, (a, n) in sorted(per_source.items())}}


def train(data: Path, model_dir: Path, run_dir: Path, cfg: TrainConfig, threads: int = 0, save_every_s: float = 120.0,
          echo: bool = True, max_batches: int | None = None, held_out: list[Path] | None = None,
          draft_ids: torch.Tensor | None = None, init_from: Path | None = None) -> dict:
    """Train (or resume) a run; returns the summary. `max_batches` stops early (tests). `held_out` evaluates on
    those shards and trains on every shard of `data`; `draft_ids` fixes the draft vocabulary (the ablation gives
    its runs one held-out set and one vocabulary). `init_from` (another run's folder) starts a new run from that
    run's weights and vocabulary, with a fresh optimizer and schedule: a fine-tune (say on the target's own answers
    after fixed text)."""
    from ..model.load import load_target

    if threads:
        torch.set_num_threads(threads)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = _Log(run_dir / "train.log", echo, cfg.kind)
    files = shard_files(data)
    recipe = json.loads((Path(data) / "recipe.json").read_text())
    capture = tuple(recipe["capture_layers"])
    target = load_target(model_dir)
    target_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    train_files, held_files = (files, list(held_out)) if held_out else split(files)
    ckpt_path = run_dir / "ckpt.pt"
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None and state["config"] != asdict(cfg):
        log(f"resuming with the checkpoint's configuration {state['config']} (the command line's differs)")
        cfg = TrainConfig(**state["config"])
    init = None
    if state is None and init_from is not None:
        init = load_init(init_from, target_cfg)
        if init["config"]["kind"] != cfg.kind or init["config"]["intermediate_size"] != cfg.intermediate_size:
            raise ValueError(f"{init_from} holds a {init['config']['kind']} drafter (intermediate size "
                             f"{init['config']['intermediate_size']}); this run trains {cfg.kind} "
                             f"({cfg.intermediate_size}): start from a run of the same kind and size")
        if draft_ids is not None and not torch.equal(draft_ids, init["draft_ids"]):
            raise ValueError(f"{init_from} has another draft vocabulary than the one asked")
    if state is not None:
        draft_ids = state["draft_ids"]
    elif init is not None:
        draft_ids = init["draft_ids"]
    elif draft_ids is None:
        draft_ids = draft_vocabulary(train_files, cfg.draft_vocab, target.shape.vocab_size)
    draft = new_drafter(target_cfg, capture, draft_ids, cfg, target)
    t2d_index = torch.full((target.shape.vocab_size,), -1, dtype=torch.int64)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    order = list(range(len(train_files)))
    rng.shuffle(order)
    cursor = {"epoch": 0, "shard": 0, "batch": 0}
    done_positions, spent = 0, 0.0
    if state is not None:
        draft.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        order, cursor = state["order"], state["cursor"]
        done_positions, spent = state["positions"], state["seconds"]
        log(f"resumed at {done_positions} positions, {_hms(spent)} spent")
    elif init is not None:
        load_weights(draft, init["model"], init_from)
        log(f"starting from {init_from}'s weights ({init['positions']} positions trained there)")
    held_shards = {i: load_shard(f) for i, f in enumerate(held_files)}
    held = held_windows(held_shards, cfg.window, cfg.eval_windows)
    if len(files) == 1 and not held_out:
        log("one shard only: evaluating on windows of the training shard (a smoke run)")
    total_positions = cfg.positions or sum(
        int(json.loads(_meta(f)["positions"])) for f in train_files)
    budget = cfg.minutes * 60.0
    log(f"{len(train_files)} training shards ({total_positions} positions planned), {len(held_files)} held out; "
        f"draft vocabulary {len(draft_ids)}; {sum(p.numel() for p in params)} trained parameters; levels {cfg.steps}; "
        f"budget {cfg.minutes:g} min; {torch.get_num_threads()} threads; run dir {run_dir}")

    def progress() -> float:
        return min(1.0, max(done_positions / max(1, total_positions), (spent + time.time() - t_start) / budget))

    def lr_at(f: float) -> float:
        if f < cfg.warmup:
            return cfg.lr * f / cfg.warmup
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (f - cfg.warmup) / (1 - cfg.warmup))))

    def save() -> None:
        tmp = ckpt_path.with_name("ckpt.pt.tmp")
        torch.save({"model": {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")
                              and (cfg.train_head or not k.startswith("lm_head"))},
                    "optimizer": opt.state_dict(), "order": order, "cursor": cursor, "positions": done_positions,
                    "seconds": spent + time.time() - t_start, "config": asdict(cfg), "draft_ids": draft_ids}, tmp)
        tmp.replace(ckpt_path)

    t_start = time.time()
    last_save = last_log = time.time()
    window_stats = [{"loss": 0.0, "agree": 0, "rows": 0} for _ in range(cfg.steps)]
    batches_run, finished = 0, False
    while not finished:
        shard_no = order[cursor["shard"]]
        shard = load_shard(train_files[shard_no])
        ws = windows(shard["seq_lens"].tolist(), shard["seq_source"].tolist(), shard_no, cfg.window)
        plan = _batches(ws, cfg.batch_tokens, random.Random(f"{cfg.seed}/{cursor['epoch']}/{shard_no}"))
        while cursor["batch"] < len(plan):
            group = plan[cursor["batch"]]
            f = progress()
            if f >= 1.0 or (max_batches is not None and batches_run >= max_batches):
                finished = True
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(f)
            batch = batch_of(shard, group, t2d_index, FEATURES[cfg.kind])
            loss, stats = level_losses(draft, batch, cfg.steps)
            if torch.is_tensor(loss):  # a batch without supervised positions (prompt text only) trains nothing
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                opt.step()
            cursor["batch"] += 1
            batches_run += 1
            done_positions += sum(w.length for w in group)
            for acc, s in zip(window_stats, stats):
                for key in acc:
                    acc[key] += s[key]
            now = time.time()
            if now - last_log > 30 or batches_run == 1:
                f = progress()
                el = spent + now - t_start
                eta = el * (1 - f) / max(f, 1e-6)
                acc = "/".join(f"{s['agree'] / max(1, s['rows']):.3f}" for s in window_stats)
                los = "/".join(f"{s['loss'] / max(1, s['rows']):.3f}" for s in window_stats)
                log(f"{100 * f:5.1f}% {done_positions}/{total_positions} positions, lr {lr_at(f):.2e}, "
                    f"agreement per level {acc}, loss {los}; {done_positions / max(1e-6, el):.0f} positions/s, "
                    f"elapsed {_hms(el)}, ETA {_hms(eta)}")
                window_stats = [{"loss": 0.0, "agree": 0, "rows": 0} for _ in range(cfg.steps)]
                last_log = now
            if now - last_save > save_every_s:
                save()
                last_save = now
        if not finished:
            cursor["shard"] += 1
            cursor["batch"] = 0
            if cursor["shard"] >= len(order):
                cursor["shard"] = 0
                cursor["epoch"] += 1
                rng = random.Random(f"{cfg.seed}/order/{cursor['epoch']}")
                rng.shuffle(order)
    save()
    result = evaluate(draft.eval(), held_shards, held, t2d_index, cfg.steps, FEATURES[cfg.kind])
    summary = {"data": str(data), "model": str(model_dir), "config": asdict(cfg), "positions": done_positions,
               "init_from": str(init_from) if init_from is not None else None,
               "seconds": round(spent + time.time() - t_start, 1), "train_shards": len(train_files),
               "held_out_shards": [f.name for f in held_files], "held_out_windows": len(held),
               "capture_layers": list(capture), "draft_vocab": len(draft_ids), "held_out": result}
    target_info = {"name": target_cfg.get("_name_or_path") or Path(model_dir).name}
    from ..model.load import target_fingerprint

    target_info["fingerprint"] = target_fingerprint(target)
    if cfg.kind == "eagle":
        shipped_bytes = export_eagle(draft, run_dir / "shipped", target_cfg, target_info)
        shutil.copytree(run_dir / "shipped", run_dir / "sglang", dirs_exist_ok=True)
    else:
        export(draft, run_dir / "sglang", target_cfg, with_head=True, extra_config={"target": target_info})
        export(draft, run_dir / "shipped", target_cfg, with_head=cfg.train_head, extra_config={"target": target_info})
        shipped_bytes = sum(v.numel() * v.element_size() for v in checkpoint_state(draft, cfg.train_head).values())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"done: {done_positions} positions in {_hms(summary['seconds'])}; held-out agreement per level "
        f"{result['agreement']}, depth 1 by source {result['depth1_agreement_by_source']}; "
        f"checkpoints in {run_dir / 'sglang'} (SGLang) and {run_dir / 'shipped'} (bf16, {shipped_bytes} bytes)")
    return summary


def export_eagle(draft: EagleDraft, out_dir: Path, target_cfg: dict, target_info: dict) -> int:
    """An EAGLE drafter in the layout the shipped one has (SGLang's `LlamaForCausalLMEagle`, the embedding and the
    head the target's, `draft_vocab.safetensors` the draft vocabulary); returns the weights' bytes."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in target_cfg.items() if k not in ("_model_name_or_path", "transformers_version")}
    cfg.update({"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1, "tie_word_embeddings": False,
                "draft_vocab_size": int(draft.head.draft_ids.numel()), "target": target_info})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
             if k != "embed_tokens.weight" and not k.startswith("rotary")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    vocab = {"draft_ids": draft.head.draft_ids.to(torch.int32).contiguous()}
    save_file(vocab, str(out_dir / "draft_vocab.safetensors"))
    return sum(v.numel() * v.element_size() for v in state.values())


def score(init: Path, model_dir: Path, held: list[Path], cfg: TrainConfig) -> dict:
    """The drafter in `init` (shipped folder or run) on the held-out shards, with the windows `train` evaluates on."""
    import torch

    from ..model.load import load_target

    target = load_target(model_dir)
    target_cfg = json.loads((model_dir / "config.json").read_text())
    state = load_init(init, target_cfg)
    capture = tuple(json.loads((held[0].parent / "recipe.json").read_text())["capture_layers"])
    draft = new_drafter(target_cfg, capture, state["draft_ids"], cfg, target)
    load_weights(draft, state["model"], init)
    t2d = torch.full((target.shape.vocab_size,), -1, dtype=torch.int64)
    t2d[state["draft_ids"]] = torch.arange(len(state["draft_ids"]))
    shards = {i: load_shard(f) for i, f in enumerate(held)}
    ws = held_windows(shards, cfg.window, cfg.eval_windows)
    return evaluate(draft.eval(), shards, ws, t2d, cfg.steps, FEATURES[cfg.kind])


def kinds_and_model(args) -> tuple[list[str], Path] | None:
    """`--kinds` (drafter kinds, comma-separated) and `--model` (prepared on first use) checked; None (the error
    printed) where either is wrong."""
    from ..model.prepare import PrepareError, resolve_model

    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(FEATURES):
        print(f"error: --kinds takes {', '.join(FEATURES)} (comma-separated), got {args.kinds!r}", file=sys.stderr)
        return None
    try:
        return kinds, resolve_model(args.model, log=lambda m: print(m, file=sys.stderr))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--data", type=Path, required=True, help="a fixed-data set's folder (shard-*.safetensors)")
    p.add_argument("--model", type=Path, default=None, help="the target's model directory (default: the data's)")
    p.add_argument("--run", default="smollm2", help="run name: $ENTMTP_CACHE/eagle3/<run>/ (resumed if present)")
    p.add_argument("--run-dir", type=Path, default=None, help="the run's folder instead of $ENTMTP_CACHE/eagle3/<run>")
    for name in ("steps", "window", "batch_tokens", "draft_vocab", "positions", "seed", "eval_windows",
                 "intermediate_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "warmup", "weight_decay", "clip", "minutes"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--kind", choices=tuple(FEATURES), default=d.kind,
                   help="eagle3 (default) or eagle: the EAGLE drafter over the target's last feature")
    p.add_argument("--train-head", action="store_true", help="train the draft-vocabulary head (default: frozen)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--save-every-s", type=float, default=120.0)
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (a smoke run)")
    p.add_argument("--init", type=Path, default=None,
                   help="another run's folder: start from its weights and vocabulary (a fine-tune)")
    p.add_argument("--held-out", type=Path, default=None,
                   help="a shard folder to evaluate on (then every shard of --data trains; default: --data's last)")


def run(args) -> int:
    from ..model.prepare import cache_root

    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
    model = args.model or Path(json.loads((args.data / "recipe.json").read_text())["model"])
    run_dir = args.run_dir or cache_root() / cfg.kind / args.run
    held = shard_files(args.held_out) if args.held_out else None
    train(args.data, model, run_dir, cfg, args.threads, args.save_every_s, max_batches=args.max_batches,
          held_out=held, init_from=args.init)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.eagle3_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
