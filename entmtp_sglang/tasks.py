"""Task prompt sets shipped with the package (built by `training.corpus`; see bench/TASKS.md).

Each task has a `calib` split (calibration only) and a `test` split (benchmarks only); neither was
used in training.
"""

from __future__ import annotations

import json
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
