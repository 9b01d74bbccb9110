"""Task prompt sets shipped with the package (built by `training.corpus`; see bench/TASKS.md).

Each task has a `calib` split (calibration only) and a `test` split (benchmarks only); neither was
used in training.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

TASKS = ("code", "math", "chat", "prose", "json")


def prompts_dir() -> Path:
    return Path(str(resources.files("entmtp_sglang") / "data" / "prompts"))


def load_prompts(task: str, split: str | None = None, limit: int | None = None) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if split not in (None, "calib", "test"):
        raise ValueError(f"split must be calib or test, not {split!r}")
    items = []
    with open(prompts_dir() / f"{task}.jsonl") as f:
        for line in f:
            item = json.loads(line)
            if split is None or item["split"] == split:
                items.append(item)
    return items[:limit] if limit else items


def load_schema(item: dict) -> dict:
    return json.loads((prompts_dir() / item["schema_file"]).read_text())


def interleave(tasks: tuple[str, ...], split: str, per_task: int) -> list[dict]:
    """A mixed calibration stream: prompts of several tasks, alternating."""
    lists = [load_prompts(t, split, per_task) for t in tasks]
    out = []
    for i in range(per_task):
        for items in lists:
            if i < len(items):
                out.append(items[i])
    return out


_USER_TURN = re.compile(r"\AUser: (.*)\nAssistant: \Z", re.S)
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


def user_message(item: dict) -> str:
    """The user's request in a shipped prompt, for a model that has a chat template.

    Shipped prompts are written for the bundled model ("User: ...\nAssistant: "; code prompts are raw
    HumanEval code): the former is unwrapped, the latter asked as "complete this function"."""
    text = item["prompt"]
    m = _USER_TURN.match(text)
    if m:
        return m.group(1)
    if item.get("task") == "code":
        return CODE_INSTRUCTION.format(code=text.rstrip("\n") + "\n")
    return text


def render_chat(chat_template: str, user: str) -> str:
    """One user turn through a Hugging Face chat template, ready for the assistant's answer."""
    return render_messages(chat_template, [{"role": "user", "content": user}])


def render_messages(chat_template: str, messages: list[dict]) -> str:
    """A conversation through a Hugging Face chat template, ready for the assistant's answer."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env.from_string(chat_template).render(messages=messages, add_generation_prompt=True)


def prompt_text(item: dict, chat_template: str | None) -> str:
    """The text to feed a model: the shipped prompt as it is, or through the model's chat template."""
    return item["prompt"] if not chat_template else render_chat(chat_template, user_message(item))
