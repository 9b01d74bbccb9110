"""Benchmark tasks as token streams, built from the held-out ("test") split of the shipped prompt sets.

    code   HumanEval          math   GSM8K test items      chat   ShareGPT V3 first turns
    prose  MT-Bench writing/roleplay + story prompts (Litbench is not available here)
    json   prompts for real SchemaStore schemas (decoded without a grammar here; see bench/experiments/json_grammar.py)
    mixed  an agent-style session of three turns: prose, then JSON, then code

Mixed: turn k's prompt is the whole session so far (turn 1 prompt, its reply, ..., turn k prompt), left-
truncated to fit the context. The replies are the greedy plain-decoding outputs, computed once before any
timing, so every system sees identical inputs; a system keeps its policy state across the three turns.
When a task has fewer test prompts than streams needed (prose has 20), prompts are reused in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..tasks import load_prompts
from .systems import Stream, TaskStreams

TASKS = ("code", "math", "chat", "prose", "json", "mixed")
MIXED_TURNS = ("prose", "json", "code")
SPLIT = "test"


@dataclass
class BenchContext:
    """What systems share within one benchmark run (models, measured costs, hindsight records)."""

    model_dir: Path | None = None  # None: the bundled entmtp-tiny
    cost_steps: int = 6  # engine steps timed per tree and batch size when measuring tree costs
    cost_rounds: int = 2  # interleaved timing rounds; the lowest per-round median is kept
    oracle_max_batch: int = 0  # the oracle runs only at batch sizes up to this (0: all)
    max_prompt_tokens: int = 0  # cap on prompt length (0: fill the context)
    log: object = print
    cache: dict | None = None

    def __post_init__(self):
        if self.cost_steps < 1 or self.cost_rounds < 1:
            raise ValueError("cost_steps and cost_rounds must be >= 1")
        self.cache = {} if self.cache is None else self.cache

    def get(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


@dataclass(frozen=True)
class ToolCall:
    """One tool-call request: the system turn that offers the tool, the user's turn, and the schema of the call
    (`{"name": <the tool>, "arguments": <its parameters>}`) that constrains the answer."""

    tool: str
    system: str
    user: str
    schema: dict


def tool_calls(spec_path: Path | dict, limit: int | None = None) -> list[ToolCall]:
    """The requests of a tool-call spec (bench/workloads/tool_calls.json: `tools` by name with a description and
    JSON-schema `parameters`, `requests` naming a tool and the user's turn), in order, at most `limit`. `spec_path`:
    the file, or the spec itself (a dict: bench/workloads/measure.json's `tool_calls`)."""
    spec = spec_path if isinstance(spec_path, dict) else json.loads(Path(spec_path).read_text())
    out = []
    for req in spec["requests"][:limit]:
        name = req["tool"]
        if name not in spec["tools"]:
            raise ValueError(f"{spec_path}: a request names tool {name!r}, which `tools` does not define")
        tool = spec["tools"][name]
        schema = {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "arguments": tool["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
        system = (f"You can call one tool, {name}: {tool['description']} Parameters: "
                  f"{json.dumps(tool['parameters'])}. Answer with the call as JSON: "
                  '{"name": ..., "arguments": ...}.')
        out.append(ToolCall(name, system, req["user"], schema))
    return out


def prompt_set_digests() -> dict[str, str]:
    """sha256 (first 16 hex digits) of each shipped prompt-set file: the version the results refer to."""
    import hashlib

    from ..tasks import TASKS as PROMPT_TASKS
    from ..tasks import prompts_dir

    return {t: hashlib.sha256((prompts_dir() / f"{t}.jsonl").read_bytes()).hexdigest()[:16] for t in PROMPT_TASKS}


def room(context_tokens: int, max_new_tokens: int) -> int:
    """Prompt tokens kept (the last ones) so that prompt + output + a tree fit the model context."""
    r = context_tokens - max_new_tokens - 8
    if r < 16:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in a "
                         f"{context_tokens}-token context")
    return r


def _items(task: str, n: int) -> list[dict]:
    items = load_prompts(task, SPLIT)
    if not items:
        raise ValueError(f"task {task!r} has no {SPLIT} prompts")
    return [items[i % len(items)] for i in range(n)]


def build_streams(task: str, n: int, tokenizer, context_tokens: int, max_new_tokens: int,
                  plain_generate=None, eos_token_id: int | None = None,
                  max_prompt_tokens: int = 0) -> TaskStreams:
    """`n` streams of `task`. `plain_generate(list_of_ids, max_new_tokens) -> list_of_output_ids` is
    needed for the mixed task only (the greedy replies that the later turns carry). Prompts keep their
    last tokens: as many as fit the context, or `max_prompt_tokens` if smaller (0: no cap)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if not hasattr(tokenizer, "item_ids"):  # a bare tokenizers.Tokenizer: prompts as written, no template
        from ..model.load import PromptTokenizer

        tokenizer = PromptTokenizer(tokenizer)
    keep = room(context_tokens, max_new_tokens)
    if max_prompt_tokens > 0:
        keep = min(keep, max_prompt_tokens)
    if task != "mixed":
        streams = []
        for it in _items(task, n):
            ids = tuple(tokenizer.item_ids(it, keep))
            streams.append(Stream((ids,), (tokenizer.decode(list(ids)),), (it["id"],)))
        return TaskStreams(task, tuple(streams))
    if plain_generate is None:
        raise ValueError("the mixed task needs plain_generate to compute the earlier turns' replies")
    turns = [_items(t, n) for t in MIXED_TURNS]
    session = [[] for _ in range(n)]  # token ids of the session so far
    segments: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    for k, items in enumerate(turns):
        prompts = []
        for i, it in enumerate(items):
            turn = tokenizer.item_ids(it) if k == 0 else tokenizer.next_turn_ids(it)
            session[i] = (session[i] + turn)[-keep:]
            prompts.append(list(session[i]))
            segments[i].append(tuple(session[i]))
        if k + 1 < len(turns):
            replies = plain_generate(prompts, max_new_tokens)
            for i, out in enumerate(replies):
                session[i] = session[i] + [t for t in out if t != eos_token_id]
    streams = []
    for i in range(n):
        ids = tuple(turns[k][i]["id"] for k in range(len(turns)))
        streams.append(Stream(tuple(segments[i]), tuple(tokenizer.decode(list(s)) for s in segments[i]), ids))
    return TaskStreams("mixed", tuple(streams))
