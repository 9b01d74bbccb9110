"""Side-by-side SGLang benchmark: no speculation, EAGLE static (a small grid), --speculative-adaptive, ENTMTP.

Every system is the same SGLang build on the same machine with the same prompts: one server per system,
all started before measuring, then measured in turn (interleaved; median tokens/s over repeats), greedy,
at each batch size (batch b = b requests in flight at once, kept full until the prompt list is done).
Reported per system and batch size: output tokens/s (wall clock
over the whole prompt list), mean accepted length (SGLang's `spec_accept_length`: tokens per verify step,
bonus included), and for ENTMTP the histogram of trees chosen. Also checks greedy equality with the
no-speculation server's outputs (float32 keeps ties out; see tests/test_sglang_server.py).

    .venv/bin/python bench/experiments/sglang_cpu.py            # writes bench/results/sglang_cpu.{jsonl,md}

The pieces are shared with `entmtp bench` (entmtp_sglang/bench/sglang_systems.py), which runs the same
server configurations as systems of its harness, on its task streams: `SystemSpec` (a server
configuration), `ServerPool` (start all, stop all, always), `concurrent_generate` (b requests in flight
over HTTP) and `spec_counts` (steps, accepted drafts, verified tokens and trees from a response).

Stock SGLang. Installing this package installs two SGLang plugins: `entmtp` (the general plugin: ENTMTP, the
`entmtp_torch` attention backend and hooks, among them the CPU linear layers of `sglang/cpu/linear.py`, in every
SGLang process, plain servers too) and `entmtp_cpu_ops` (a platform plugin that only supplies the eight
`sgl_kernel` CPU ops SGLang 0.5.23 imports on its CPU path: without them SGLang does not start on a CPU at all,
`ModuleNotFoundError: No module named 'sgl_kernel'`, since PyPI ships sgl-kernel for CUDA only). SGLang's
`SGLANG_PLUGINS` whitelist (sglang/srt/plugins/__init__.py, applied to both entry-point groups) lets a process skip
a plugin, so `STOCK` runs with `SGLANG_PLUGINS=entmtp_cpu_ops`: SGLang's own layers, attention (`torch_native`),
scheduler and sampling, no hook at all; only those bookkeeping ops (KV-slot and draft-slot scatters, no
arithmetic on activations) are ours. SGLang's EAGLE and `--speculative-adaptive` cannot run that way on a CPU:
`torch_native` refuses EAGLE ("EAGLE is not supported in attention backend torch_native") and `intel_amx`, SGLang's
only CPU backend with a draft path, needs a CPU build of sgl-kernel (SGLang falls back to `torch_native` without
it, even on an AMX processor). `sglang_layers(spec)` gives their closest stock form: the plugin loaded for its
attention backend and CPU ops, SGLang's own layers (`SGLANG_LAYERS_ENV`).

Two plain servers with this package: `PLAIN` on SGLang's `torch_native` attention (what the package's layers give
over stock) and `PLAIN_ENTMTP` on the package's `entmtp_torch` attention, the backend ENTMTP and the EAGLE stand-ins
run on, with SGLang's overlap scheduling on as plain SGLang runs it (`cpu_args` passes no
`--disable-overlap-schedule`, SGLang turns overlap off on a CPU only for speculative algorithms, and the plugin only
for ENTMTP): the baseline of what speculation adds (`speculation_baseline`). Both are plain decoding with the
package: the first measured is the reference every output is compared with (`equal_to_plain`), and the other is
compared with it, so the two must agree with each other. A system run in every wave beside the baseline (`every`)
leaves its tokens/s of the same wave and repeat on every other row (`Row.beside`), so a ratio over it is paired
directly (`paired_ratio`, `paired_over`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import gzip
import json
import platform
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..calibrate.server import ServerError, SGLangServer, stop_all
from ..tasks import load_prompts

FLOAT32 = ("--dtype", "float32")  # float32 keeps near-tied argmaxes from flipping between batch shapes
BFLOAT16 = ("--dtype", "bfloat16")   # after the run's --dtype among a server's arguments: the last one counts
STOCK_PLUGINS = "entmtp_cpu_ops"   # SGLANG_PLUGINS for stock SGLang: the sgl_kernel CPU ops only (module docstring)
STOCK_ENV = (("SGLANG_PLUGINS", STOCK_PLUGINS),)
# SGLang's own CPU layers in a process that loads the plugin: sglang/cpu/linear.py hooks nothing when the machine's
# linear path is F.linear (ENTMTP_LINEAR=torch asks for it, ENTMTP_ONEDNN=0 is its older spelling), and
# sglang/cpu/rowwise.py nothing with ENTMTP_ROWWISE=0 (SGLang's own RMSNorm, SiLU-and-mul, rotary embedding)
SGLANG_LAYERS_ENV = (("ENTMTP_LINEAR", "torch"), ("ENTMTP_ONEDNN", "0"), ("ENTMTP_ROWWISE", "0"))


@dataclass(frozen=True)
class SystemSpec:
    """One SGLang server configuration under test (the same build, model and drafter for all)."""

    name: str
    speculative: str | None = None
    steps: int = 3
    topk: int = 1
    draft_tokens: int = 4
    adaptive: bool = False
    attention: str = "entmtp_torch"
    env: tuple[tuple[str, str], ...] = ()   # extra environment (e.g. ENTMTP_TREE_SET)
    args: tuple[str, ...] = ()              # extra server arguments (e.g. --speculative-token-map FILE)
    draft: str = "eagle"                    # the drafter's folder in the model directory

    def server(self, log_dir: Path, device_args: tuple[str, ...], model: Path | None = None) -> SGLangServer:
        kw = {"model": Path(model)} if model else {}
        return SGLangServer.cpu(self.speculative, env=dict(self.env), **kw, steps=self.steps, topk=self.topk,
                                draft_tokens=self.draft_tokens, adaptive=self.adaptive,
                                attention=self.attention, log_path=log_dir / f"{self.name}.log",
                                extra=device_args + self.args, draft=self.draft)

    @property
    def stock(self) -> bool:
        """SGLang without this package's general plugin (`SGLANG_PLUGINS` leaves `entmtp` out): stock SGLang."""
        plugins = dict(self.env).get("SGLANG_PLUGINS")
        return plugins is not None and "entmtp" not in {p.strip() for p in plugins.split(",")}

    @property
    def layers(self) -> str:
        """Whose CPU layers the server runs: "sglang" (stock, or the plugin told to keep SGLang's) or "package"
        (the plugin's: `sglang/cpu/linear.py`, `sglang/cpu/rowwise.py`)."""
        env = dict(self.env)
        return ("sglang" if self.stock or env.get("ENTMTP_LINEAR") == "torch" or env.get("ENTMTP_ONEDNN") == "0"
                else "package")

    @property
    def dtype(self) -> str | None:
        """The dtype this server is told to serve in its own arguments (the last `--dtype` there), or None: the
        run's (`run_workloads`' `dtype`)."""
        at = [i for i, a in enumerate(self.args) if a == "--dtype"]
        return self.args[at[-1] + 1] if at and at[-1] + 1 < len(self.args) else None

    @property
    def static_tree_nodes(self) -> int | None:
        """Tokens the target verifies per step when the tree is fixed (EAGLE static); None otherwise."""
        return self.draft_tokens if self.speculative in ("EAGLE", "NGRAM") and not self.adaptive else None


PLAIN = SystemSpec("plain", None, attention="torch_native")   # plain SGLang with this package installed
# plain SGLang with this package on its entmtp_torch attention, overlap scheduling on: the baseline of what speculation
# adds (the same layers and attention as ENTMTP; module docstring)
PLAIN_ENTMTP = SystemSpec("plain-entmtp", None, attention="entmtp_torch")
STOCK = SystemSpec("plain-stock", None, attention="torch_native", env=STOCK_ENV)   # stock SGLang (module docstring)
# stock SGLang in bfloat16, the dtype SGLang serves SmolLM2 in (`--dtype auto`) and the one a CPU user would run;
# its outputs are its own (a bfloat16 matmul rounds differently): compared with nothing, and nothing with them
STOCK_BF16 = SystemSpec("plain-stock-bf16", None, attention="torch_native", env=STOCK_ENV, args=BFLOAT16)
EAGLE_GRID = (SystemSpec("eagle-s1-k1-n2", "EAGLE", 1, 1, 2),
              SystemSpec("eagle-s2-k1-n3", "EAGLE", 2, 1, 3),
              SystemSpec("eagle-s3-k1-n4", "EAGLE", 3, 1, 4),
              SystemSpec("eagle-s3-k2-n6", "EAGLE", 3, 2, 6))
ADAPTIVE = SystemSpec("eagle-adaptive", "EAGLE", 3, 1, 4, adaptive=True)
# SGLang's own NGRAM (prompt-lookup drafting from a corpus of the text already written, no draft model), as stock runs
# it: 12 draft tokens a step (SGLang's default for NGRAM), its corpus emptied with the radix cache (`flush_cache`); on
# the package's layers and entmtp_torch (stock attention refuses speculative verification on a CPU, as for EAGLE)
NGRAM = SystemSpec("ngram", "NGRAM", draft_tokens=12)
ENTMTP = SystemSpec("entmtp", "ENTMTP")
DEFAULT_SYSTEMS = (PLAIN, *EAGLE_GRID, ADAPTIVE, ENTMTP)


def sglang_layers(spec: SystemSpec) -> SystemSpec:
    """`spec` on SGLang's own CPU linear layers: the closest to stock SGLang that EAGLE and `--speculative-adaptive`
    come on a CPU (they need the plugin's `entmtp_torch` attention; see the module docstring)."""
    env = dict(spec.env)
    env.update(SGLANG_LAYERS_ENV)
    return SystemSpec(spec.name, spec.speculative, spec.steps, spec.topk, spec.draft_tokens, spec.adaptive,
                      spec.attention, tuple(env.items()), spec.args)


class ServerPool:
    """The SGLang servers of one benchmark run: started together, stopped together, whatever happens.

        pool = ServerPool(log_dir)
        pool.add(spec) ...            # register configurations (nothing starts yet)
        with pool:                    # start every registered server at once, wait until all answer
            pool[name].generate(...)  # idle servers sleep (--sleep-on-idle)
        # all stopped here, also on an exception or KeyboardInterrupt

    `stop()` is also registered with `atexit`, and each server dies with the thread that started it
    (serve.py), so no server outlives the benchmark."""

    def __init__(self, log_dir: Path, device_args: tuple[str, ...] = FLOAT32, progress=print,
                 model: Path | None = None, starts_at_once: int | None = None):
        if starts_at_once is not None and starts_at_once < 1:
            raise ValueError(f"starts_at_once must be >= 1, got {starts_at_once}")
        self.log_dir, self.device_args, self.progress = Path(log_dir), tuple(device_args), progress
        self.starts_at_once = starts_at_once  # None: all at once; a few for a model whose loading peaks high
        self.model = model  # None: the bundled model
        self.specs: dict[str, SystemSpec] = {}
        self.servers: dict[str, SGLangServer] = {}
        self.start_seconds: float | None = None
        self.started: list[tuple[str, int, int]] = []  # (name, pid = process group, port) of every start
        self._atexit = False

    def add(self, spec: SystemSpec) -> None:
        if self.specs.get(spec.name, spec) != spec:
            raise ValueError(f"two SGLang configurations are both named {spec.name!r}")
        self.specs[spec.name] = spec

    def start(self) -> "ServerPool":
        """Start every registered server not yet running (in parallel) and wait until each answers."""
        todo = [s for s in self.specs.values() if s.name not in self.servers]
        if not todo:
            return self
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        step = self.starts_at_once or len(todo)
        try:
            for k in range(0, len(todo), step):
                wave = todo[k:k + step]
                for spec in wave:
                    model = (self.model,) if self.model else ()
                    srv = spec.server(self.log_dir, self.device_args, *model).start(wait=False)
                    self.servers[spec.name] = srv
                    proc = getattr(srv, "proc", None)
                    self.started.append((spec.name, proc.pid if proc is not None else -1, getattr(srv, "port", -1)))
                for spec in wave:
                    srv = self.servers[spec.name]
                    srv.wait_ready()
                    srv.generate("warm up", 8)
                    self.progress(f"SGLang {spec.name} ready (log {srv.log_path})")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = (self.start_seconds or 0.0) + time.perf_counter() - t0
        return self

    def __getitem__(self, name: str) -> SGLangServer:
        srv = self.servers.get(name)
        if srv is None:
            self.start()
            srv = self.servers[name]
        if not srv.running:
            raise ServerError(f"SGLang server {name} has exited:\n{srv.log_tail()}")
        return srv

    def only(self, specs) -> "ServerPool":
        """Up: exactly the servers of `specs` (one wave of `waves`): the others stopped and forgotten, the new ones
        started, each that stays kept running."""
        keep = {s.name for s in specs}
        for name in [n for n in self.specs if n not in keep]:
            self.retire(name)
        for spec in specs:
            self.add(spec)
        return self.start()

    def retire(self, name: str) -> None:
        """Stop one server and forget its configuration (the next `start` does not bring it back)."""
        self.specs.pop(name, None)
        srv = self.servers.pop(name, None)
        if srv is not None:
            srv.stop()

    def stop(self) -> None:
        servers, self.servers = self.servers, {}
        stop_all(servers.values())

    def __enter__(self) -> "ServerPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def concurrent_generate(srv: SGLangServer, requests: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Send `requests` (/generate payloads) with at most `concurrency` in flight, kept full until the list
    is done; return the responses in order and the wall time of the whole list."""
    with cf.ThreadPoolExecutor(max(1, min(concurrency, len(requests)))) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda r: srv.post("/generate", r), requests))
        return outs, time.perf_counter() - t0


def generate_payload(prompt: str | list[int], max_new: int) -> dict:
    """Greedy /generate payload from text or token ids."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    return {key: prompt if isinstance(prompt, str) else list(prompt),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}}


@dataclass(frozen=True)
class SpecCounts:
    """What one response says about speculation (SGLang's meta_info, plus ENTMTP's fields)."""

    steps: int  # target verification passes after the prefill (decode steps for plain decoding)
    accepted_drafts: int  # drafted tokens accepted over all steps (bonus tokens excluded)
    verified_tokens: int | None  # tokens the target scored in those passes; None when not reported
    trees: dict[str, int]  # tree name -> steps that used it (ENTMTP: its choices; EAGLE static: one)
    accepted_per_step: list[int]  # ENTMTP only: accepted drafts at each step


def spec_counts(out: dict, spec: SystemSpec, tree_nodes: dict[str, int] | None = None) -> SpecCounts:
    """Read a /generate response. `tree_nodes` maps ENTMTP tree names to node counts (the served set's)."""
    m = out["meta_info"]
    trees = list(m.get("entmtp_trees") or [])
    per_step = [int(x) for x in m.get("entmtp_accepted") or []]
    verify = int(m.get("spec_verify_ct") or 0)
    if spec.speculative is None:
        steps = max(0, int(m["completion_tokens"]) - 1)  # the prefill yields the first token
        return SpecCounts(steps, 0, steps, {}, [])
    if spec.speculative == "ENTMTP":  # its own per-step record (empty when the prefill already finished it)
        nodes = tree_nodes or {}
        known = all(t in ("plain", "rest") or t in nodes for t in trees)
        verified = sum(1 if t in ("plain", "rest") else nodes[t] for t in trees) if known else None
        accepted = int(m["spec_num_correct_drafts"]) if "spec_num_correct_drafts" in m else sum(per_step)
        return SpecCounts(len(trees), accepted, verified, dict(collections.Counter(trees)), per_step)
    accepted = int(m.get("spec_num_correct_drafts") or 0)
    nodes = spec.static_tree_nodes
    verified = verify * nodes if nodes else (0 if verify == 0 else None)
    return SpecCounts(verify, accepted, verified, {spec.name: verify} if nodes and verify else {}, [])


@dataclass
class Row:
    """One system at one batch size: tokens and wall seconds (one repeat, or the median repeat)."""

    system: str
    batch: int
    tokens: int
    seconds: float
    accept_lengths: list[float] = field(default_factory=list)
    trees: collections.Counter = field(default_factory=collections.Counter)
    equal_to_plain: int | None = None   # outputs equal to plain SGLang's with this package (the same layers)
    requests: int = 0
    repeat_tokens_per_s: list[float] = field(default_factory=list)
    task: str = ""
    # the baseline's tokens/s measured beside each repeat (same wave, same repeat; the baseline is stock SGLang
    # when the run has it, else plain decoding); empty: the baseline's own repeats
    plain_repeat_tokens_per_s: list[float] = field(default_factory=list)
    equal_to_stock: int | None = None   # outputs equal to stock SGLang's (STOCK); None: no stock run to compare
    # a workload whose requests carry labels (the mixed batch: each request's task): label -> trees its requests'
    # steps took (ENTMTP's meta_info, one tree name per step per request)
    trees_by_label: dict[str, collections.Counter] = field(default_factory=dict)
    # ENTMTP's forced spans (meta_info["entmtp_forced"], summed over the outputs): [steps with a span, forced tokens
    # verified, of them accepted]; None when no output reports spans
    forced: list[int] | None = None
    # lookup spans, the same from meta_info["entmtp_lookup"]: [steps with one, guessed repeats verified, accepted]
    lookup: list[int] | None = None
    # the requests' prompt tokens and, of them, those SGLang's radix cache served (meta_info's cached_tokens)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # system -> its tokens/s beside each repeat (same wave, same repeat) for each system other than the baseline that
    # runs in every wave (`run_workloads`' `every`: plain SGLang with the package on entmtp_torch); empty for those
    # systems themselves and in older runs
    beside: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def forced_summary(self) -> str:
        """The forced spans' share of the output tokens, their acceptance and mean length (tokens verified per
        span); empty without spans."""
        parts = []
        for what, counts in (("", self.forced), ("repeats: ", self.lookup)):
            if counts and counts[0]:
                spans, verified, accepted = counts
                parts.append(f"{what}{accepted / max(self.tokens, 1):.0%} of tokens, "
                             f"{accepted / max(verified, 1):.0%} accepted, {verified / spans:.1f} a span")
        return "; ".join(parts)

    @property
    def mean_accept(self) -> float | None:
        return statistics.mean(self.accept_lengths) if self.accept_lengths else None


def bench_prompts(per_task: int) -> list[str]:
    """Text prompts for this script (`entmtp bench` instead sends the token ids of its task streams)."""
    out = []
    for task in ("code", "chat", "math", "prose", "json"):
        out += [it["prompt"][-600:] for it in load_prompts(task, "test", per_task)]
    return out


def run(systems=DEFAULT_SYSTEMS, batches=(1, 8), per_task: int = 3, max_new: int = 64, repeats: int = 3,
        log_dir: Path = Path("runs/sglang-bench"), dtype: str = "float32", progress=print,
        on_repeat=None, model: Path | None = None, starts_at_once: int | None = None,
        at_once: int | None = None) -> list[Row]:
    """All servers up at once (idle ones sleep; at most `at_once` of them, in `waves`), measurements interleaved:
    for each repeat, each batch size, each system in turn; tokens/s is the median over repeats, so load from
    elsewhere hits all alike."""
    payloads = [generate_payload(p, max_new) for p in bench_prompts(per_task)]
    return run_workloads(systems, {"": (payloads, tuple(batches))}, repeats, log_dir, dtype, progress, on_repeat,
                         model, starts_at_once, at_once)


def default_baseline(systems) -> str | None:
    """The system every ratio divides by: stock SGLang when the run has it, else the first system without
    speculation (plain decoding); None when there is none."""
    systems = list(systems)
    ref = (next((s for s in systems if s.speculative is None and getattr(s, "stock", False)), None)
           or next((s for s in systems if s.speculative is None), None))
    return ref.name if ref is not None else None


def waves(systems, at_once: int | None, every: tuple[str, ...] | None = None) -> list[list]:
    """The order servers come up in when no more than `at_once` fit in memory together: the systems named in
    `every` (default: the baseline, `default_baseline`) in every wave, the others `at_once - len(every)` at a time,
    in the order given. One wave holding everything when they all fit (`at_once` None or large enough)."""
    systems = list(systems)
    if at_once is None or len(systems) <= at_once:
        return [systems]
    if every is None:
        base = default_baseline(systems)
        if base is None:
            raise ValueError("more systems than fit at once, and none without speculation to pair each wave with")
        every = (base,)
    fixed = [s for s in systems if s.name in every]
    if len(fixed) != len(set(every)):
        missing = sorted(set(every) - {s.name for s in fixed})
        raise ValueError(f"systems to run in every wave are not in the run: {', '.join(missing)}")
    if at_once <= len(fixed):
        raise ValueError(f"at_once must be >= {len(fixed) + 1} ({', '.join(s.name for s in fixed)} in every wave and "
                         f"one system under test), got {at_once}")
    rest = [s for s in systems if s.name not in every]
    k = at_once - len(fixed)
    return [[*fixed, *rest[i:i + k]] for i in range(0, len(rest), k)]


def run_workloads(systems, workloads: dict[str, tuple[list[dict], tuple[int, ...]]], repeats: int = 3,
                  log_dir: Path = Path("runs/sglang-bench"), dtype: str = "float32", progress=print,
                  on_repeat=None, model: Path | None = None, starts_at_once: int | None = None,
                  at_once: int | None = None, baseline: str | None = None,
                  every: tuple[str, ...] | None = None, flush: bool = False,
                  shuffle_seed: int | None = None) -> list[Row]:
    """`run` over named workloads: task -> (/generate payloads, batch sizes). For each repeat, each task, each
    batch size, each system in turn, the baseline first; every output is compared with plain decoding's with this
    package (`equal_to_plain`) and with stock SGLang's (`equal_to_stock`) on the same payloads, where the run has
    them.

    `baseline`: the system every paired ratio divides by (default `default_baseline`: stock SGLang when the run has
    it, else plain decoding). `at_once`: the most servers up together (memory). With more systems than that they run
    in `waves`: the baseline (and the others named in `every`) stays up and is measured again in every wave, and
    each system's paired ratio divides by the baseline's tokens/s in the same wave and repeat; the tokens/s of the
    others named in `every` (measured right after the baseline, in `every`'s order in the systems) in the same wave
    and repeat go on each later system's row too (`Row.beside`), so a ratio over them pairs the same way. Plain
    decoding with this package: the first such system measured is every output's reference, and any other is
    compared with it (`measure`). `on_repeat(rows, done)` after each repeat of each wave (`done`: repeats finished
    over all waves).

    `flush`: empty each server's radix cache before each measured pass, so no pass reuses an earlier one's prefill
    (a repeat of the same prompts would otherwise run from the cache). `shuffle_seed`: the servers of a wave are
    measured in a new random order in each repeat and workload (seeded: the order is the run's), instead of the
    baseline first; the outputs are compared once the round has run, the references first, so every row is still
    compared with plain's and stock's of the same round or an earlier one. A paired ratio still pairs the runs of
    one round (`Row.beside`, `plain_repeat_tokens_per_s`)."""
    systems = list(systems)
    labels = {task: (w[2] if len(w) > 2 else None) for task, w in workloads.items()}
    baseline = baseline or default_baseline(systems)
    if baseline is not None and baseline not in {s.name for s in systems}:
        raise ValueError(f"the baseline {baseline!r} is not one of the systems run")
    pool = ServerPool(log_dir, ("--dtype", dtype), progress, model=model, starts_at_once=starts_at_once)
    keys = [(task, b) for task, w in workloads.items() for b in w[1]]
    runs: dict[tuple[str, str, int], list[Row]] = collections.defaultdict(list)
    partners: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    beside: dict[tuple[str, str, int], dict[str, list[float]]] = collections.defaultdict(dict)
    reference: dict[tuple[str, int], list] = {}
    owners: dict[tuple[str, int], str] = {}
    stock: dict[tuple[str, int], list] = {}
    plan = waves(systems, at_once, every or ((baseline,) if baseline else None))
    fixed = set(every or ()) - {baseline}   # run in every wave beside the baseline: each other row keeps their runs
    try:
        for w, wave in enumerate(plan):
            pool.only(wave)
            if len(plan) > 1:
                progress(f"wave {w + 1}/{len(plan)}: {', '.join(s.name for s in wave)}")
            # the baseline first, then the others of every wave, then the rest, each as given (the order outputs
            # are compared in; measured in it too unless shuffled)
            order = sorted(wave, key=lambda s: (s.name != baseline, s.name not in fixed))
            for rep in range(repeats):
                for t, (task, b) in enumerate(keys):
                    timed = order
                    if shuffle_seed is not None:
                        timed = list(order)
                        random.Random(f"{shuffle_seed}/{w}/{rep}/{t}").shuffle(timed)
                    done = {}
                    for spec in timed:
                        if flush:
                            pool[spec.name].flush_cache()
                        done[spec.name] = timed_pass(pool[spec.name], spec, workloads[task][0], b, task, labels[task])
                    base_tps = done[baseline][0].tokens_per_s if baseline in done else None
                    fixed_tps = {n: done[n][0].tokens_per_s for n in (s.name for s in order) if n in fixed}
                    for spec in order:
                        row, ids = done[spec.name]
                        compare(spec, row, ids, reference, stock, owners)
                        runs[(spec.name, task, b)].append(row)
                        if spec.name != baseline and base_tps is not None:
                            partners[(spec.name, task, b)].append(round(base_tps, 2))
                        # the others of every wave: their runs of this round beside each system after them in
                        # the order (the baseline none, one of them those before it)
                        ahead = [] if spec.name == baseline else list(fixed_tps)
                        if spec.name in ahead:
                            ahead = ahead[:ahead.index(spec.name)]
                        for name in ahead:
                            beside[(spec.name, task, b)].setdefault(name, []).append(round(fixed_tps[name], 2))
                        progress(f"repeat {rep} {task or 'all'} {spec.name} batch {b}: {row.tokens_per_s:.1f} tok/s, "
                                 f"accept {row.mean_accept or 0:.2f}, equal to plain {row.equal_to_plain}, to stock "
                                 f"{row.equal_to_stock} of {row.requests}")
                if on_repeat is not None:
                    on_repeat(medians(runs, systems, keys, partners, beside), w * repeats + rep + 1)
    finally:
        pool.stop()
    return medians(runs, systems, keys, partners, beside)


def measure(srv: SGLangServer, spec: SystemSpec, payloads: list[dict], batch: int,
            reference: dict[tuple[str, int], list], task: str = "",
            stock: dict[tuple[str, int], list] | None = None, labels: list[str] | None = None,
            owners: dict[tuple[str, int], str] | None = None) -> Row:
    """`payloads` (/generate) through `srv` with `batch` requests in flight: one Row. Plain decoding's outputs with
    this package (token ids) become `reference[(task, batch)]`, stock SGLang's `stock[(task, batch)]` (the first
    run of each is kept); every other system's are compared with them (`equal_to_plain`, `equal_to_stock`), and
    each of the two with the other. `owners` (given: `run_workloads` passes it) records which plain system made
    each reference, and another plain system with this package (PLAIN on torch_native beside PLAIN_ENTMTP) is then
    compared with it too, so the two plain servers must agree; without `owners` no plain system is compared with
    the reference. `labels` (one per payload): the trees each label's requests took (`Row.trees_by_label`)."""
    row, ids = timed_pass(srv, spec, payloads, batch, task, labels)
    compare(spec, row, ids, reference, stock, owners)
    return row


def timed_pass(srv: SGLangServer, spec: SystemSpec, payloads: list[dict], batch: int, task: str = "",
               labels: list[str] | None = None) -> tuple[Row, list]:
    """`payloads` through `srv` with `batch` requests in flight: the Row (no comparison yet) and the outputs' token
    ids (`measure`, or `compare` once the references have run)."""
    if labels is not None and len(labels) != len(payloads):
        raise ValueError(f"{len(labels)} labels for {len(payloads)} payloads")
    outs, secs = concurrent_generate(srv, payloads, batch)
    row = Row(spec.name, batch, sum(o["meta_info"]["completion_tokens"] for o in outs), secs,
              requests=len(outs), task=task)
    for i, o in enumerate(outs):
        m = o["meta_info"]
        row.prompt_tokens += int(m.get("prompt_tokens") or 0)
        row.cached_tokens += int(m.get("cached_tokens") or 0)
        if m.get("spec_verify_ct"):
            row.accept_lengths.append(m["spec_accept_length"])
        row.trees.update(m.get("entmtp_trees", []))
        for key, attr in (("entmtp_forced", "forced"), ("entmtp_lookup", "lookup")):
            spans = m.get(key) or []
            if spans:
                total = getattr(row, attr) or [0, 0, 0]
                setattr(row, attr, [total[0] + len(spans), total[1] + sum(int(v) for v, _ in spans),
                                    total[2] + sum(int(a) for _, a in spans)])
        if labels is not None and m.get("entmtp_trees"):
            row.trees_by_label.setdefault(labels[i], collections.Counter()).update(m["entmtp_trees"])
    return row, [o["output_ids"] for o in outs]


def compare(spec: SystemSpec, row: Row, ids: list, reference: dict[tuple[str, int], list],
            stock: dict[tuple[str, int], list] | None = None, owners: dict[tuple[str, int], str] | None = None) -> None:
    """`row`'s outputs (`ids`) against the references of its task and batch, and into them where `spec` makes one
    (`measure`'s docstring). Called in an order that puts the references first (`run_workloads`)."""
    if getattr(spec, "dtype", None) is not None:
        # a server in a dtype of its own (stock in bfloat16) has no plain server to match: its first run is its own
        # reference, and every later repeat is compared with it (`equal_to_plain`: greedy decoding repeats itself)
        own = (row.task, row.batch, spec.name)
        if own in reference:
            row.equal_to_plain = sum(x == y for x, y in zip(ids, reference[own]))
        else:
            reference[own] = ids
        return
    task, batch = row.task, row.batch
    key, is_stock = (task, batch), getattr(spec, "stock", False)
    plain, stock_plain = spec.speculative is None and not is_stock, spec.speculative is None and is_stock
    if plain:
        reference.setdefault(key, ids)
        if owners is not None:
            owners.setdefault(key, spec.name)
    elif stock_plain and stock is not None:
        stock.setdefault(key, ids)
    if key in reference and (not plain or (owners is not None and owners.get(key, spec.name) != spec.name)):
        row.equal_to_plain = sum(x == y for x, y in zip(ids, reference[key]))
    if stock is not None and key in stock and not stock_plain:
        row.equal_to_stock = sum(x == y for x, y in zip(ids, stock[key]))


def medians(runs, systems, keys, partners=None, beside=None) -> list[Row]:
    """One Row per (task, batch) in `keys` and system: the median repeat of `runs[(system, task, batch)]`, with every
    repeat's tokens/s, the fewest outputs equal to plain's and to stock's over the repeats, the baseline's tokens/s
    beside each repeat (`partners`, keyed the same) and those of the other systems of every wave (`beside`, keyed the
    same: system -> tokens/s per repeat)."""
    rows = []
    for task, b in keys:
        for spec in systems:
            rs = runs.get((spec.name, task, b))
            if not rs:
                continue
            med = sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2]
            eq = [r.equal_to_plain for r in rs if r.equal_to_plain is not None]
            med.equal_to_plain = min(eq) if eq else None
            eq = [r.equal_to_stock for r in rs if r.equal_to_stock is not None]
            med.equal_to_stock = min(eq) if eq else None
            med.repeat_tokens_per_s = [round(r.tokens_per_s, 2) for r in rs]
            med.plain_repeat_tokens_per_s = list((partners or {}).get((spec.name, task, b), ()))
            med.beside = {k: list(v) for k, v in (beside or {}).get((spec.name, task, b), {}).items()}
            rows.append(med)
    return rows


def machine() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    from .processor import describe, processor_info

    cpu = processor_info()
    return {"machine": platform.machine(), "processor": describe(cpu), **cpu, "cpus": __import__("os").cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "commit": commit}


def paired_ratios(row: Row, plain: Row) -> list[float] | None:
    """Each repeat's row / baseline, paired as `paired_ratio` pairs them; None where it has no pairing."""
    a = row.repeat_tokens_per_s
    b = row.beside.get(plain.system) or row.plain_repeat_tokens_per_s or plain.repeat_tokens_per_s
    if not a or len(a) != len(b) or not all(b):
        return None
    return [x / y for x, y in zip(a, b)]


def bootstrap_interval(ratios: list[float], level: float = 0.95, draws: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of `ratios` (the paired per-repeat ratios): the median of
    `draws` resamples with replacement, seeded (the same ratios give the same interval). With three repeats it
    spans little more than their range: it says how far the repeats lie apart, not more."""
    if not ratios:
        raise ValueError("no ratios to resample")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(draws))
    lo = meds[int((1.0 - level) / 2 * (draws - 1))]
    hi = meds[int((1.0 + level) / 2 * (draws - 1))]
    return lo, hi


def paired_ratio(row: Row, plain: Row) -> float | None:
    """The median over repeats of row / baseline within each repeat (systems run interleaved, so a repeat's drift of
    the shared machine hits both); the baseline's tokens/s beside each repeat when the row carries them (`waves`:
    `Row.beside` for a system of every wave other than the run's baseline, else `plain_repeat_tokens_per_s`), else
    the baseline row's (`plain`) own repeats. None without the same number of repeats on both sides. `plain` is the
    run's baseline or a system of every wave (`Row.beside`); for any other, `paired_over`."""
    ratios = paired_ratios(row, plain)
    return None if ratios is None else statistics.median(ratios)


def baseline_of(rows: list[Row]) -> str:
    """The system a run's ratios divide by: stock SGLang (`STOCK`) when the rows have it, else plain decoding."""
    return STOCK.name if any(r.system == STOCK.name for r in rows) else PLAIN.name


def speculation_baseline(rows: list[Row]) -> str | None:
    """The plain server that "what speculation adds" divides by: plain SGLang with this package on its `entmtp_torch`
    attention, overlap on (`PLAIN_ENTMTP`: ENTMTP's and the EAGLE stand-ins' own attention backend) when the run
    has it; else, in runs from before it, plain with the package on `torch_native` (`PLAIN`); None with neither."""
    names = {r.system for r in rows}
    return next((s.name for s in (PLAIN_ENTMTP, PLAIN) if s.name in names), None)


def paired_over(rows: list[Row], row: Row, ref: str) -> float | None:
    """`row`'s paired ratio over system `ref`'s row of the same task and batch: per repeat over `ref`'s run beside it
    where `ref` ran in its wave (`Row.beside`, or `ref` the run's baseline), else through the baseline
    (`paired_ratio(row, baseline) / paired_ratio(ref's row, baseline)`); 1.0 for `ref`'s own row; None where a side
    is missing."""
    if row.system == ref:
        return 1.0 if row.repeat_tokens_per_s else None
    by = {r.system: r for r in rows if (r.task, r.batch) == (row.task, row.batch)}
    other, base = by.get(ref), by.get(baseline_of(rows))
    if other is None:
        return None
    if ref in row.beside or ref == baseline_of(rows):
        return paired_ratio(row, other)
    if base is None or row.system == base.system:
        mine = 1.0 if base is not None else None
    else:
        mine = paired_ratio(row, base)
    theirs = paired_ratio(other, base) if base is not None else None
    return None if mine is None or not theirs else mine / theirs


def to_markdown(rows: list[Row], baseline: str | None = None) -> str:
    """The table: tokens/s (median over repeats) and its ratio to the baseline's median (`baseline_of`: stock SGLang
    when the run has it, else plain decoding), and the paired ratio (median of the per-repeat ratios,
    `paired_ratio`), which the machine's drift between repeats moves less; with a `PLAIN_ENTMTP` run (not the
    baseline), the paired ratio over it too (`paired_over`: what speculation adds on the same layers and attention);
    then how many outputs equal plain decoding's with this package and, with a stock run, stock SGLang's."""
    baseline = baseline or baseline_of(rows)
    label = "stock" if baseline == STOCK.name else baseline
    base_rows = {(r.task, r.batch): r for r in rows if r.system == baseline}
    stock = any(r.system == STOCK.name or r.equal_to_stock is not None for r in rows)
    tasks = any(r.task for r in rows)
    forced = any(r.forced_summary for r in rows)
    spec_base = PLAIN_ENTMTP.name if baseline != PLAIN_ENTMTP.name and any(
        r.system == PLAIN_ENTMTP.name for r in rows) else None
    lines = [("| task " if tasks else "") + f"| system | batch | tokens/s (median) | vs {label} | vs {label}, paired "
             + (f"| vs {spec_base}, paired " if spec_base else "")
             + "| mean accepted length | greedy = plain |" + (" greedy = stock |" if stock else "") + " trees chosen |"
             + (" forced spans |" if forced else ""),
             ("|---" if tasks else "") + "|---|---|---|---|---|---|---|---|" + ("---|" if spec_base else "")
             + ("---|" if stock else "") + ("---|" if forced else "")]
    for r in rows:
        base = base_rows.get((r.task, r.batch))
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base is not None else ""
        paired = paired_over(rows, r, baseline) if base is not None else None
        over = paired_over(rows, r, spec_base) if spec_base else None
        over_cell = (f" {'' if over is None else f'{over:.2f}x'} |" if spec_base else "")
        trees = ", ".join(f"{k} {v}" for k, v in r.trees.most_common(4))
        eq = "" if r.equal_to_plain is None else f"{r.equal_to_plain}/{r.requests}"
        eq_stock = "" if r.equal_to_stock is None else f"{r.equal_to_stock}/{r.requests}"
        acc = "" if r.mean_accept is None else f"{r.mean_accept:.2f}"
        lines.append((f"| {r.task} " if tasks else "") + f"| {r.system} | {r.batch} | {r.tokens_per_s:.1f} | {ratio} | "
                     f"{'' if paired is None else f'{paired:.2f}x'} |{over_cell} {acc} | {eq} |"
                     + (f" {eq_stock} |" if stock else "") + f" {trees} |"
                     + (f" {r.forced_summary} |" if forced else ""))
    return "\n".join(lines)


def versus(rows: list[Row], subject: str, others: dict[str, list[str]], baseline: str | None = None) -> str:
    """A table of `subject` against groups of other systems, per task and batch: the subject's paired ratio to the
    baseline (default `baseline_of`; bench/sglang_speed.py passes `speculation_baseline` where the run has
    `PLAIN_ENTMTP`) divided by the best paired ratio of each group (`others`: heading -> system names), which is
    named. Each paired ratio divides by the baseline measured beside it, so systems measured in different waves
    compare through the baseline."""
    keys = list(dict.fromkeys((r.task, r.batch) for r in rows if r.system == subject))
    lines = ["| task | batch | " + " | ".join(f"{subject} vs {h}" for h in others) + " |",
             "|---|---|" + "---|" * len(others)]
    for task, b in keys:
        cells = []
        for names in others.values():
            got = over_best(rows, subject, names, task, b, baseline)
            cells.append("" if got is None else f"{got[0]:.2f}x ({got[1]})")
        lines.append(f"| {task} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_paired(rows: list[Row], names, task: str, batch: int, baseline: str | None = None
                ) -> tuple[float, str] | None:
    """The best paired ratio to the baseline (default `baseline_of`; another system run in every wave, such as
    `PLAIN_ENTMTP`, pairs through `paired_over`) among the systems `names` on one task and batch size, and whose."""
    baseline = baseline or baseline_of(rows)
    base = next((r for r in rows if (r.system, r.task, r.batch) == (baseline, task, batch)), None)
    if base is None:
        return None
    theirs = [(paired_over(rows, r, baseline), r.system) for r in rows
              if r.system in names and (r.task, r.batch) == (task, batch)]
    theirs = [(x, n) for x, n in theirs if x]
    return max(theirs) if theirs else None


def over_best(rows: list[Row], subject: str, names, task: str, batch: int, baseline: str | None = None
              ) -> tuple[float, str] | None:
    """`subject`'s paired ratio to the baseline over the best of `names`' (`best_paired`), and that system."""
    mine, theirs = best_paired(rows, (subject,), task, batch, baseline), best_paired(rows, names, task, batch, baseline)
    return None if mine is None or theirs is None else (mine[0] / theirs[0], theirs[1])


def _jsonl_text(path: Path) -> str:
    path = Path(path)
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def meta_from_jsonl(path: Path) -> dict:
    """A run's configuration and machine, as `write` put them on every line: the first line's (`.jsonl` or
    `.jsonl.gz`); {} for an empty file."""
    first = _jsonl_text(path).splitlines()[:1]
    return json.loads(first[0]) if first else {}


def rows_from_jsonl(path: Path) -> list[Row]:
    """The rows a run wrote with `write` (its Markdown can be drawn again from them); `.jsonl` or `.jsonl.gz`."""
    out = []
    for line in _jsonl_text(path).splitlines():
        d = json.loads(line)
        if "system" not in d:
            continue
        acc = [] if d.get("mean_accept_length") is None else [d["mean_accept_length"]]
        out.append(Row(d["system"], d["batch"], d["tokens"], d["seconds"], acc, collections.Counter(d["trees"]),
                       d["equal_to_plain"], d["requests"], list(d.get("repeat_tokens_per_s") or []), d["task"],
                       list(d.get("plain_repeat_tokens_per_s") or []), d.get("equal_to_stock"),
                       {k: collections.Counter(v) for k, v in (d.get("trees_by_label") or {}).items()},
                       d.get("forced"), d.get("lookup"),
                       beside={k: list(v) for k, v in (d.get("beside_repeat_tokens_per_s") or {}).items()}))
    return out


def write(rows: list[Row], out_dir: Path, config: dict, name: str = "sglang_cpu") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**config, **machine()}
    # gzipped: every line repeats the run's configuration, and the repository's tracked files have a size limit
    with gzip.open(out_dir / f"{name}.jsonl.gz", "wt") as f:
        for r in rows:
            f.write(json.dumps({**meta, "task": r.task, "system": r.system, "batch": r.batch, "tokens": r.tokens,
                                "seconds": round(r.seconds, 3), "tokens_per_s": round(r.tokens_per_s, 2),
                                "mean_accept_length": r.mean_accept, "equal_to_plain": r.equal_to_plain,
                                "equal_to_stock": r.equal_to_stock, "requests": r.requests, "trees": dict(r.trees),
                                "repeat_tokens_per_s": r.repeat_tokens_per_s,
                                "plain_repeat_tokens_per_s": r.plain_repeat_tokens_per_s,
                                **({"trees_by_label": {k: dict(v) for k, v in r.trees_by_label.items()}}
                                   if r.trees_by_label else {}),
                                **({"forced": r.forced} if r.forced else {}),
                                **({"lookup": r.lookup} if r.lookup else {}),
                                **({"beside_repeat_tokens_per_s": r.beside} if r.beside else {})}) + "\n")
    (out_dir / f"{name}.md").write_text(to_markdown(rows) + "\n")
