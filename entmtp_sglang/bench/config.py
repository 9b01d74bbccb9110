"""Benchmark configuration (no torch import here, so `entmtp --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from .systems import registry
from .workload import TASKS

ENGINES = ("reference", "transformers", "sglang")
SGLANG_SYSTEMS = ("sglang-plain", "sglang-eagle", "sglang-adaptive", "sglang-entmtp")


# The defaults are the full run, `entmtp bench` (README: its table and duration): every system of the three
# engines, all tasks, batch 1, 8 and 32, 4 streams per task at batch 1, 16 new tokens, prompts cut to their
# last 256 tokens, 2 interleaved repeats, the oracle up to batch 8 (its hindsight recording of 32 streams
# per task is the slowest set-up step). Sized to finish in about 25 minutes on this 2-core machine.
@dataclass(frozen=True)
class BenchConfig:
    tasks: tuple[str, ...] = TASKS
    systems: tuple[str, ...] = ("plain", "static-medusa", "static-hydra", "eagle2-hydra", "adaptive-hydra",
                                "entmtp-medusa", "entmtp-hydra", "oracle-medusa",
                                "oracle-hydra", "hf-greedy", "hf-prompt-lookup") + SGLANG_SYSTEMS
    engines: tuple[str, ...] | None = None  # only the systems of these engines run (--engines); None: all
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    repeats: int = 2
    max_new_tokens: int = 16
    prompts: int = 4  # streams per task at batch 1 (at batch b: max(prompts, b) streams, b at a time)
    threads: int = 1  # torch CPU threads (0 = torch's choice); see the --threads help
    cost_steps: int = 6  # engine steps timed per tree and batch size for the cost measurements
    cost_rounds: int = 2
    oracle_max_batch: int = 8  # 0: the oracle runs at every batch size; else only up to this one
    max_prompt_tokens: int = 256  # 0: prompts keep as many last tokens as the context allows
    warmup: bool = True  # one short untimed call per system and batch size before timing
    name: str = "full"
    model_dir: str | None = None

    def __post_init__(self):
        if not self.tasks or not self.systems or not self.batch_sizes:
            raise ValueError("need at least one task, one system and one batch size")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(TASKS)}")
        known = registry()
        bad = [s for s in self.systems if s not in known]
        if bad:
            raise ValueError(f"unknown system(s) {', '.join(bad)}; choose from {', '.join(known)}")
        if self.engines is not None:
            have = sorted({spec.engine for spec in known.values()}, key=lambda e: (e not in ENGINES, e))
            bad = [e for e in self.engines if e not in have]
            if bad or not self.engines:
                raise ValueError(f"unknown engine(s) {', '.join(bad) or '(none)'}; choose from {', '.join(have)}")
        if not self.run_systems():
            raise ValueError(f"no system of engine(s) {', '.join(self.engines or ())} among "
                             f"{', '.join(self.systems)}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch sizes must be >= 1")
        if self.repeats < 1 or self.prompts < 1 or self.max_new_tokens < 2:
            raise ValueError("need repeats >= 1, prompts >= 1 and max_new_tokens >= 2")

    def run_systems(self) -> tuple[str, ...]:
        """The systems that run: those of `systems` whose engine is one of `engines`."""
        known = registry()
        return tuple(s for s in self.systems if self.engines is None or known[s].engine in self.engines)

    def streams_at(self, batch_size: int) -> int:
        return max(self.prompts, batch_size)


# --quick: all tasks at batch 1 and 32 with the Hydra drafter's systems (the oracle at batch 1 only: its
# hindsight recording of 32 streams per task is the slowest set-up step), 16 new tokens, prompts cut to
# their last 256 tokens, 2 repeats. The SGLang systems are listed but their engine is off by default (four
# servers take minutes to start on 2 cores, which would break the 10-minute budget): `--quick --engines
# sglang` runs them alone with the same settings.
QUICK = dict(repeats=2, max_new_tokens=16, prompts=2, batch_sizes=(1, 32), cost_steps=3, name="quick",
             oracle_max_batch=1, max_prompt_tokens=256, engines=("reference", "transformers"),
             systems=("plain", "static-hydra", "eagle2-hydra", "adaptive-hydra", "entmtp-hydra", "oracle-hydra",
                      "hf-greedy", "hf-prompt-lookup") + SGLANG_SYSTEMS)


# --quick's side-by-side (issue 39), run after the quick run itself: on SmolLM2 (a real model, where the linear
# layers' speed on the processor at hand decides the reference engine's pace), at batch 1, the reference engine's
# plain decoding and EntMTP beside transformers' generate, plain and with prompt lookup, every output compared
# across engines. A regression of the reference engine against transformers (a slower linear path on one kind of
# processor) shows in the next quick run. Code, chat and JSON prompts and the mixed session (three turns), 2 streams
# each, 16 new tokens, 2 repeats, one torch thread as the quick run: 12 requests per system and repeat (SmolLM2 is
# prepared on first use, `entmtp model prepare smollm2`; bench/README.md gives the time it took).
SIDE_BY_SIDE_MODEL = "smollm2"
SIDE_BY_SIDE = dict(tasks=("code", "chat", "json", "mixed"), systems=("plain", "entmtp-hydra", "hf-greedy",
                                                                       "hf-prompt-lookup"),
                    engines=("reference", "transformers"), batch_sizes=(1,), repeats=2, max_new_tokens=16, prompts=2,
                    cost_steps=3, oracle_max_batch=1, max_prompt_tokens=256, name="quick_side_by_side")


def side_by_side_config(model: str = SIDE_BY_SIDE_MODEL, threads: int | None = None) -> BenchConfig:
    """The side-by-side run of `--quick` on `model` (default SmolLM2)."""
    return BenchConfig(**SIDE_BY_SIDE, model_dir=None if model == "entmtp-tiny" else model,
                       **({} if threads is None else {"threads": threads}))
