"""The `System` interface every benchmarked decoder implements, and the registry that names them.

A system is one way of generating text (an engine plus a tree policy, or an outside library). The
harness only ever calls the methods below, so a new engine is one module that subclasses `System` and
registers factories; nothing else changes. `sglang_systems.py` is such a module (four SGLang servers):

    from entmtp_sglang.bench.systems import RequestOutcome, System, register_system

    @register_system("sglang-eagle", engine="sglang", description="SGLang static EAGLE tree")
    def _sglang_eagle(ctx):
        return SGLangSystem(ctx, EAGLE_STATIC)   # registered in prepare(), started on first use, stopped in close()

and the module is listed in `SYSTEM_MODULES` (imported when the registry is first read).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterator

# modules that register systems when imported; a new engine adds its module here
SYSTEM_MODULES = ("entmtp_sglang.bench.reference", "entmtp_sglang.bench.hf", "entmtp_sglang.bench.sglang_systems")


@dataclass(frozen=True)
class Stream:
    """One benchmark stream: the prompt token ids of its requests, served one after another.

    Ordinary tasks have one segment per stream. The mixed agent-style task has three (prose, JSON,
    code turns of one session); every turn's prompt already holds the earlier turns and replies, and a
    system keeps its policy state across a stream's turns."""

    segments: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]  # the same prompts as text (for systems that take text)
    source_ids: tuple[str, ...]  # prompt-set item ids, for the record


@dataclass(frozen=True)
class TaskStreams:
    task: str
    streams: tuple[Stream, ...]

    def __len__(self) -> int:
        return len(self.streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(self.streams)

    def head(self, n: int) -> "TaskStreams":
        return TaskStreams(self.task, self.streams[:n])


@dataclass
class RequestOutcome:
    """What one request (one segment of one stream) cost and produced.

    `seconds` is the request's share of the wall time of the batched call that served it (call time
    divided by the requests in the call), so summing it over requests gives the wall time; tokens/s
    of a system = sum(len(output_ids)) / sum(seconds)."""

    stream: int  # index in TaskStreams
    segment: int
    output_ids: list[int]
    steps: int  # target verification passes after prefill
    accepted_drafts: int  # drafted tokens accepted over all steps
    verified_tokens: int | None  # tokens the target scored in those passes (tree nodes, root included); None
    # when the engine does not report it (SGLang --speculative-adaptive: the depth of each step is internal)
    seconds: float
    call_seconds: float  # wall time of the whole batched call (the request's latency)
    trees: dict[str, int] = field(default_factory=dict)  # tree name -> steps that used it
    policy_seconds: float | None = None  # time inside the tree chooser; None when not measurable
    # per step: (draft entropy in nats, chosen tree depth, accepted drafts); empty when not recorded
    trace: list[tuple[float, int, int]] = field(default_factory=list)


class System(ABC):
    """A decoder under test.

    Attributes
        name        registry name (also the table column)
        engine      "reference", "transformers", "sglang", ...: which implementation runs it
        baseline    name of the plain-decoding system of the same engine; speedups are ratios to it,
                    measured in the same run (a faster or slower engine does not flatter its policy)
        description one line for --help and the report

    Life cycle, per benchmark run:
        prepare(streams, batch_sizes, max_new_tokens)   once per task, untimed (load models, start a
                                                        server, record hindsight data, warm up)
        run(streams, batch_size, max_new_tokens)        timed; may be called many times
        close()                                         once at the end, also after an error or Ctrl-C
    record() -> dict                                    what the JSON lines should keep about it (optional)
    """

    name: str = ""
    engine: str = ""
    baseline: str = ""
    description: str = ""

    def supports(self, batch_size: int) -> str | None:
        """None if the system can serve this batch size, else the reason it cannot."""
        return None

    def prepare(self, streams: TaskStreams, batch_sizes: tuple[int, ...], max_new_tokens: int) -> None:
        """Untimed set-up for this task (the streams are the most any batch size will use)."""

    @abstractmethod
    def run(self, streams: TaskStreams, batch_size: int, max_new_tokens: int) -> list[RequestOutcome]:
        """Generate greedily for every segment of every stream, `batch_size` streams at a time
        (segment j of each stream in the batch is one batched call), at most `max_new_tokens` per
        request, and return one RequestOutcome per (stream, segment)."""

    def close(self) -> None:
        """Release what prepare() acquired (must be safe to call more than once)."""

    def record(self) -> dict:
        """Settings and facts for the run's JSON line (server arguments, start-up time, ...)."""
        return {}


@dataclass(frozen=True)
class SystemSpec:
    name: str
    engine: str
    description: str
    factory: Callable[["object"], System]


_REGISTRY: dict[str, SystemSpec] = {}
_LOADED = False


class SystemError_(ValueError):
    """A system name or a registration that cannot be used."""


def register_system(name: str, engine: str, description: str):
    """Decorator for a factory `f(ctx) -> System`; checks the name is new and the product conforms."""
    if not name or any(c.isspace() or c == "," for c in name):
        raise SystemError_(f"system name {name!r} must be non-empty, without spaces or commas")

    def deco(factory):
        if name in _REGISTRY:
            raise SystemError_(f"system {name!r} is registered twice")

        def checked(ctx) -> System:
            system = factory(ctx)
            if not isinstance(system, System):
                raise SystemError_(f"factory of {name!r} returned {type(system).__name__}, not a System")
            system.name, system.engine = name, engine
            system.description = system.description or description
            if not system.baseline:
                raise SystemError_(f"system {name!r} names no baseline (its engine's plain decoding)")
            return system

        _REGISTRY[name] = SystemSpec(name, engine, description, checked)
        return factory

    return deco


def registry() -> dict[str, SystemSpec]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in SYSTEM_MODULES:
            importlib.import_module(mod)
    return dict(_REGISTRY)


def make_system(name: str, ctx) -> System:
    reg = registry()
    if name not in reg:
        raise SystemError_(f"unknown system {name!r}; choose from {', '.join(reg)}")
    return reg[name].factory(ctx)
