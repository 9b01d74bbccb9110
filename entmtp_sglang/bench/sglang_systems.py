"""SGLang systems: the same harness, a second engine. Each system is one SGLang 0.5.23 server on this CPU.

    sglang-plain      no speculation (SGLang's own torch_native backend): the SGLang baseline
    sglang-eagle      SGLang's static EAGLE tree, one setting (EAGLE_STATIC below)
    sglang-adaptive   SGLang's --speculative-adaptive (EMA of accepted length picks the draft depth)
    sglang-entmtp     --speculative-algorithm ENTMTP (this package's plugin, its shipped EAGLE tree set)

All four serve the run's model (`entmtp bench --model`) and its EAGLE drafter (the same weights), in float32, with
`--sleep-on-idle`; the server configurations are `entmtp_sglang/bench/sglang_benchmark.py`'s, shared with
`bench/experiments/sglang_cpu.py`. The servers of a run are started together once, on the first timed (warm-up) call,
so they do not disturb the reference engine's cost measurements during set-up, and they are stopped in
`close()`, which the runner calls even on an error or Ctrl-C (and at interpreter exit, and the kernel
stops them if the benchmark process dies: see serve.py).

A call of `run()` at batch b sends segment j of b streams as b concurrent HTTP /generate requests (token
ids, so the server decodes exactly the reference engine's prompt tokens) and waits for all of them, like
one batched call of the reference engine; the radix cache is flushed first so that no measurement reuses
another's prefill. Speedups are against `sglang-plain` in the same repeat, and greedy outputs are checked
against it token for token. Without SGLang installed the systems are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from .sglang_benchmark import (
    ADAPTIVE,
    ENTMTP,
    FLOAT32,
    PLAIN,
    ServerPool,
    SystemSpec,
    concurrent_generate,
    generate_payload,
    spec_counts,
)
from .systems import RequestOutcome, System, TaskStreams, register_system
from .workload import BenchContext

ENGINE = "sglang"
BASELINE = "sglang-plain"
# SGLang's static EAGLE setting: a 3-token chain (num_steps 3, topk 1, 4 verified tokens per step). The
# fastest of the bench/experiments/sglang_cpu.py grid on this CPU (s2-k1-n3, s3-k1-n4, s3-k2-n6); see README.
EAGLE_STATIC = SystemSpec("eagle-s3-k1-n4", "EAGLE", 3, 1, 4)
SPECS = {"sglang-plain": PLAIN, "sglang-eagle": EAGLE_STATIC, "sglang-adaptive": ADAPTIVE,
         "sglang-entmtp": ENTMTP}


def sglang_missing() -> str | None:
    """None when SGLang is importable (checked without importing it), else why the systems are skipped."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (run `make sglang`); the sglang-* systems are skipped"
    return None


def server_pool(ctx: BenchContext) -> ServerPool:
    """The run's one pool of SGLang servers (shared by the four systems through the context)."""
    def make():
        log_dir = Path(tempfile.mkdtemp(prefix="entmtp-bench-sglang-"))
        return ServerPool(log_dir, FLOAT32, progress=ctx.log, model=ctx.model_dir)

    return ctx.get("sglang", make)


def entmtp_tree_set(model_dir: Path | None = None) -> tuple[Path, dict[str, int]]:
    """The tree set the ENTMTP server resolves (ENTMTP_TREE_SET or the shipped one) and each tree's nodes."""
    from ..sglang.config import resolve_tree_set_path
    from ..tree.treeset import load_tree_set

    name = Path(model_dir).name if model_dir else "entmtp-tiny"
    path = resolve_tree_set_path(None, name)
    if path is None:
        raise ValueError(f"no tree set is shipped for model {name!r}: set ENTMTP_TREE_SET=FILE to benchmark it")
    return path, {e.tree.name: e.tree.num_nodes for e in load_tree_set(path).trees}


class SGLangSystem(System):
    engine = ENGINE
    baseline = BASELINE

    def __init__(self, ctx: BenchContext, spec: SystemSpec):
        self.ctx, self.spec = ctx, spec
        self.tree_set, self.tree_nodes = (entmtp_tree_set(ctx.model_dir) if spec.speculative == "ENTMTP"
                                          else (None, None))
        self._missing = sglang_missing()

    def supports(self, batch_size: int) -> str | None:
        return self._missing

    def prepare(self, streams: TaskStreams, batch_sizes: tuple[int, ...], max_new_tokens: int) -> None:
        server_pool(self.ctx).add(self.spec)  # started with the others on the first timed call

    def run(self, streams: TaskStreams, batch_size: int, max_new_tokens: int) -> list[RequestOutcome]:
        if self._missing:
            raise RuntimeError(self._missing)
        pool = server_pool(self.ctx)
        pool.add(self.spec)
        srv = pool[self.spec.name]
        srv.flush_cache()
        out: list[RequestOutcome] = []
        for g in range(0, len(streams), batch_size):
            group = list(enumerate(streams.streams[g:g + batch_size], start=g))
            for j in range(max(len(s.segments) for _, s in group)):
                batch = [(i, s.segments[j]) for i, s in group if j < len(s.segments)]
                outs, call = concurrent_generate(srv, [generate_payload(ids, max_new_tokens) for _, ids in batch],
                                                 len(batch))
                for (i, _), o in zip(batch, outs):
                    c = spec_counts(o, self.spec, self.tree_nodes)
                    out.append(RequestOutcome(
                        stream=i, segment=j, output_ids=list(o["output_ids"]), steps=c.steps,
                        accepted_drafts=c.accepted_drafts, verified_tokens=c.verified_tokens,
                        seconds=call / len(batch), call_seconds=call, trees=c.trees, policy_seconds=None))
        return out

    def record(self) -> dict:
        pool = self.ctx.cache.get("sglang")
        rec = {"server": {"algorithm": self.spec.speculative, "num_steps": self.spec.steps,
                          "eagle_topk": self.spec.topk, "num_draft_tokens": self.spec.draft_tokens,
                          "adaptive": self.spec.adaptive, "attention_backend": self.spec.attention,
                          "dtype": "float32"} if self.spec.speculative else
               {"algorithm": None, "attention_backend": self.spec.attention, "dtype": "float32"}}
        if pool is not None:
            rec["server_start_seconds"] = round(pool.start_seconds, 1) if pool.start_seconds else None
            rec["server_log"] = str(pool.log_dir / f"{self.spec.name}.log")
        if self.tree_set is not None:
            rec["tree_set"] = str(self.tree_set)
        return rec

    def close(self) -> None:
        pool = self.ctx.cache.get("sglang")
        if pool is not None:
            pool.stop()


@register_system("sglang-plain", ENGINE, "SGLang without speculation (torch_native backend): the SGLang baseline")
def _sglang_plain(ctx):
    return SGLangSystem(ctx, SPECS["sglang-plain"])


@register_system("sglang-eagle", ENGINE,
                 f"SGLang static EAGLE tree ({EAGLE_STATIC.name}: num_steps {EAGLE_STATIC.steps}, topk "
                 f"{EAGLE_STATIC.topk}, {EAGLE_STATIC.draft_tokens} draft tokens)")
def _sglang_eagle(ctx):
    return SGLangSystem(ctx, SPECS["sglang-eagle"])


@register_system("sglang-adaptive", ENGINE, "SGLang EAGLE with --speculative-adaptive (EMA picks the depth)")
def _sglang_adaptive(ctx):
    return SGLangSystem(ctx, SPECS["sglang-adaptive"])


@register_system("sglang-entmtp", ENGINE, "SGLang --speculative-algorithm ENTMTP (this plugin, shipped EAGLE set)")
def _sglang_entmtp(ctx):
    return SGLangSystem(ctx, SPECS["sglang-entmtp"])
