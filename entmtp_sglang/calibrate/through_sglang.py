"""Calibration through SGLang: a tree set for the model and drafter a user serves, from their directories.

    entmtp calibrate --engine sglang --model-path MODEL --speculative-draft-model-path DRAFT --prompts code

1. Start `sglang.launch_server` (`server.py`) with ENTMTP, a recording tree set (`recording_tree_set`: a tree
   wide at depths 1 and 2 and deep along the top candidates, and the cost grid, `costs.cost_grid`), and
   `ENTMTP_RECORD=FILE`, so the worker writes one record per verified step (sglang/recording.py).
2. Decode the prompts greedily, every request pinned to the recording tree: each step records, along the
   target's own continuation through the drafted tree, the rank of the target's token among the drafter's
   top candidates and the drafter's probabilities (ranks the tree cannot tell are -1 and count as misses).
3. Time every grid tree inside the same server, pinned, at each batch size asked for, the trees in
   rotation (so load from elsewhere hits them alike), and fit seconds = base + per_node * nodes +
   per_depth * depth per batch size on each tree's median step time. Then decode batches whose rows pin
   different grid trees (`mixed_pins`): the server verifies each row's own node count (ragged steps), and
   the ragged step cost (`ragged_cost.fit_ragged_cost`) is fitted on them and stored in the set's provenance,
   where the batch budget prices ragged steps by it until the server's own online fit takes over.
4. Build the tree set as the offline calibration does (`build.build_tree_set`: bins of the draft signal
   that best predicts acceptance, greedy trees per bin and budget, Pareto-optimal ones kept, the per-node
   acceptance predictor fitted), named for the served model so ENTMTP accepts it, with its Pareto plot and
   records beside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..costs import provenance
from ..costs.ragged_cost import MIN_POINTS, RaggedStep, RaggedStepCost, fit_ragged_cost
from ..sglang.config import SGLANG_SIGNALS
from ..tree import Tree
from ..tree.records import PositionRecord
from ..tree.treeset import TreeEntry, TreeSet
from .build import build_tree_set, pearson, plot_pareto, signals_of
from .costs import StepCostModel, cost_grid, fit_cost_models
from .records import CalibrationConfig, save_records

RECORD_TREE = "record"
TIMING_ROUNDS, TIMING_TOKENS = 4, 8     # each grid tree decodes 4 times 8 tokens per batch size, in rotation
RAGGED_ROUNDS = 6                       # mixed-pin batches per batch size > 1 (each row its own grid tree)
ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


def record_tree(depth: int) -> Tree:
    """Three candidates at depth 1, three under the top one and two under the second at depth 2, and the top
    candidate's chain below each depth-2 node to `depth` (the ranks a calibrated tree usually uses)."""
    parents = [-1, 0, 0, 0]                     # 1, 2, 3: ranks 0-2 at depth 1
    heads = []
    for parent, width in ((1, 3), (2, 2)):
        for _ in range(width):
            parents.append(parent)
            heads.append(len(parents) - 1)
    for head in heads[:1] + heads[3:4]:         # chains under the top candidate of each depth-1 branch
        below = head
        for _ in range(depth - 2):
            parents.append(below)
            below = len(parents) - 1
    return Tree(tuple(parents), name=RECORD_TREE)


def recording_tree_set(model: str, depth: int) -> TreeSet:
    trees = [record_tree(depth), *cost_grid(depth)]
    entries = tuple(TreeEntry(t, (0.0,), {1: 1.0}) for t in trees)
    return provenance.amended(TreeSet(model=model, drafter="eagle", task="recording", signal="draft_margin",
                                      bin_edges=(), trees=entries, hardware="recording"), {"recording": True})


def load_prompt_items(source: str, count: int) -> list[dict]:
    """A shipped task's calibration prompts, or a JSONL file: one JSON string, {"prompt": ...} / {"text": ...},
    or {"messages": [...]} per line."""
    from ..tasks import TASKS, interleave, load_prompts

    if source in TASKS or source == "mixed":
        items = (interleave(("prose", "json", "code"), "calib", count // 3 + 1)[:count] if source == "mixed"
                 else load_prompts(source, "calib", count))
        return items
    path = Path(source)
    if not path.exists():
        raise ValueError(f"--prompts {source!r} is neither a task ({', '.join(TASKS)}, mixed) nor a file")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or not ({"prompt", "text", "messages"} & obj.keys()):
            raise ValueError(f"{path}:{i + 1}: expected a string or an object with prompt, text or messages")
        items.append(obj)
        if len(items) == count:
            break
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def chat_template(model_dir: Path) -> str | None:
    """The model's chat template, as Hugging Face keeps it: chat_template.jinja, else tokenizer_config.json."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = model_dir / "tokenizer_config.json"
    template = json.loads(cfg.read_text()).get("chat_template") if cfg.exists() else None
    return template if isinstance(template, str) else None


def prompt_texts(items: list[dict], model_path: Path) -> list[str]:
    """Each item as the text the model sees: `text` as it is; `messages`, and shipped prompts, through the
    model's chat template when it has one (as the reference engine feeds them)."""
    from ..tasks import prompt_text, render_messages

    template = chat_template(Path(model_path))
    out = []
    for it in items:
        if "text" in it:
            out.append(it["text"])
        elif "messages" in it:
            out.append(render_messages(template, it["messages"]) if template
                       else "".join(m.get("content", "") for m in it["messages"]))
        else:
            out.append(prompt_text(it, template))
    return out


@dataclass(frozen=True)
class SGLangCalibration:
    model_path: Path
    draft_path: Path
    algorithm: str = "EAGLE"
    device: str = "cpu"
    attention_backend: str | None = None      # default: entmtp_torch on CPU, SGLang's choice elsewhere
    dtype: str = "float32"
    max_new_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 8)
    concurrency: int = 8
    max_depth: int = 5
    bins: int = 4
    task: str = "custom"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm}")
        for name, p in (("--model-path", self.model_path), ("--speculative-draft-model-path", self.draft_path)):
            if not (Path(p) / "config.json").exists():
                raise ValueError(f"{name} {p}: no config.json there (a Hugging Face model directory is needed)")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or 1 not in self.batch_sizes:
            raise ValueError(f"--batch-sizes must include 1 and be positive, got {self.batch_sizes}")
        if not 2 <= self.max_depth <= 8 or self.max_new_tokens < 2 or self.concurrency < 1:
            raise ValueError("need --max-depth in 2..8, --max-new-tokens >= 2 and --concurrency >= 1")

    @property
    def model_name(self) -> str:
        return Path(str(self.model_path).rstrip("/")).name

    @property
    def drafter_kind(self) -> str:
        """eagle3 for an EAGLE-3 draft checkpoint (by its architecture), else eagle: the set's drafter and name."""
        cfg = json.loads((Path(self.draft_path) / "config.json").read_text())
        return "eagle3" if any("Eagle3" in a for a in cfg.get("architectures") or ()) else "eagle"

    def server_args(self) -> list[str]:
        attention = self.attention_backend or ("entmtp_torch" if self.device == "cpu" else None)
        args = ["--model-path", str(self.model_path), "--speculative-algorithm", "ENTMTP",
                "--speculative-draft-model-path", str(self.draft_path), "--device", self.device,
                "--dtype", self.dtype, "--log-level", "warning"]
        if attention:
            args += ["--attention-backend", attention]
        if self.device == "cpu":
            args += ["--disable-cuda-graph", "--max-total-tokens", "20000"]
        return args + list(self.extra_args)


def read_steps(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def records_of(steps: list[dict], tree: str = RECORD_TREE) -> list[PositionRecord]:
    """The recording tree's position records, numbered per request in the order they were decoded."""
    import math

    out = []
    for s in steps:
        if s["tree"] != tree:
            continue
        for prompt, pos, de, te, ranks, margin, probs in s["records"]:
            f = lambda v: math.nan if v is None else float(v)  # noqa: E731
            out.append(PositionRecord(prompt, pos, f(de), f(te), tuple(ranks), f(margin),
                                      tuple(tuple(p) for p in probs)))
    return out


def step_seconds(steps: list[dict], tree: str, batch: int) -> list[float]:
    """Step times of `tree` at batch size `batch` (the largest batch it ran at, if it never reached `batch`)."""
    mine = [s for s in steps if s["tree"] == tree]
    if not mine:
        return []
    size = batch if any(s["batch"] == batch for s in mine) else max(s["batch"] for s in mine)
    return [s["seconds"] for s in mine if s["batch"] == size]


def best_signal(records: list[PositionRecord], window: int = 8) -> str:
    sig = signals_of(records, window)
    acc = [float(r.chain_accepted) for r in records]
    return max(SGLANG_SIGNALS, key=lambda k: abs(pearson(sig[k], acc)) if k in sig else -1.0)


def cost_models(steps: list[dict], grid: list[Tree], batch_sizes, log=print) -> dict[int, StepCostModel]:
    """seconds = base + per_node * nodes + per_depth * depth per batch size, on the grid's median step times."""
    def median(tree: Tree, batch: int) -> float | None:
        seconds = step_seconds(steps, tree.name, batch)
        return statistics.median(seconds) if seconds else None

    return fit_cost_models(grid, batch_sizes, median, f"in SGLang, {len(grid)} trees", log)


def _decode_all(server, texts: list[str], tree: str | list[str], max_new: int, concurrency: int,
                progress=None) -> None:
    """Decode `texts` with every request pinning `tree` (a list: request i pins tree[i])."""
    from ..sglang.config import PIN_KEY

    pins = tree if isinstance(tree, list) else [tree] * len(texts)

    def one(job: tuple[str, str]) -> None:
        server.generate(job[0], max_new, 0.0, custom_params={PIN_KEY: job[1]})
        if progress is not None:
            progress.update(1)

    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, zip(texts, pins)))


def mixed_pins(grid: list[Tree], batch: int, rounds: int) -> list[list[str]]:
    """`rounds` batches of `batch` pins over the grid's trees, each batch mixing node counts (so the server verifies
    ragged steps): round r draws from the trees at most 1 + r mod D deep (D: the grid's deepest), so the deepest
    level varies too, and row i takes tree (r + i * stride) mod n of them, stride coprime to n."""
    deepest = max(t.max_depth for t in grid)
    out = []
    for r in range(rounds):
        pool = [t.name for t in grid if t.max_depth <= 1 + r % max(1, deepest)]
        n = len(pool)
        stride = next(k for k in range(max(2, n // batch), 2 * n + 2) if math.gcd(k, n) == 1)
        out.append([pool[(r + i * stride) % n] for i in range(batch)])
    return out


def ragged_cost(steps: list[dict], grid: list[Tree] = (), log=print) -> RaggedStepCost | None:
    """The ragged step cost (costs/ragged_cost.py) fitted on the recorded ragged steps (each request its own
    tree and node count), the pinned grid trees' steps (every row the tree's node count: the policy prices those
    steps by the same line) and the plain steps (chain:0) of every batch size; None with too few ragged points."""
    nodes = {t.name: (t.num_nodes, t.max_depth) for t in grid if t.max_depth > 0}
    timed = [RaggedStep(s["tokens"], s["depth"], s["batch"], s["seconds"]) for s in steps if s["tree"] == "ragged"]
    points = {t.point for t in timed}
    if len(points) < MIN_POINTS:
        log(f"ragged step cost: {len(points)} distinct ragged steps measured, too few to fit (the set's per-tree "
            "costs price ragged steps)")
        return None
    timed += [RaggedStep(s["batch"] * nodes[s["tree"]][0], nodes[s["tree"]][1], s["batch"], s["seconds"])
              for s in steps if s["tree"] in nodes]
    timed += [RaggedStep(s["batch"], 0, s["batch"], s["seconds"]) for s in steps if s["tree"] == "chain:0"]
    cost = fit_ragged_cost(timed)
    log(f"ragged step cost from {len(points)} ragged points ({sum(s['tree'] == 'ragged' for s in steps)} steps) and "
        f"{sum(s['tree'] in nodes for s in steps)} steps of the pinned trees: {cost.to_json()}")
    return cost


def run(cal: SGLangCalibration, items: list[dict], out: Path, log=print, progress=None) -> TreeSet:
    """Everything above; writes `out`, its .png and its .records.jsonl, returns the set."""
    from ..sglang.config import ENV_RECORD, ENV_TREE_SET
    from .server import SGLangServer, free_port

    texts = prompt_texts(items, cal.model_path)
    work = Path(tempfile.mkdtemp(prefix="entmtp-calibrate-"))
    rec_set = recording_tree_set(cal.model_name, cal.max_depth)
    rec_set.save(work / "recording-set.json")
    steps_file = work / "steps.jsonl"
    env = {ENV_TREE_SET: str(work / "recording-set.json"), ENV_RECORD: str(steps_file)}
    server = SGLangServer(cal.server_args(), free_port(), env, work / "server.log")
    grid = [e.tree for e in rec_set.trees if e.tree.name != RECORD_TREE]
    log(f"starting SGLang with ENTMTP in recording mode (log: {server.log_path})")
    with server:
        _decode_all(server, texts, RECORD_TREE, cal.max_new_tokens, cal.concurrency, progress)
        records = records_of(read_steps(steps_file))
        if not records:
            raise RuntimeError(f"the server recorded no verified step; see {server.log_path}")
        log(f"{len(records)} positions recorded from {len(texts)} prompts; timing {len(grid)} trees at batch "
            f"sizes {list(cal.batch_sizes)}")
        for b in cal.batch_sizes:   # trees interleaved, so a burst of load elsewhere hits them alike
            batch = [texts[i % len(texts)] for i in range(b)]
            for _ in range(TIMING_ROUNDS):
                for t in grid:
                    _decode_all(server, batch, t.name, TIMING_TOKENS, b)
        for b in [b for b in cal.batch_sizes if b > 1]:   # ragged steps: each row of a batch pins its own tree
            batch = [texts[i % len(texts)] for i in range(b)]
            for pins in mixed_pins(grid, b, RAGGED_ROUNDS):
                _decode_all(server, batch, pins, TIMING_TOKENS, b)
    steps = read_steps(steps_file)
    models = cost_models(steps, grid, cal.batch_sizes, log)
    ragged = ragged_cost(steps, grid, log)   # the mixed-pin batches' ragged steps and the grid's
    cfg = CalibrationConfig(cal.drafter_kind, cal.task, len(texts), cal.max_new_tokens, max_depth=cal.max_depth,
                            num_bins=cal.bins)
    ts, points = build_tree_set(None, records, texts, cfg, log=log, signal=best_signal(records), models=models,
                                model_name=cal.model_name,
                                hardware_name=f"{cal.device} via SGLang ({cal.dtype}, {cal.algorithm} drafter "
                                              f"{Path(cal.draft_path).name})")
    if ragged is not None:
        ts = dataclasses.replace(ts, provenance={**ts.provenance, "ragged_step_cost": ragged.to_json()})
    out.parent.mkdir(parents=True, exist_ok=True)
    ts.save(out)
    save_records(records, out.with_suffix(".records.jsonl"))
    try:
        plot_pareto(points, ts, out.with_suffix(".png"))
    except Exception as e:  # a plot is a convenience; the set is what matters
        log(f"no Pareto plot ({e})")
    return ts
