"""Agents end to end (issue 60): scripted multi-turn tool-using tasks through SGLang's frontend language, ENTMTP
against stock SGLang, plain decoding with this package and SGLang's NGRAM, on SmolLM2-135M-Instruct on this CPU.

    .venv/bin/python bench/agent_pipeline.py          # every system, 1, 4 and 8 agents, 3 repeats: about 4 h on 2
                                                      # cores (estimated from the smoke run)
    .venv/bin/python bench/agent_pipeline.py --render bench/results/agent_pipeline/agent_pipeline.jsonl.gz
                                                      # the tables and goals again from a run, no servers
    .venv/bin/python bench/agent_pipeline.py --tasks 2 --agents 1 --repeats 1 --max-turns 3 --max-new-tokens 48
        --systems plain-entmtp,entmtp --out /tmp/agent_smoke     # a smoke run (2.5 min, 100 s of it starting the
                                                                 # four servers: the baselines always run)

The tasks (bench/workloads/agent_tasks.json, written for this benchmark and held out from any tuning): a user goal
each ("What is the total price of 3 notebooks and 2 staplers?", "Read budget.txt. How much of the travel budget is
left ...?"), 3 to 8 tool-call turns at most. Each task is a program of SGLang's frontend language (`@sgl.function`
run against the server with `sgl.RuntimeEndpoint`): the system turn describes the tools, the user turn gives the
goal, then in each turn the model calls a tool by writing JSON under a schema (`sgl.gen(..., json_schema=...)`:
{"tool": one of calculator, table_lookup, calendar, read_file, final_answer, "arguments": {...}}, the arguments'
shape fixed per tool), a deterministic local tool answers (a calculator over a small arithmetic parser, no eval; a
lookup in the product table the task file ships; its calendar of fixed meetings; a read of the files in
bench/workloads/agent_files/, which cannot leave that folder) and its result, or its error message for a wrong or
failing call, comes back as the next user turn, as real tools do. The loop ends when the model calls final_answer
or at the task's turn limit; the model then writes its final answer in free text (`sgl.gen` without a grammar).
SmolLM2-135M is a tiny model and makes bad calls: the benchmark measures speed and losslessness, not task success,
but records success too (the final answer mentions what the task's `expect` asks for).

Systems (entmtp_sglang/bench/sglang_benchmark.py says how each server is started), each its own SGLang server:
stock SGLang in float32 (`plain-stock`) and in bfloat16 (`plain-stock-bf16`: what `--dtype auto` serves, its
outputs its own and compared with nothing), plain decoding with this package on its `entmtp_torch` attention
(`plain-entmtp`: the baseline of what speculation adds and the reference of every transcript), SGLang's NGRAM
(`ngram`), ENTMTP as served (`entmtp`) and ENTMTP drafting also from what earlier requests wrote
(`entmtp-cross`: ENTMTP_CROSS_SPANS=1; agents share a system turn and tools, so one agent's calls often repeat
what another's wrote). All float32 but stock bfloat16, each with --max-total-tokens sized for the most agents'
conversations at once (`kv_tokens`: 19,456 at 8 agents, 8 turns, 96 new tokens). No more than --at-once servers up
together (each holds 3.5-4 GiB here): the three baselines in every wave, the others beside them (two waves by
default).

Measured per system at each number of agents (--agents: N agents = N tasks in flight at once, each its own program
run in a thread, the next task starting as one finishes, until all tasks are done), greedy: the end-to-end time of
all tasks (the wall clock from the first task's start to the last one's end) and of each task, output tokens per
second, turns, the share of prompt tokens SGLang's radix cache served (meta_info's `cached_tokens` over
`prompt_tokens`, summed over every generation: the conversation so far is each turn's prompt), accepted tokens per
verify step (`spec_accept_length`, weighted by verify steps, where the server reports it), and whether each task's
transcript (the texts generated in all its turns) equals plain-entmtp's on the same task at the same number of
agents. In each repeat, at each number of agents, the servers of a wave are measured one after another in a seeded
random order, each from an empty radix cache (`flush_cache`, which also empties NGRAM's corpus, ENTMTP's
cross-request index and SGLang's compiled grammars: every pass compiles the tool-call schema once). The table gives
medians over repeats and paired ratios: per repeat, the baseline's end-to-end time over the system's, the baseline
measured beside it in the same wave and repeat, the median of those (a 95% bootstrap interval in brackets), over
stock bfloat16 and over plain-entmtp; then the goals of issue 60, each said met or not: ENTMTP at least 2.5x stock
bfloat16 and at least 1.5x plain-entmtp in end-to-end time with one agent, at least 1.3x plain-entmtp with 8
agents, its transcripts equal to plain-entmtp's.

Writes --out (default bench/results/agent_pipeline/): agent_pipeline.jsonl.gz (one line per measured pass, with its
tasks' transcripts, the run's configuration and `machine()` on every line), rewritten after every repeat, and
agent_pipeline.md (the tables and the goals); server logs go to runs/agent-pipeline/.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import gzip
import json
import random
import re
import statistics
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    FLOAT32,
    NGRAM,
    PLAIN_ENTMTP,
    STOCK,
    STOCK_BF16,
    ServerPool,
    SystemSpec,
    bootstrap_interval,
    machine,
    waves,
)
from entmtp_sglang.model.prepare import resolve_alias

ROOT = Path(__file__).resolve().parent.parent
TASK_FILE = ROOT / "bench" / "workloads" / "agent_tasks.json"
FILES = ROOT / "bench" / "workloads" / "agent_files"
NAME = "agent_pipeline"
ENTMTP = SystemSpec("entmtp", "ENTMTP")
# ENTMTP drafting also from what earlier requests wrote (entmtp_sglang/shared_ngrams.py, off by default until this
# benchmark says where it pays)
ENTMTP_CROSS = SystemSpec("entmtp-cross", "ENTMTP", env=(("ENTMTP_CROSS_SPANS", "1"),))
# the baselines first (in every wave), then ENTMTP's two servers (one wave), NGRAM
SYSTEMS = (STOCK, STOCK_BF16, PLAIN_ENTMTP, ENTMTP, ENTMTP_CROSS, NGRAM)
BASELINES = (STOCK, STOCK_BF16, PLAIN_ENTMTP)   # always run: the ratios and the transcripts need them
EVERY_WAVE = tuple(s.name for s in BASELINES)
REFERENCE = PLAIN_ENTMTP.name   # whose transcripts every other system's are compared with
AT_ONCE = 5   # each SmolLM2 server holds 3.5-4 GiB here: five fit in 24 GiB
AGENTS = (1, 4, 8)
# issue 60's goals: (the system ENTMTP's end-to-end time is divided into, agents, the least paired ratio)
GOALS = ((STOCK_BF16.name, 1, 2.5), (PLAIN_ENTMTP.name, 1, 1.5), (PLAIN_ENTMTP.name, 8, 1.3))
SPECULATIVE = (ENTMTP.name, ENTMTP_CROSS.name)   # whose goals the run states

# ---------------------------------------------------------------------------------------------------------------
# the tools: deterministic, local, their errors are messages for the agent

FINAL = "final_answer"
TOOLS = ("calculator", "table_lookup", "calendar", "read_file", FINAL)
# each tool's arguments (JSON Schema of the "arguments" object's properties, all required)
ARGUMENTS = {
    "calculator": {"expression": {"type": "string", "maxLength": 80}},
    "table_lookup": {"item": {"type": "string", "maxLength": 40}},
    "calendar": {"date": {"type": "string", "format": "date"}},
    "read_file": {"path": {"type": "string", "maxLength": 40}},
    FINAL: {},
}
RESULT_CHARS = 400   # a tool's answer is cut to this many characters (a file read)
MAX_EXPRESSION = 200   # characters the calculator reads
MAX_DEPTH = 24   # nested parentheses and signs the calculator follows
MAX_DIGITS = 15   # digits of one number
SHAPE = '{"tool": NAME, "arguments": {...}}'   # a tool call, as error messages spell it
DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")


class ToolError(ValueError):
    """A call a tool refuses: its message goes back to the agent as the next turn, as a real tool's error does."""


@dataclass(frozen=True)
class World:
    """What the tools read: the product table and the calendar of the task file, the folder of files."""

    table: dict
    calendar: dict
    files: Path


@dataclass(frozen=True)
class Task:
    id: str
    goal: str
    limit: int                  # the most tool-call turns (the final answer comes after them)
    expect: tuple               # phrases the final answer must mention: each a string or a tuple of alternatives
    solution: tuple             # the calls a correct agent makes: ((tool, arguments), ...)


def tool_schema() -> dict:
    """The JSON schema of one tool call: {"tool": NAME, "arguments": {...}}, one branch per tool, so the arguments'
    shape follows the tool named."""
    return {"anyOf": [{"type": "object",
                       "properties": {"tool": {"type": "string", "enum": [name]},
                                      "arguments": {"type": "object", "properties": params,
                                                    "required": list(params), "additionalProperties": False}},
                       "required": ["tool", "arguments"], "additionalProperties": False}
                      for name, params in ARGUMENTS.items()]}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression over decimal numbers, + - * / and parentheses (exact fractions, shown
    to 6 decimals at most): a small recursive-descent parser, nothing evaluated as Python."""
    text = str(expression)
    if len(text) > MAX_EXPRESSION:
        raise ToolError(f"calculator: the expression is longer than {MAX_EXPRESSION} characters")
    tokens = _tokens(text)
    if not tokens:
        raise ToolError("calculator: the expression is empty")
    value, at = _sum(tokens, 0, 0)
    if at < len(tokens):
        pos, tok = tokens[at]
        raise ToolError(f"calculator: unexpected {tok!r} at position {pos}")
    if abs(value) > 10 ** MAX_DIGITS:
        raise ToolError("calculator: the result is too large")
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _tokens(text: str) -> list[tuple[int, str]]:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
            continue
        m = NUMBER.match(text, i)
        if m:
            if len(m.group().replace(".", "")) > MAX_DIGITS:
                raise ToolError(f"calculator: the number at position {i} has more than {MAX_DIGITS} digits")
            out.append((i, m.group()))
            i = m.end()
        elif c in "+-*/()":
            out.append((i, c))
            i += 1
        else:
            raise ToolError(f"calculator: unexpected {c!r} at position {i}: write numbers, + - * / and parentheses")
    return out


def _sum(tokens, at: int, depth: int) -> tuple[Fraction, int]:
    value, at = _product(tokens, at, depth)
    while at < len(tokens) and tokens[at][1] in ("+", "-"):
        op = tokens[at][1]
        rhs, at = _product(tokens, at + 1, depth)
        value = value + rhs if op == "+" else value - rhs
    return value, at


def _product(tokens, at: int, depth: int) -> tuple[Fraction, int]:
    value, at = _factor(tokens, at, depth)
    while at < len(tokens) and tokens[at][1] in ("*", "/"):
        op, pos = tokens[at][1], tokens[at][0]
        rhs, at = _factor(tokens, at + 1, depth)
        if op == "/" and rhs == 0:
            raise ToolError(f"calculator: division by zero at position {pos}")
        value = value * rhs if op == "*" else value / rhs
    return value, at


def _factor(tokens, at: int, depth: int) -> tuple[Fraction, int]:
    if depth > MAX_DEPTH:
        raise ToolError(f"calculator: more than {MAX_DEPTH} nested parentheses or signs")
    if at >= len(tokens):
        raise ToolError("calculator: the expression ends where a number should come")
    pos, tok = tokens[at]
    if tok in ("+", "-"):
        value, at = _factor(tokens, at + 1, depth + 1)
        return (value if tok == "+" else -value), at
    if tok == "(":
        value, at = _sum(tokens, at + 1, depth + 1)
        if at >= len(tokens) or tokens[at][1] != ")":
            raise ToolError(f"calculator: the parenthesis at position {pos} is not closed")
        return value, at + 1
    if NUMBER.fullmatch(tok):
        return Fraction(tok), at + 1
    raise ToolError(f"calculator: unexpected {tok!r} at position {pos}")


def table_lookup(world: World, item: str) -> str:
    """A product's row of the table (its name matched without regard to case or spacing)."""
    key = " ".join(str(item).lower().split())
    row = world.table.get(key)
    if row is None:
        raise ToolError(f"table_lookup: no item {str(item)!r}; the items are {', '.join(world.table)}")
    return f"{key}: " + ", ".join(f"{k} {v}" for k, v in row.items())


def calendar(world: World, date: str) -> str:
    """The meetings of a day (YYYY-MM-DD), in order, numbered."""
    text = str(date).strip()
    try:
        if not DATE.fullmatch(text):
            raise ValueError
        datetime.date.fromisoformat(text)
    except ValueError:
        raise ToolError(f"calendar: {str(date)!r} is not a date of the form YYYY-MM-DD") from None
    events = world.calendar.get(text) or []
    if not events:
        return f"no meetings on {text}"
    return f"{len(events)} meetings on {text}: " + "; ".join(
        f"{i}. {e['time']} {e['title']} with {e['with']}, room {e['room']}" for i, e in enumerate(events, 1))


def read_file(world: World, path: str) -> str:
    """A text file of the world's folder (cut to RESULT_CHARS); nothing outside it: no absolute path, no `..`, no
    link that leads out."""
    name = str(path).strip()
    root = world.files.resolve()
    files = sorted(p.name for p in root.iterdir() if p.is_file())
    refused = ToolError(f"read_file: no file {name!r}; the files are {', '.join(files)}")
    if not name or "\x00" in name or "\\" in name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise refused
    target = (root / name).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise refused
    return target.read_text(errors="replace")


def call_tool(world: World, tool: str, arguments: dict) -> str:
    """What `tool` answers to `arguments` (cut to RESULT_CHARS); ToolError for a call it refuses."""
    if tool not in ARGUMENTS or tool == FINAL:
        raise ToolError(f"no tool {tool!r}; the tools are {', '.join(TOOLS)}")
    missing = [p for p in ARGUMENTS[tool] if p not in arguments]
    if missing:
        raise ToolError(f"{tool}: missing argument {', '.join(missing)}")
    value = arguments[next(iter(ARGUMENTS[tool]))]
    if tool == "calculator":
        out = calculate(value)
    elif tool == "table_lookup":
        out = table_lookup(world, value)
    elif tool == "calendar":
        out = calendar(world, value)
    else:
        out = read_file(world, value)
    return out if len(out) <= RESULT_CHARS else out[:RESULT_CHARS] + " [cut]"


def respond(world: World, text: str, cut: bool = False) -> tuple[str | None, str, bool]:
    """The answer to one generated tool call: (the tool named, or None where the text names none; the next user
    turn's text; whether the call succeeded). final_answer answers ("final_answer", "", True). `cut`: the
    generation stopped at its token limit (its JSON may be incomplete)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        why = "it was cut off at the token limit" if cut else f"{e.msg} at character {e.pos}"
        return None, f"error: the tool call is not valid JSON ({why}); write {SHAPE}", False
    if not (isinstance(data, dict) and isinstance(data.get("tool"), str) and isinstance(data.get("arguments"), dict)):
        return None, f"error: a tool call is {SHAPE}", False
    tool = data["tool"]
    if tool == FINAL:
        return tool, "", True
    try:
        return tool, f"{tool} result: {call_tool(world, tool, data['arguments'])}", True
    except ToolError as e:
        return tool, f"error: {e}", False


def mentions(text: str, phrase: str) -> bool:
    """`phrase` in `text` as a whole (not inside a longer word or number), regardless of case."""
    return re.search(r"(?<![0-9A-Za-z.])" + re.escape(phrase.lower()) + r"(?![0-9A-Za-z]|\.[0-9])",
                     text.lower()) is not None


def solved(answer: str, expect) -> bool:
    """Whether a final answer mentions everything `expect` asks for (each entry, or one of its alternatives)."""
    return bool(expect) and all(any(mentions(answer, p) for p in ((e,) if isinstance(e, str) else e))
                                for e in expect)


def load_tasks(path: Path = TASK_FILE, files: Path = FILES) -> tuple[list[Task], World]:
    """The task file's tasks and the world its tools read; clear errors for a malformed file."""
    spec = json.loads(Path(path).read_text())
    world = World(spec["table"], spec["calendar"], Path(files))
    tasks = []
    for item in spec["tasks"]:
        try:
            task = Task(item["id"], item["goal"], int(item["limit"]),
                        tuple(e if isinstance(e, str) else tuple(e) for e in item["expect"]),
                        tuple((c["tool"], c["arguments"]) for c in item["solution"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: task {item.get('id', '?')!r} lacks or misshapes {e}") from None
        bad = sorted({tool for tool, _ in task.solution} - set(TOOLS))
        if bad:
            raise ValueError(f"{path}: task {task.id} names unknown tool(s) {', '.join(bad)}")
        tasks.append(task)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: task ids repeat")
    return tasks, world


def system_prompt(world: World) -> str:
    """The system turn every task shares (SGLang's radix cache serves it across tasks): the tools and their keys."""
    files = ", ".join(sorted(p.name for p in world.files.iterdir() if p.is_file()))
    return ("You solve the user's task with tools. Each of your turns is one tool call, written as JSON: "
            '{"tool": NAME, "arguments": {...}}. Its result comes back in the next message. The tools:\n'
            '- calculator {"expression": "2 * (3 + 4.5)"}: arithmetic with numbers, + - * / and parentheses.\n'
            '- table_lookup {"item": "stapler"}: a product\'s price in EUR, stock and weight in kg. Products: '
            f"{', '.join(world.table)}.\n"
            '- calendar {"date": "2026-01-15"}: the meetings of a day, with time, people and room.\n'
            f'- read_file {{"path": "notes.txt"}}: the text of a file. Files: {files}.\n'
            '- final_answer {}: call it once you know the answer; then you write the answer for the user.')


FINAL_PROMPT = "Now write your final answer to my task in one or two sentences."
OUT_OF_TURNS = "You have no tool calls left. Write your final answer to my task in one or two sentences now."

# ---------------------------------------------------------------------------------------------------------------
# one agent: an SGLang frontend program


@dataclass(frozen=True)
class TaskRun:
    """One task's run by one agent: its time, its transcript (the texts generated in each turn), what it called and
    what the server said about its generations (summed)."""

    id: str
    seconds: float
    transcript: tuple[str, ...]
    tools: tuple[str, ...]      # the tools called, in order (final_answer included)
    errors: int                 # calls answered with an error
    finished: bool              # final_answer called within the turn limit
    solved: bool
    tokens: int                 # output tokens
    prompt_tokens: int
    cached_tokens: int
    verify_steps: int           # speculative verify steps (spec_verify_ct); 0 for plain decoding
    accepted: float             # spec_accept_length x spec_verify_ct, summed: tokens the verify steps yielded

    @property
    def turns(self) -> int:
        return len(self.transcript)


class AgentError(RuntimeError):
    pass


def agent_program():
    """The agent as an SGLang frontend program (sglang imported here: the tests of the tools need no SGLang)."""
    import sglang as sgl

    schema = json.dumps(tool_schema())

    @sgl.function
    def agent(s, task, world, limit, max_new):
        metas, texts = [], []

        def generated(name):
            try:
                text = s[name]
            except KeyError:
                raise AgentError(f"task {task.id}: generation {name} failed: {s.error()!r}") from None
            texts.append(text)
            metas.append(s.get_meta_info(name) or {})
            return text

        s += sgl.system(system_prompt(world))
        s += sgl.user(task.goal)
        tools, errors, finished = [], 0, False
        for turn in range(limit):
            s += sgl.assistant(sgl.gen(f"call{turn}", max_tokens=max_new, temperature=0.0, json_schema=schema))
            text = generated(f"call{turn}")
            cut = (metas[-1].get("finish_reason") or {}).get("type") == "length"
            tool, reply, ok = respond(world, text, cut)
            if tool is not None:
                tools.append(tool)
            errors += not ok
            if tool == FINAL and ok:
                finished = True
                break
            s += sgl.user(reply)
        s += sgl.user(FINAL_PROMPT if finished else OUT_OF_TURNS)
        s += sgl.assistant(sgl.gen("answer", max_tokens=max_new, temperature=0.0))
        answer = generated("answer")
        return {"texts": texts, "metas": metas, "tools": tools, "errors": errors, "finished": finished,
                "solved": solved(answer, task.expect)}

    return agent


def task_run(task: Task, out: dict, seconds: float) -> TaskRun:
    """A TaskRun from the program's return value (`agent_program`) and its wall time."""
    metas = out["metas"]
    spec = [m for m in metas if m.get("spec_verify_ct")]
    return TaskRun(task.id, round(seconds, 3), tuple(out["texts"]), tuple(out["tools"]), out["errors"],
                   out["finished"], out["solved"], sum(int(m.get("completion_tokens") or 0) for m in metas),
                   sum(int(m.get("prompt_tokens") or 0) for m in metas),
                   sum(int(m.get("cached_tokens") or 0) for m in metas),
                   sum(int(m["spec_verify_ct"]) for m in spec),
                   round(sum(float(m.get("spec_accept_length") or 0) * int(m["spec_verify_ct"]) for m in spec), 3))


def run_task(program, backend, task: Task, world: World, limit: int, max_new: int) -> TaskRun:
    t0 = time.perf_counter()
    state = program.run(task=task, world=world, limit=limit, max_new=max_new, backend=backend, temperature=0.0)
    return task_run(task, state.ret_value, time.perf_counter() - t0)


def run_agents(program, backend, tasks: list[Task], world: World, agents: int, max_turns: int, max_new: int,
               progress=print, label: str = "") -> tuple[float, list[TaskRun]]:
    """All `tasks` with `agents` of them in flight at once (each its own program run in a thread, the next task
    starting as one ends): the wall time of all of them and each one's run, in the tasks' order."""
    runs: list[TaskRun | None] = [None] * len(tasks)
    pool = cf.ThreadPoolExecutor(max(1, min(agents, len(tasks))))
    try:
        t0 = time.perf_counter()
        futures = {pool.submit(run_task, program, backend, t, world, min(t.limit, max_turns), max_new): i
                   for i, t in enumerate(tasks)}
        for n, fut in enumerate(cf.as_completed(futures), 1):
            i = futures[fut]
            runs[i] = r = fut.result()
            progress(f"  {label}: {n}/{len(tasks)} tasks done ({r.id}: {r.turns} turns, {r.tokens} tokens, "
                     f"{r.seconds:.1f} s)")
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return wall, runs

# ---------------------------------------------------------------------------------------------------------------
# passes, transcripts, summaries


@dataclass(frozen=True)
class Pass:
    """One system's run of all tasks at one number of agents in one repeat of one wave."""

    system: str
    wave: int
    repeat: int
    agents: int
    seconds: float
    runs: tuple[TaskRun, ...]
    equal_to_plain: int | None = None   # transcripts equal to plain-entmtp's; None: not compared
    compared: int = 0                   # transcripts compared

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.runs)

    @property
    def turns(self) -> int:
        return sum(r.turns for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def cached_share(self) -> float | None:
        prompt = sum(r.prompt_tokens for r in self.runs)
        return sum(r.cached_tokens for r in self.runs) / prompt if prompt else None

    @property
    def accept(self) -> float | None:
        steps = sum(r.verify_steps for r in self.runs)
        return sum(r.accepted for r in self.runs) / steps if steps else None

    @property
    def solved(self) -> int:
        return sum(r.solved for r in self.runs)


def transcripts_equal(runs, reference: dict, agents: int) -> tuple[int, int]:
    """(transcripts of `runs` equal to the reference's on the same task at the same number of agents, transcripts
    with a reference to compare with)."""
    pairs = [(r.transcript, reference[(agents, r.id)]) for r in runs if (agents, r.id) in reference]
    return sum(tuple(a) == tuple(b) for a, b in pairs), len(pairs)


def compare_round(done: dict[str, Pass], specs: dict[str, SystemSpec], reference: dict) -> dict[str, Pass]:
    """A round's passes (one per system, the same agents and repeat) with their transcripts compared with
    plain-entmtp's: its first pass at each number of agents makes the reference (and is not compared with itself);
    a server in a dtype of its own (stock bfloat16) is compared with nothing."""
    made = False
    plain = done.get(REFERENCE)
    if plain is not None:
        for r in plain.runs:
            if (plain.agents, r.id) not in reference:
                reference[(plain.agents, r.id)] = r.transcript
                made = True
    out = {}
    for name, p in done.items():
        if specs[name].dtype is not None or (name == REFERENCE and made):
            out[name] = p
            continue
        equal, compared = transcripts_equal(p.runs, reference, p.agents)
        out[name] = dataclasses.replace(p, equal_to_plain=equal if compared else None, compared=compared)
    return out


def paired(passes: list[Pass], system: str, ref: str, agents: int) -> list[float]:
    """Per repeat (and wave), `ref`'s end-to-end time over `system`'s, `ref` measured beside it: how many times
    faster `system` ran all tasks."""
    mine = {(p.wave, p.repeat): p.seconds for p in passes if (p.system, p.agents) == (system, agents)}
    theirs = {(p.wave, p.repeat): p.seconds for p in passes if (p.system, p.agents) == (ref, agents)}
    return [theirs[k] / mine[k] for k in sorted(mine) if k in theirs and mine[k] > 0]


def ratio_cell(ratios: list[float]) -> str:
    """The median paired ratio, with a 95% bootstrap interval where there are several."""
    if not ratios:
        return ""
    med = statistics.median(ratios)
    if len(ratios) < 2:
        return f"{med:.2f}x"
    lo, hi = bootstrap_interval(ratios)
    return f"{med:.2f}x [{lo:.2f}-{hi:.2f}]"


@dataclass(frozen=True)
class Summary:
    """One system at one number of agents over its passes (medians over repeats)."""

    system: str
    agents: int
    passes: int
    seconds: float              # all tasks, end to end
    task_seconds: float         # one task, over every task of every pass
    tokens_per_s: float
    turns: float
    cached_share: float | None
    accept: float | None
    equal: int                  # transcripts equal to plain-entmtp's, over all passes
    compared: int
    solved: int                 # the fewest tasks solved in a pass
    tasks: int


def summarize(passes: list[Pass], order=tuple(s.name for s in SYSTEMS)) -> list[Summary]:
    """Per number of agents and system (in `order`, then others by name): medians over the passes."""
    keys = sorted({(p.agents, p.system) for p in passes},
                  key=lambda k: (k[0], order.index(k[1]) if k[1] in order else len(order), k[1]))
    out = []
    for agents, system in keys:
        ps = [p for p in passes if (p.agents, p.system) == (agents, system)]
        shares = [s for p in ps if (s := p.cached_share) is not None]
        accepts = [a for p in ps if (a := p.accept) is not None]
        out.append(Summary(system, agents, len(ps), statistics.median(p.seconds for p in ps),
                           statistics.median(r.seconds for p in ps for r in p.runs),
                           statistics.median(p.tokens_per_s for p in ps), statistics.median(p.turns for p in ps),
                           statistics.median(shares) if shares else None,
                           statistics.median(accepts) if accepts else None,
                           sum(p.equal_to_plain or 0 for p in ps), sum(p.compared for p in ps),
                           min(p.solved for p in ps), len(ps[0].runs)))
    return out


def table(passes: list[Pass]) -> str:
    """The results: per number of agents and system, end-to-end time, its paired ratios over stock bfloat16 and
    plain-entmtp, tokens/s, turns, the radix cache's share of the prompts, accepted tokens per verify step, equal
    transcripts and tasks solved."""
    lines = ["| agents | system | all tasks, s | a task, s | output tok/s | turns | vs stock bf16, paired | "
             "vs plain-entmtp, paired | prompt tokens cached | accepted per verify step | transcripts = plain | "
             "solved |", "|---" * 12 + "|"]
    for s in summarize(passes):
        over = [ratio_cell(paired(passes, s.system, ref, s.agents)) if s.system != ref else ""
                for ref in (STOCK_BF16.name, PLAIN_ENTMTP.name)]
        cached = "" if s.cached_share is None else f"{s.cached_share:.0%}"
        accept = "" if s.accept is None else f"{s.accept:.2f}"
        equal = f"{s.equal}/{s.compared}" if s.compared else "-"
        lines.append(f"| {s.agents} | {s.system} | {s.seconds:.1f} | {s.task_seconds:.1f} | {s.tokens_per_s:.1f} | "
                     f"{s.turns:g} | {over[0]} | {over[1]} | {cached} | {accept} | {equal} | {s.solved}/{s.tasks} |")
    return "\n".join(lines)


def task_table(passes: list[Pass], goals: dict[str, str] | None = None) -> str:
    """Per task, at the fewest agents of the run: each system's median time on it, its turns and whether it solved
    the task in every repeat."""
    if not passes:
        return ""
    agents = min(p.agents for p in passes)
    systems = [s.system for s in summarize(passes) if s.agents == agents]
    ids = list(dict.fromkeys(r.id for p in passes for r in p.runs))
    lines = ["| task | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for tid in ids:
        cells = []
        for system in systems:
            rs = [r for p in passes if (p.system, p.agents) == (system, agents) for r in p.runs if r.id == tid]
            if not rs:
                cells.append("")
                continue
            turns = statistics.median(r.turns for r in rs)
            cells.append(f"{statistics.median(r.seconds for r in rs):.1f} s, {turns:g} turns"
                         + (", solved" if all(r.solved for r in rs) else ""))
        goal = (goals or {}).get(tid)
        lines.append(f"| {tid}" + (f": {goal}" if goal else "") + " | " + " | ".join(cells) + " |")
    return (f"Per task with {agents} agent{'s' if agents > 1 else ''} (median seconds over repeats, turns, "
            "'solved' where the final answer had what the task asks for in every repeat):\n\n" + "\n".join(lines))


def goals(passes: list[Pass]) -> str:
    """Issue 60's goals for each ENTMTP server of the run, each said plainly met or not (a goal the run did not
    measure, said so)."""
    names = {p.system for p in passes}
    said = []
    for system in [n for n in SPECULATIVE if n in names]:
        for ref, agents, least in GOALS:
            ratios = paired(passes, system, ref, agents)
            head = f"- `{system}` at least {least:.1f}x `{ref}` with {agents} agent{'s' if agents > 1 else ''}: "
            if not ratios:
                said.append(head + f"not measured (no run of both with {agents} agent{'s' if agents > 1 else ''})")
                continue
            x = statistics.median(ratios)
            said.append(head + f"{ratio_cell(ratios)} {'met' if x >= least else '**NOT met**'}")
        ps = [p for p in passes if p.system == system]
        equal, compared = sum(p.equal_to_plain or 0 for p in ps), sum(p.compared for p in ps)
        said.append(f"- `{system}`'s transcripts equal to `{REFERENCE}`'s: "
                    + (f"{equal}/{compared} {'met' if equal == compared else '**NOT met**'}" if compared
                       else "not measured"))
    if not said:
        return ""
    return ("Goals (issue 60), end-to-end time of all tasks, paired (the median of the per-repeat ratios, the "
            "baseline measured beside in the same wave and repeat; in brackets a 95% bootstrap interval over the "
            "repeats):\n" + "\n".join(said))


def headline(passes: list[Pass], meta: dict | None = None) -> str:
    """The README's few lines: a sentence on the run, then per system at each number of agents the time of all tasks
    and its paired gains over plain on `entmtp_torch` and stock in bfloat16, and the transcripts equal to plain's."""
    meta = meta or {}
    counts = sorted({p.agents for p in passes})
    rows: dict[str, dict[int, str]] = {}
    equal: dict[str, list[int]] = {}
    for s in summarize(passes):
        over = [ratio_cell(paired(passes, s.system, ref, s.agents)).split(" [")[0] if s.system != ref else "1.00x"
                for ref in (PLAIN_ENTMTP.name, STOCK_BF16.name)]
        rows.setdefault(s.system, {})[s.agents] = f"{s.seconds:.1f} s **{over[0]}** ({over[1]})"
        counted = equal.setdefault(s.system, [0, 0])
        counted[0] += s.equal
        counted[1] += s.compared
    plural = {n: f"{n} agent{'s' if n > 1 else ''}" for n in counts}
    lines = ["| system | " + " | ".join(plural[n] for n in counts) + " | transcripts = plain |",
             "|---" * (len(counts) + 2) + "|"]
    for system, cells in rows.items():
        e, c = equal[system]
        lines.append(f"| {system} | " + " | ".join(cells.get(n, "") for n in counts) + " | "
                     + (f"{e}/{c}" if c else "-") + " |")
    tasks = meta.get("task_set") or []
    repeats = len({p.repeat for p in passes})
    machine_said = f" on {meta['processor']}" if meta.get("processor") else ""
    commit = str(meta.get("commit", ""))[:7]
    numbers = ", ".join(str(n) for n in counts[:-1]) + (" and " if len(counts) > 1 else "") + plural[counts[-1]]
    return (f"{len(tasks)} agent tasks (`bench/agent_pipeline.py`), each a few turns of tool calls under a JSON "
            f"schema, then a final answer, with {numbers} at once{machine_said}"
            + (f", commit {commit}" if commit else "") + f"; all tasks' time, median of {repeats} repeat(s), in bold "
            f"the paired gain over `{PLAIN_ENTMTP.name}` (plain on `entmtp_torch`), in brackets over stock in "
            "bfloat16:\n\n" + "\n".join(lines))


def report(passes: list[Pass], meta: dict | None = None) -> str:
    """The Markdown of a run: what was measured, the table, the goals, the per-task table."""
    meta = meta or {}
    head = []
    if meta.get("processor"):
        head.append(f"Processor: {meta['processor']}; {meta.get('cpus', '?')} CPUs; commit "
                    f"{str(meta.get('commit', ''))[:7] or '?'}.")
    tasks = meta.get("task_set") or []
    if meta:
        head.append(f"{meta.get('model', '?')}, {len(tasks)} agent tasks (bench/workloads/agent_tasks.json), each a "
                    "program of SGLang's frontend language: tool calls under a JSON schema, the tools' results as "
                    f"the next turn, a free-text final answer; at most {meta.get('max_turns', '?')} tool-call turns "
                    f"and {meta.get('max_new_tokens', '?')} new tokens a generation; greedy, float32 (stock bf16 in "
                    f"bfloat16); {len({x.repeat for x in passes})} repeat(s), each server from "
                    "an empty radix cache in each pass, the servers of a wave in a seeded random order "
                    f"(seed {meta.get('seed', '?')}). N agents: N tasks in flight at once until all are done. "
                    "Transcripts (the texts of all turns of a task) are compared with `plain-entmtp`'s on the same "
                    "task at the same number of agents; `plain-stock-bf16`'s with nothing.")
    parts = ["\n\n".join(head), table(passes), goals(passes),
             task_table(passes, {t["id"]: t["goal"] for t in tasks if isinstance(t, dict)})]
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------------------------
# the JSON lines


def pass_dict(p: Pass) -> dict:
    return dataclasses.asdict(p)


def pass_from(d: dict) -> Pass:
    runs = tuple(TaskRun(**{**r, "transcript": tuple(r["transcript"]), "tools": tuple(r["tools"])})
                 for r in d["runs"])
    return Pass(**{**d, "runs": runs})


def write(passes: list[Pass], out_dir: Path, config: dict) -> None:
    """agent_pipeline.jsonl.gz (a line per pass, the run's configuration and machine on every line, as
    sglang_benchmark.write puts them) and agent_pipeline.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {**config, **machine()}
    with gzip.open(out_dir / f"{NAME}.jsonl.gz", "wt") as f:
        for p in passes:
            f.write(json.dumps({**meta, "kind": "pass", "pass": pass_dict(p)}) + "\n")
    (out_dir / f"{NAME}.md").write_text(report(passes, meta) + "\n")


def read(path: Path) -> tuple[list[Pass], dict]:
    """A run's passes and its configuration (with the machine) from its JSON lines (`.jsonl` or `.jsonl.gz`)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    passes, meta = [], {}
    for line in text.splitlines():
        d = json.loads(line)
        if d.get("kind") != "pass":
            continue
        passes.append(pass_from(d.pop("pass")))
        meta = meta or {k: v for k, v in d.items() if k != "kind"}
    if not passes:
        raise ValueError(f"{path}: no passes in it (not a run of {NAME}.py?)")
    return passes, meta


# ---------------------------------------------------------------------------------------------------------------
# the run

SYSTEM_BUDGET = 384   # tokens: the system turn (the tools, the products, the files) and the goal (277 at most)
TURN_BUDGET = 128     # tokens beside each call: a tool's answer (the longest file: 101) and the turn markers


def kv_tokens(agents: int, turns: int, max_new: int) -> int:
    """--max-total-tokens for `agents` conversations of `turns` tool calls at once, the final answer too (at least
    6000, as bench/sglang_speed.py gives, rounded up to 1024)."""
    one = SYSTEM_BUDGET + turns * (max_new + TURN_BUDGET) + max_new + TURN_BUDGET
    return max(6000, -(-agents * one // 1024) * 1024)


def systems_for(names: list[str]) -> list[SystemSpec]:
    """The specs to run, in SYSTEMS' order: the named ones and the baselines."""
    wanted = set(names) | set(EVERY_WAVE)
    return [s for s in SYSTEMS if s.name in wanted]


def pick_tasks(tasks: list[Task], which: str) -> list[Task]:
    """--tasks: a number (the first N) or task ids, comma-separated."""
    if which.strip().isdigit():
        n = int(which)
        if not 1 <= n <= len(tasks):
            raise ValueError(f"--tasks {n}: between 1 and {len(tasks)}")
        return tasks[:n]
    ids = [t for t in which.split(",") if t.strip()]
    by = {t.id: t for t in tasks}
    unknown = [i for i in ids if i not in by]
    if unknown or not ids:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none)'}; the tasks are {', '.join(by)}")
    return [by[i] for i in ids]


def warm(srv) -> None:
    """One tool call under the schema, unmeasured (the first request of a server pays one-off costs)."""
    srv.post("/generate", {"text": "<|im_start|>user\nCall a tool.<|im_end|>\n<|im_start|>assistant\n",
                           "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                               "json_schema": json.dumps(tool_schema())}})


def run(specs: list[SystemSpec], tasks: list[Task], world: World, agent_counts: tuple[int, ...], repeats: int,
        max_turns: int, max_new: int, seed: int, at_once: int, model: Path, on_round=None,
        progress=print) -> list[Pass]:
    """Every system's passes: the servers in `waves` (the baselines in each), per repeat and number of agents the
    wave's servers in a seeded random order, each flushed first; the round's transcripts compared with
    plain-entmtp's (`compare_round`). `on_round(passes)` after each repeat of each wave."""
    import sglang as sgl

    program = agent_program()
    by_name = {s.name: s for s in specs}
    plan = waves(specs, at_once, EVERY_WAVE)
    pool = ServerPool(ROOT / "runs" / "agent-pipeline", FLOAT32, progress, model=model, starts_at_once=2)
    passes: list[Pass] = []
    reference: dict = {}
    try:
        for w, wave in enumerate(plan):
            pool.only(wave)
            progress(f"wave {w + 1}/{len(plan)}: {', '.join(s.name for s in wave)}")
            backends = {}
            for spec in wave:
                warm(pool[spec.name])
                backends[spec.name] = sgl.RuntimeEndpoint(pool[spec.name].url, chat_template_name="chatml")
            for rep in range(repeats):
                for agents in agent_counts:
                    order = [s.name for s in wave]
                    random.Random(f"{seed}/{w}/{rep}/{agents}").shuffle(order)
                    done = {}
                    for name in order:
                        pool[name].flush_cache()
                        label = f"repeat {rep} agents {agents} {name}"
                        seconds, runs = run_agents(program, backends[name], tasks, world, agents, max_turns, max_new,
                                                   progress, label)
                        done[name] = Pass(name, w, rep, agents, round(seconds, 3), tuple(runs))
                    for name, p in compare_round(done, by_name, reference).items():
                        passes.append(p)
                        progress(f"repeat {rep} agents {agents} {name}: {len(p.runs)} tasks in {p.seconds:.1f} s, "
                                 f"{p.tokens} tokens ({p.tokens_per_s:.1f} tok/s), {p.turns} turns, prompt cached "
                                 f"{p.cached_share or 0:.0%}, accept {p.accept or 0:.2f}, transcripts = plain "
                                 f"{'-' if p.equal_to_plain is None else f'{p.equal_to_plain}/{p.compared}'}, "
                                 f"solved {p.solved}/{len(p.runs)}")
                if on_round is not None:
                    on_round(passes)
    finally:
        pool.stop()
    return passes


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--systems", default=",".join(s.name for s in SYSTEMS), help="comma-separated, from: "
                    + ", ".join(s.name for s in SYSTEMS) + f" (default: all); {', '.join(EVERY_WAVE)}, the "
                    "baselines, always run")
    ap.add_argument("--agents", type=_ints, default=AGENTS, help="numbers of agents in flight at once, "
                    "comma-separated (default 1,4,8)")
    ap.add_argument("--tasks", default="all", help="the first N tasks of bench/workloads/agent_tasks.json, or task "
                    "ids, comma-separated (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="measured passes of every server at each number of "
                    "agents (default 3)")
    ap.add_argument("--max-turns", type=int, default=8, help="cap on every task's tool-call turns (default 8: "
                    "each task's own limit, 3-8)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="new tokens of each generation, a tool call or "
                    "the final answer (default 96)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the servers' order in each round (default 0)")
    ap.add_argument("--at-once", type=int, default=AT_ONCE, help="the most servers up together (default "
                    "%(default)s: each holds 3.5-4 GiB); the baselines in every wave")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_pipeline", help="folder of "
                    f"{NAME}.jsonl.gz and {NAME}.md (default: bench/results/agent_pipeline/)")
    ap.add_argument("--render", type=Path, metavar="JSONL", help="start no server: draw the tables and goals again "
                    f"from a run's {NAME}.jsonl.gz (into --out)")
    ap.add_argument("--headline", action="store_true", help="with --render: print the README's lines of the run "
                    "instead (its run, then per system and number of agents the time and the paired gains)")
    args = ap.parse_args()
    if args.headline and args.render is None:
        ap.error("--headline draws from a run: give --render JSONL too")
    if args.render is not None:
        try:
            passes, meta = read(args.render)
        except (OSError, ValueError) as e:
            ap.error(f"--render: {e}")
        if args.headline:
            print(headline(passes, meta))
            return
        text = report(passes, meta)
        args.out.mkdir(parents=True, exist_ok=True)
        args.out.joinpath(f"{NAME}.md").write_text(text + "\n")
        print(text)
        return
    names = [n for n in args.systems.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in SYSTEMS})
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(s.name for s in SYSTEMS)}")
    if not args.agents or min(args.agents) < 1:
        ap.error("--agents takes positive numbers, e.g. 1,4,8")
    if args.repeats < 1 or args.max_turns < 1 or args.max_new_tokens < 1:
        ap.error("--repeats, --max-turns and --max-new-tokens must be at least 1")
    if args.at_once <= len(EVERY_WAVE):
        ap.error(f"--at-once must be above {len(EVERY_WAVE)} (the baselines in every wave and a system beside them)")
    try:
        tasks, world = load_tasks()
        if args.tasks != "all":
            tasks = pick_tasks(tasks, args.tasks)
    except ValueError as e:
        ap.error(str(e))
    model = resolve_alias(args.model)
    turns = min(args.max_turns, max(t.limit for t in tasks))
    kv = kv_tokens(max(args.agents), turns, args.max_new_tokens)
    specs = [dataclasses.replace(s, args=s.args + ("--max-total-tokens", str(kv))) for s in systems_for(names)]
    t0 = time.time()
    config = {"model": model.name, "task_set": [{"id": t.id, "goal": t.goal, "limit": t.limit} for t in tasks],
              "agent_counts": list(args.agents), "repeats": args.repeats, "max_turns": args.max_turns,
              "max_new_tokens": args.max_new_tokens, "seed": args.seed, "systems": [s.name for s in specs],
              "waves": [[s.name for s in w] for w in waves(specs, args.at_once, EVERY_WAVE)],
              "every_wave": list(EVERY_WAVE), "reference": REFERENCE, "max_total_tokens": kv,
              "env": {s.name: dict(s.env) for s in specs}, "schema": tool_schema()}

    def save(passes: list[Pass]) -> None:
        rounds = len({(p.wave, p.repeat) for p in passes})   # repeats finished, over all waves
        write(passes, args.out, {**config, "rounds_done": rounds, "duration_s": round(time.time() - t0)})

    passes = run(specs, tasks, world, tuple(args.agents), args.repeats, args.max_turns, args.max_new_tokens,
                 args.seed, args.at_once, model, on_round=save)
    save(passes)
    print(report(passes, {**config, **machine()}))
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
