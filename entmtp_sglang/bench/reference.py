"""Systems on the reference engine: the same target and drafter weights, only the tree policy differs.

    plain            one token per target pass, no drafter at all
    static-<d>       the drafter's default static tree, built the Medusa/Hydra way: per-head top-k
                     accuracy on the calibration records, best of 4/8/16/32 nodes by measured cost
    eagle2-<d>       EAGLE-2 style dynamic tree: draft a wide 48-node candidate tree, verify the nodes
                     with the best cumulative draft confidence, as many as the default static tree has
    adaptive-<d>     SGLang's --speculative-adaptive rule (EMA of accepted length picks the chain depth)
    entmtp-<d>       EntMTP (policy.EntMTPPolicy) on the task's shipped tree set, plus "no speculation"
                     (chain:0), with tree costs measured on this machine at start-up for each batch size
                     of the run: one tree per step for the whole batch, acceptance feedback; no drafter
                     at all at a batch size where no tree in any signal bin is expected to beat plain
                     decoding, or where EntMTP ran slower than plain on the task's calibration prompts
    oracle-<d>       the best tree of that same set at every step, in hindsight (the ceiling)
    static-<d>-spans, entmtp-<d>-spans
                     the same with spans (`Engine.generate(forced_spans=...)`): below every leaf of a request's
                     tree, and after its root on a step that rests the drafter, its own text repeating (lookup
                     spans) and, under a grammar, the text the grammar decides; verified like any draft, as ENTMTP
                     does inside SGLang by default

<d> is medusa, hydra, eagle or eagle3 (SmolLM2's EAGLE-3, whose tree sets only SmolLM2 ships): the model's drafter of
that kind, with its calibrated tree sets (EAGLE's: the mixed task's on the bundled model, every task's on SmolLM2).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter

import torch

from ..calibrate.costs import fit_step_cost
from ..calibrate.records import CalibrationConfig, load_records, record_positions, records_file
from ..drafting import DRAFTER_KINDS
from ..engine.engine import Engine, static_chooser
from ..model.load import load_bundle
from ..policy.chooser import StepView
from ..policy.eagle2 import Eagle2Policy
from ..policy.policies import AdaptiveEMAPolicy, OraclePolicy, StaticPolicy, entmtp_policy
from ..policy.registry import POLICIES
from ..policy.selector import speculation_pays
from ..tasks import TASKS as PROMPT_TASKS
from ..tasks import load_prompts
from ..tree import Tree
from ..tree.construct import accepted_on, independent_tree
from ..tree.treeset import TreeEntry, TreeSet, load_tree_set, shipped_tree_set
from .systems import RequestOutcome, System, TaskStreams, register_system
from .workload import MIXED_TURNS, BenchContext, room

MAX_DEPTH = 5  # drafted positions used by every speculative system (the Medusa/Hydra heads have 5)
MAX_RANK = 6
EAGLE2_WIDE_NODES = 48
DEFAULT_TREE_SIZES = (4, 8, 16, 32)


class NoDrafter(torch.nn.Module):
    """Stands in for a drafter in plain decoding: proposes nothing and costs nothing."""

    max_depth = 0

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def head_logits(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        return torch.zeros(feature.shape[:-1] + (self.vocab_size,), dtype=feature.dtype)


class TimedChooser:
    """Wraps a tree chooser: time spent inside it and the depth chosen, per request of the batch."""

    def __init__(self, inner, batch: int):
        self.inner = inner
        self.seconds = [0.0] * batch
        self.depths: list[list[int]] = [[] for _ in range(batch)]
        if hasattr(inner, "rests"):  # the engine looks the hooks up on the chooser it is given
            self.rests = self._rests
        if getattr(inner, "staged", False):
            self.staged, self.restage = True, inner.restage

    def _rests(self, active: list[int]) -> bool:
        t0 = time.perf_counter()
        rest = self.inner.rests(active)
        dt = (time.perf_counter() - t0) / max(1, len(active))
        for i in active:
            self.seconds[i] += dt
            if rest:
                self.depths[i].append(0)
        return rest

    def observe(self, *args) -> None:
        """The engine's per-step observer, forwarded to a batch-aware chooser; its time is policy time."""
        t0 = time.perf_counter()
        self.inner.observe(*args)
        dt = (time.perf_counter() - t0) / len(self.seconds)
        self.seconds = [s + dt for s in self.seconds]

    def __call__(self, view: StepView):
        t0 = time.perf_counter()
        tree = self.inner(view)
        self.seconds[view.index] += time.perf_counter() - t0
        self.depths[view.index].append(tree.max_depth)
        return tree


class Resources:
    """Models, default trees, measured costs and hindsight records, shared by the reference systems."""

    def __init__(self, ctx: BenchContext):
        self.ctx = ctx
        self.bundles: dict[str, object] = {}
        self.engines: dict[str, Engine] = {}
        self._default: dict[str, Tree] = {}
        self._acc: dict[str, list[list[float]]] = {}
        self._records: dict[str, list] = {}
        self._costs: dict[tuple, float] = {}
        self._plain_costs: dict[int, float] = {}  # batch size -> seconds per plain-decoding step
        self._sets: dict[tuple, TreeSet] = {}
        self._ranks: dict[tuple, dict] = {}

    @classmethod
    def of(cls, ctx: BenchContext) -> "Resources":
        return ctx.get("reference", lambda: cls(ctx))

    # -- models ---------------------------------------------------------------------------------
    def bundle(self, drafter: str = "medusa"):
        if drafter not in self.bundles:
            self.bundles[drafter] = load_bundle(self.ctx.model_dir, drafter)
        return self.bundles[drafter]

    def max_depth(self, drafter: str) -> int:
        """The deepest draft position the drafter provides (at most MAX_DEPTH)."""
        return min(MAX_DEPTH, getattr(self.bundle(drafter).drafter, "max_depth", MAX_DEPTH))

    def engine(self, drafter: str | None) -> Engine:
        key = drafter or "plain"
        if key not in self.engines:
            b = self.bundle(drafter or "medusa")
            if drafter is None:
                self.engines[key] = Engine(b.target, "medusa", NoDrafter(b.target.shape.vocab_size),
                                           b.eos_token_id)
            else:
                self.engines[key] = Engine(b.target, drafter, b.drafter, b.eos_token_id)
        return self.engines[key]

    @property
    def model_name(self) -> str:
        return self.bundle().path.name

    @property
    def tokenizer(self):
        return self.bundle().tokenizer

    @property
    def context_tokens(self) -> int:
        return self.bundle().target.shape.max_position_embeddings

    def plain_generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        res = self.engine(None).generate(prompts, max_new_tokens, static_chooser(Tree.chain(0)))
        return [r.output_ids for r in res]

    def calib_prompts(self, n: int = 4) -> list[list[int]]:
        """Prompts for timing tree costs: HumanEval calibration problems, last 300 tokens (or the cap)."""
        keep = min(300, self.ctx.max_prompt_tokens or 300)
        tok = self.tokenizer
        return [tok.item_ids(it, keep) for it in load_prompts("code", "calib", n)]

    # -- default static tree (Medusa/Hydra construction) -----------------------------------------
    def head_accuracy(self, drafter: str) -> list[list[float]]:
        """P(rank of the true token at depth k == r), over the calibration records of every task."""
        if drafter not in self._acc:
            records = []
            for t in PROMPT_TASKS:
                path = records_file(shipped_tree_set(drafter, t, self.model_name).with_suffix(".records.jsonl"))
                if path.exists():
                    records += load_records(path)
            if not records:  # an installed wheel ships no records: decode a few calibration prompts
                keep = room(self.context_tokens, 64)
                prompts = [self.tokenizer.item_ids(it, keep)
                           for t in PROMPT_TASKS for it in load_prompts(t, "calib", 2)]
                cfg = CalibrationConfig(drafter, "mix", len(prompts), 64, max_depth=MAX_DEPTH, max_rank=MAX_RANK)
                records = record_positions(self.bundle(drafter), prompts, cfg)
            acc = [[0.0] * MAX_RANK for _ in range(min(MAX_DEPTH, len(records[0].ranks)))]
            for r in records:
                for d, rank in enumerate(r.ranks[: len(acc)]):
                    if rank < MAX_RANK:
                        acc[d][rank] += 1 / len(records)
            self._acc[drafter] = acc
            self._records[drafter] = records
        return self._acc[drafter]

    def default_tree(self, drafter: str) -> Tree:
        """As bench/policies.py: the independent-heads tree of 4/8/16/32 nodes with the most expected
        tokens per second (accepted length replayed on the calibration records, cost measured here)."""
        if drafter not in self._default:
            acc = self.head_accuracy(drafter)
            records = self._records[drafter]
            cands = [independent_tree(acc, n, name=f"default:n{n}") for n in DEFAULT_TREE_SIZES]
            self.measure_costs(drafter, cands, 1)
            values = [sum(accepted_on(t, r.ranks) + 1 for r in records) / len(records) / self.cost(drafter, t, 1)
                      for t in cands]
            self._default[drafter] = cands[max(range(len(cands)), key=lambda i: values[i])]
            self.ctx.log(f"[{drafter}] default static tree {self._default[drafter].name}")
        return self._default[drafter]

    # -- costs measured on this machine ----------------------------------------------------------
    def cost(self, drafter: str, tree: Tree, batch_size: int) -> float:
        """Wall time of one engine step with this tree at this batch size (seconds), measured here."""
        key = (drafter, tree.parents, batch_size)
        if key not in self._costs:
            self.measure_costs(drafter, [tree], batch_size)
        return self._costs[key]

    def measure_costs(self, drafter: str, trees: list[Tree], batch_size: int) -> None:
        """Time `cost_steps` engine steps per tree, the trees interleaved, `cost_rounds` times; keep each tree's
        lowest per-round median (other processes on the machine only ever add time)."""
        engine = self.engine(drafter)
        prompts = self.calib_prompts()
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        steps = self.ctx.cost_steps
        unique = {t.parents: t for t in trees}.values()
        todo = [t for t in unique if (drafter, t.parents, batch_size) not in self._costs]
        best: dict[tuple, float] = {}
        for _ in range(self.ctx.cost_rounds):
            for t in todo:
                res = engine.generate(batch, 2 * steps + 2, static_chooser(t))
                times = [s.seconds for s in res[0].steps[1:]] or [s.seconds for s in res[0].steps]
                m = statistics.median(times)
                best[t.parents] = min(best.get(t.parents, m), m)
        for t in todo:
            self._costs[(drafter, t.parents, batch_size)] = best[t.parents]

    def plain_cost(self, batch_size: int) -> float:
        """Wall time of one step of plain decoding (no drafter at all) at this batch size, measured here."""
        key = batch_size
        if key not in self._plain_costs:
            prompts = self.calib_prompts()
            batch = [prompts[i % len(prompts)] for i in range(batch_size)]
            best = None
            for _ in range(self.ctx.cost_rounds):
                res = self.engine(None).generate(batch, 2 * self.ctx.cost_steps + 2, static_chooser(Tree.chain(0)))
                m = statistics.median([s.seconds for s in res[0].steps[1:]] or [s.seconds for s in res[0].steps])
                best = m if best is None else min(best, m)
            self._plain_costs[key] = best
        return self._plain_costs[key]

    def admits(self, drafter: str, task: str, batch_size: int, max_new_tokens: int, make_policy,
               make_spans=None) -> tuple[bool, str]:
        """Whether speculation with `make_policy()` (and the spans of `make_spans()`, where given) beat plain
        decoding, measured: both generate max_new_tokens for max(batch_size, 4) of the task's calibration prompts
        (never the test split), batch_size at a time, interleaved, best of `cost_rounds`. Returns (faster, a note
        with the times).

        Why measure: the per-step prediction misses what a static batch adds. The engine computes every
        row until the batch's slowest request is done, and the drafter's first head costs a step even
        when nothing is drafted, so speculation that pays per step can still lose per batch."""
        keep = min(room(self.context_tokens, max_new_tokens), self.ctx.max_prompt_tokens or 10**9)
        tok = self.tokenizer
        n = max(batch_size, 4)
        parts = MIXED_TURNS if task == "mixed" else (task,)
        items = [it for t in parts for it in load_prompts(t, "calib")]
        prompts = [tok.item_ids(items[i % len(items)], keep) for i in range(n)]
        best = {"plain": float("inf"), "entmtp": float("inf")}
        for _ in range(self.ctx.cost_rounds):
            for name in best:
                t0 = time.perf_counter()
                for start in range(0, n, batch_size):
                    chunk = prompts[start:start + batch_size]
                    if name == "plain":
                        self.engine(None).generate(chunk, max_new_tokens, static_chooser(Tree.chain(0)))
                    else:
                        policy = make_policy()
                        self.engine(drafter).generate(chunk, max_new_tokens, policy, observer=policy.observe,
                                                      forced_spans=make_spans() if make_spans else None)
                best[name] = min(best[name], time.perf_counter() - t0)
        note = (f"measured on {n} calibration prompts: {best['entmtp']:.2f} s vs {best['plain']:.2f} s plain")
        return best["entmtp"] < best["plain"], note

    def cost_model(self, drafter: str, batch_size: int):
        """Seconds per step for any tree: measured for reference shapes, a fitted a + b*nodes + c*depth
        for the rest (chain:0, no speculation, is always measured directly)."""
        key = ("model", drafter, batch_size)
        if key not in self._costs:
            acc = self.head_accuracy(drafter)
            deepest = self.max_depth(drafter)   # SmolLM2's Medusa has 4 heads, the bundled model's 5
            refs = [Tree.chain(d) for d in sorted({0, 1, min(3, deepest), deepest})] + \
                   [independent_tree(acc, n) for n in (8, 16, 32)]
            self.measure_costs(drafter, refs, batch_size)
            samples = [(t, self.cost(drafter, t, batch_size)) for t in refs]
            fit = fit_step_cost([t for t, _ in samples], [c for _, c in samples])
            measured = {t.parents: c for t, c in samples}
            self._costs[key] = lambda t: measured.get(t.parents) or fit(t)
        return self._costs[key]

    # -- tree sets --------------------------------------------------------------------------------
    def tree_set(self, drafter: str, task: str, batch_sizes: tuple[int, ...]) -> TreeSet:
        """The shipped set for (drafter, task) plus chain:0, with costs measured here and now."""
        key = (drafter, task, batch_sizes)
        if key not in self._sets:
            shipped = load_tree_set(shipped_tree_set(drafter, task, self.model_name), drafter=drafter,
                                    max_depth=MAX_DEPTH)
            models = {b: self.cost_model(drafter, b) for b in batch_sizes}
            self._sets[key] = with_measured_costs(shipped, models)
        return self._sets[key]

    # -- hindsight --------------------------------------------------------------------------------
    def ranks(self, drafter: str, streams: TaskStreams, max_new_tokens: int) -> dict:
        """(stream, segment) -> the rank vector of the greedy continuation at every output position.

        Recorded once per task for the most streams asked (later calls with fewer streams reuse it)."""
        key = (drafter, streams.task)
        have = self._ranks.get(key)  # greedy outputs do not depend on max_new_tokens: reuse longer ones
        if have is None or have[0] < len(streams) or have[1] < max_new_tokens:
            flat = [(i, j) for i, s in enumerate(streams) for j in range(len(s.segments))]
            prompts = [list(streams.streams[i].segments[j]) for i, j in flat]
            cfg = CalibrationConfig(drafter, streams.task, len(prompts), max_new_tokens, max_depth=MAX_DEPTH,
                                    max_rank=MAX_RANK, batch_size=32)
            rows: dict[tuple[int, int], list[list[int]]] = {k: [] for k in flat}
            for rec in record_positions(self.bundle(drafter), prompts, cfg):
                rows[flat[rec.prompt]].append(list(rec.ranks))
            self._ranks[key] = (len(streams), max_new_tokens, rows)
        return self._ranks[key][2]


def with_measured_costs(tree_set: TreeSet, cost_models: dict) -> TreeSet:
    """`tree_set` with every tree's cost replaced by `cost_models[batch_size](tree)` (seconds per step
    measured on this machine). chain:0 (no speculation) is in every loaded set; one built in code without
    it gets it here.

    EntMTP's selector then compares (expected accepted + 1) / cost at the live batch size across all
    trees and plain decoding, so it backs off to shallow trees or none when verification gets expensive."""
    entries = list(tree_set.trees)
    if not any(e.tree.num_nodes == 1 for e in entries):
        entries.insert(0, TreeEntry(Tree.chain(0), (0.0,) * tree_set.num_bins, {1: 1.0}))
    entries = [TreeEntry(e.tree, e.expected_accepted, {b: float(m(e.tree)) for b, m in cost_models.items()})
               for e in entries]
    return dataclasses.replace(tree_set, trees=tuple(entries),
                               hardware=f"costs measured at bench start (calibrated on: {tree_set.hardware})")


PLAIN_ONLY = static_chooser(Tree.chain(0))  # a chooser that also tells run() to leave the drafter out


class ReferenceSystem(System):
    """Runs `Engine.generate` with a chooser made per batch (`make_chooser`) and kept across segments."""

    engine = "reference"
    baseline = "plain"
    with_spans = False   # the `-spans` systems: spans below every request's tree (`spans`, made in prepare)
    spans = None

    def __init__(self, ctx: BenchContext, drafter: str | None, spans: bool = False):
        self.res = Resources.of(ctx)
        self.drafter = drafter
        self.batch_sizes: tuple[int, ...] = (1,)
        self.with_spans = spans
        self.spans = None   # the system's ForcedSpans (made in prepare; its acceptance kept across calls)

    def prepare(self, streams: TaskStreams, batch_sizes: tuple[int, ...], max_new_tokens: int) -> None:
        self.batch_sizes = tuple(sorted(set(self.batch_sizes) | set(batch_sizes)))
        self.res.engine(self.drafter)
        if self.with_spans and self.spans is None:
            self.spans = self.new_spans()

    def new_spans(self):
        """A fresh ForcedSpans for this model's tokenizer (its acceptance learned from nothing)."""
        from ..engine.forced import ForcedSpans

        return ForcedSpans.for_tokenizer(self.res.tokenizer)

    def make_chooser(self, streams: TaskStreams, stream_ids: list[int], batch_size: int, max_new_tokens: int):
        """A chooser for these streams; `.segment(j)` (if present) is called before each segment."""
        raise NotImplementedError

    def run(self, streams: TaskStreams, batch_size: int, max_new_tokens: int) -> list[RequestOutcome]:
        out: list[RequestOutcome] = []
        for start in range(0, len(streams), batch_size):
            ids = list(range(start, min(start + batch_size, len(streams))))
            chooser = self.make_chooser(streams, ids, batch_size, max_new_tokens)
            # PLAIN_ONLY: the system decided to decode without its drafter at this batch size
            engine = self.res.engine(None if chooser is PLAIN_ONLY else self.drafter)
            for j in range(len(streams.streams[ids[0]].segments)):
                prompts = [list(streams.streams[i].segments[j]) for i in ids]
                inner = chooser.segment(j) if hasattr(chooser, "segment") else chooser
                timed = TimedChooser(inner, len(ids))
                observer = timed.observe if hasattr(inner, "observe") else None
                t0 = time.perf_counter()
                results = engine.generate(prompts, max_new_tokens, timed, observer=observer,
                                          forced_spans=None if chooser is PLAIN_ONLY else self.spans)
                call = time.perf_counter() - t0
                for k, (i, r) in enumerate(zip(ids, results)):
                    depths = timed.depths[k]
                    trace = [(s.draft_entropy, depths[n] if n < len(depths) else -1, s.accepted)
                             for n, s in enumerate(r.steps)]
                    out.append(RequestOutcome(
                        stream=i, segment=j, output_ids=list(r.output_ids), steps=len(r.steps),
                        accepted_drafts=sum(getattr(s, "accepted_all", s.accepted) for s in r.steps),
                        verified_tokens=sum(s.num_nodes for s in r.steps), seconds=call / len(ids),
                        call_seconds=call, trees=dict(Counter(s.tree for s in r.steps)),
                        policy_seconds=timed.seconds[k], trace=trace))
        return out


class _Plain(ReferenceSystem):
    description = "plain decoding: one token per target pass, no drafter"

    def __init__(self, ctx):
        super().__init__(ctx, None)

    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        return static_chooser(Tree.chain(0))


class _Static(ReferenceSystem):
    def prepare(self, streams, batch_sizes, max_new_tokens):
        super().prepare(streams, batch_sizes, max_new_tokens)
        self.res.default_tree(self.drafter)

    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        return StaticPolicy(self.res.default_tree(self.drafter))


class _Eagle2(ReferenceSystem):
    def prepare(self, streams, batch_sizes, max_new_tokens):
        super().prepare(streams, batch_sizes, max_new_tokens)
        self.policy()

    def policy(self) -> Eagle2Policy:
        # the wide candidate tree and the budget come from the Medusa/Hydra drafter that shares the
        # heads' statistics; for the EAGLE drafter the Hydra statistics stand in (same target)
        stats = self.drafter if self.drafter in ("medusa", "hydra") else "hydra"
        acc = self.res.head_accuracy(stats)
        wide = independent_tree(acc, EAGLE2_WIDE_NODES, name=f"wide:n{EAGLE2_WIDE_NODES}")
        return Eagle2Policy(wide, self.res.default_tree(stats).num_nodes)

    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        return self.policy()


class _Adaptive(ReferenceSystem):
    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        return AdaptiveEMAPolicy(MAX_DEPTH, batch_size)


class _EntMTP(ReferenceSystem):
    def prepare(self, streams, batch_sizes, max_new_tokens):
        super().prepare(streams, batch_sizes, max_new_tokens)
        for b in self.batch_sizes:
            self._speculates(streams.task, b, max_new_tokens)

    def _speculates(self, task: str, batch_size: int, max_new_tokens: int) -> bool:
        """Admission at this batch size, once per run: predicted (`selector.speculation_pays`: some tree
        in some signal bin beats a plain step), then measured (EntMTP faster than plain decoding on the
        task's calibration prompts, see `Resources.admits`)."""
        key = ("entmtp-admits", self.drafter, task, batch_size, max_new_tokens, self.with_spans)
        cache = self.res.ctx.cache
        if key not in cache:
            ts = self.res.tree_set(self.drafter, task, self.batch_sizes)
            if not speculation_pays(ts, batch_size, self.res.plain_cost(batch_size)):
                cache[key], why = False, "no tree is expected to beat a plain step"
            else:
                cache[key], why = self.res.admits(self.drafter, task, batch_size, max_new_tokens,
                                                  lambda: entmtp_policy(ts),
                                                  make_spans=self.new_spans if self.with_spans else None)
            self.res.ctx.log(f"[{self.name or 'entmtp-' + self.drafter}/{task}] batch {batch_size}: "
                             f"{'speculate' if cache[key] else 'plain decoding'} ({why})")
        return cache[key]

    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        if not self._speculates(streams.task, batch_size, max_new_tokens):
            return PLAIN_ONLY
        # run() connects the policy's observer: one tree per step for the whole batch
        return entmtp_policy(self.res.tree_set(self.drafter, streams.task, self.batch_sizes))


class _Oracle(ReferenceSystem):
    def supports(self, batch_size: int) -> str | None:
        limit = self.res.ctx.oracle_max_batch
        return None if not limit or batch_size <= limit else f"oracle limited to batch <= {limit} (--quick)"

    def prepare(self, streams, batch_sizes, max_new_tokens):
        super().prepare(streams, batch_sizes, max_new_tokens)
        self.res.tree_set(self.drafter, streams.task, self.batch_sizes)
        self.res.ranks(self.drafter, streams, max_new_tokens)

    def make_chooser(self, streams, stream_ids, batch_size, max_new_tokens):
        ts = self.res.tree_set(self.drafter, streams.task, self.batch_sizes)
        ranks = self.res.ranks(self.drafter, streams, max_new_tokens)

        class PerSegment:
            def segment(self, j: int):
                rows = [ranks.get((i, j), []) for i in stream_ids]
                lens = [len(streams.streams[i].segments[j]) for i in stream_ids]
                return OraclePolicy(ts, rows, lens)

        return PerSegment()


register_system("plain", "reference", _Plain.description)(_Plain)
_KINDS = {
    "static": (_Static, "default static tree (Medusa/Hydra construction from per-head accuracy)"),
    "eagle2": (_Eagle2, "EAGLE-2 style dynamic tree: wide draft, verify the most confident nodes"),
    "adaptive": (_Adaptive, "SGLang --speculative-adaptive rule (EMA of accepted length -> chain depth)"),
    "entmtp": (_EntMTP, "EntMTP: one tree per step for the batch from every request's signal bin, the "
                        "task's Pareto set plus no speculation, costs measured here, acceptance feedback; "
                        "no drafter when no tree can beat plain decoding at the batch size"),
    "oracle": (_Oracle, "best tree of the EntMTP set at every step, in hindsight (ceiling)"),
}
assert set(_KINDS) <= set(POLICIES), "every reference system kind is a policy of policy/registry.py"
_DRAFTER_NAMES = {k.name: k.display for k in DRAFTER_KINDS.values()}   # every registered drafter kind
for _kind, (_cls, _desc) in _KINDS.items():
    for _drafter, _name in _DRAFTER_NAMES.items():
        register_system(f"{_kind}-{_drafter}", "reference", f"{_desc}; {_name} drafter")(
            lambda ctx, c=_cls, d=_drafter, desc=_desc, n=_name: _with_desc(c(ctx, d), f"{desc}; {n} drafter"))
_SPANS = " (with spans: the request's own text repeating, and a grammar's decided text, below every leaf)"
for _kind in ("static", "entmtp"):
    _cls, _desc = _KINDS[_kind]
    for _drafter, _name in _DRAFTER_NAMES.items():
        register_system(f"{_kind}-{_drafter}-spans", "reference", f"{_desc}; {_name} drafter{_SPANS}")(
            lambda ctx, c=_cls, d=_drafter, desc=_desc, n=_name: _with_desc(c(ctx, d, spans=True),
                                                                            f"{desc}; {n} drafter{_SPANS}"))


def _with_desc(system: System, description: str) -> System:
    system.description = description
    return system

