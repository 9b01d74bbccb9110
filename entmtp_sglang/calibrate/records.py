"""Calibration records from the reference engine: at every position of greedily decoded calibration prompts,
the drafter's entropy, top-1 margin and top probabilities for the next positions, the target's entropy, and
the rank vector of the true continuation (`tree.records.PositionRecord`); saved next to the tree set."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.engine import Engine, static_chooser
from ..model.load import Bundle
from ..policy.signals import entropy_nats, top_margin, top_probs
from ..tree import Tree
from ..tree.records import PositionRecord


@dataclass(frozen=True)
class CalibrationConfig:
    drafter: str
    task: str
    num_prompts: int = 24
    max_new_tokens: int = 96
    max_depth: int = 5
    max_rank: int = 6
    num_bins: int = 4
    batch_size: int = 8
    max_trees: int = 8
    window: int = 8

    def __post_init__(self):
        if self.num_prompts < 1 or self.max_new_tokens < 2:
            raise ValueError("need at least one prompt and two new tokens")
        if not 1 <= self.max_depth <= 16 or not 1 <= self.max_rank <= 32:
            raise ValueError("max_depth must be in 1..16 and max_rank in 1..32")
        if self.num_bins < 1:
            raise ValueError("num_bins must be >= 1")


def _ranks(logits: torch.Tensor, true: torch.Tensor, max_rank: int) -> torch.Tensor:
    """Rank of true[b] in logits[b] (number of strictly larger logits), capped at max_rank."""
    valid = true >= 0
    own = logits.gather(1, true.clamp(min=0).view(-1, 1))
    rank = (logits > own).sum(1)
    return torch.where(valid, rank.clamp(max=max_rank), torch.full_like(rank, max_rank))


def record_positions(bundle: Bundle, prompts: list[list[int]], cfg: CalibrationConfig, progress=None,
                     make_grammars=None) -> list[PositionRecord]:
    """`make_grammars(indices)`, if given, returns fresh `RequestGrammar`s (or None) for those prompts:
    decoding is then constrained and ranks and entropies are taken after the grammar mask."""
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    out: list[PositionRecord] = []
    plain = Tree.chain(0)
    for start in range(0, len(prompts), cfg.batch_size):
        batch = prompts[start:start + cfg.batch_size]
        idx = list(range(start, start + len(batch)))
        grammars = make_grammars(idx) if make_grammars else None
        outputs = [r.output_ids for r in engine.generate(batch, cfg.max_new_tokens, static_chooser(plain),
                                                         grammars=grammars)]
        grammars = make_grammars(idx) if make_grammars else [None] * len(batch)
        rows: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        plens = [len(p) for p in batch]

        def observer(state, lens, drafting, active):
            k = min(cfg.max_depth, drafting.max_depth)
            true = torch.full((len(batch), k), -1, dtype=torch.int64)
            for i in range(len(batch)):
                g = int(lens[i]) - plens[i]
                cont = outputs[i][g + 1:g + 1 + k]
                true[i, :len(cont)] = torch.tensor(cont, dtype=torch.int64)
            logits = drafting.path_logits(state, true)
            for i, g in enumerate(grammars):
                if g is not None and active[i]:  # rank among the tokens the grammar allows
                    for d in range(k):
                        prefix = [t for t in true[i, :d].tolist() if t >= 0]
                        logits[d][i] = logits[d][i].masked_fill(~g.path_mask(prefix), float("-inf"))
            ranks = torch.stack([_ranks(logits[d], true[:, d], cfg.max_rank) for d in range(k)], 1)
            ent, margin = entropy_nats(logits[0]), top_margin(logits[0])
            top = torch.stack([top_probs(logits[d], cfg.max_rank) for d in range(k)], 1)  # (B, k, max_rank)
            for i in range(len(batch)):
                if active[i]:
                    probs = tuple(tuple(round(p, 3) for p in row) for row in top[i].tolist())
                    rows[(i, int(lens[i]) - plens[i])] = (float(ent[i]), float(margin[i]), tuple(ranks[i].tolist()),
                                                          probs)

        results = engine.generate(batch, cfg.max_new_tokens, static_chooser(plain), observer=observer,
                                  grammars=grammars)
        for i, r in enumerate(results):
            assert r.output_ids == outputs[i], "greedy decoding is not deterministic"
            for s, step in enumerate(r.steps):
                d_ent, margin, ranks, probs = rows[(i, s)]
                out.append(PositionRecord(start + i, s, d_ent, step.target_entropy[0], ranks, margin, probs))
        if progress is not None:
            progress.update(len(batch))
    return out


def records_file(path: Path) -> Path:
    """The calibration records at `path` (`X.records.jsonl`), or their gzipped form `X.records.jsonl.gz` (how a
    checkout ships the bundled model's) when only that exists."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


def save_records(records: list[PositionRecord], path: Path) -> None:
    """One JSON array per file; gzipped when `path` ends in .gz."""
    rows = [[r.prompt, r.pos, round(r.draft_entropy, 4), round(r.target_entropy, 4), list(r.ranks),
             round(r.draft_margin, 4)]
            + ([[[round(1000 * p) for p in d] for d in r.draft_probs]] if r.draft_probs else [])
            for r in records]
    text = json.dumps(rows, separators=(",", ":"))
    path = Path(path)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def load_records(path: Path) -> list[PositionRecord]:
    # [prompt, pos, draft entropy, target entropy, ranks(, draft margin(, draft probs per mille))]: older files
    # lack the margin or the per-depth probabilities
    path = records_file(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [PositionRecord(row[0], row[1], row[2], row[3], tuple(row[4]), *row[5:6],
                           *([_probs(row[6])] if len(row) > 6 else []))
            for row in json.loads(text)]


def _probs(rows) -> tuple[tuple[float, ...], ...]:
    """Per-depth draft probabilities as saved: integers per mille (floats in files written before)."""
    return tuple(tuple(p / 1000 if isinstance(p, int) else float(p) for p in d) for d in rows)
