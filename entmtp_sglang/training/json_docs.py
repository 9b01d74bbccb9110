"""Generate JSON documents that follow a real JSON Schema (for the training corpus), and schema prompts.

Values come from the schema itself where it offers them (const, enum, examples, default) and otherwise
from small word lists; the layout is the compact one the structured-generation path also uses.
"""

from __future__ import annotations

import json
import random
import re

WORDS = (
    "alpha beta gamma delta main test build deploy release config server client user admin data "
    "service cache node python docker linux example project default local remote api version app "
    "core web public private debug info error warning name value path file source target output"
).split()

JSON_SEPARATORS = (", ", ": ")  # xgrammar's compact layout (any_whitespace=False)


def dumps(doc) -> str:
    return json.dumps(doc, separators=JSON_SEPARATORS, ensure_ascii=False)


def _resolve(schema: dict, root: dict, depth: int = 0):
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    while ref and depth < 20:
        if not ref.startswith("#"):
            return None  # external reference: not followed
        node = root
        for part in ref.lstrip("#/").split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        schema = node
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        depth += 1
    return schema


def _string(schema: dict, key: str, rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "uri" or fmt == "uri-reference":
        return f"https://example.com/{rng.choice(WORDS)}"
    if fmt == "email":
        return f"{rng.choice(WORDS)}@example.com"
    if fmt == "date":
        return f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "date-time":
        return f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T12:00:00Z"
    if "pattern" in schema:
        pat = schema["pattern"]
        if re.fullmatch(r"\^?\[a-z0-9\-_]*\]?[+*]?\$?", pat or ""):
            return rng.choice(WORDS)
    key_words = [w for w in re.split(r"[^a-zA-Z]+", key.lower()) if w]
    pool = WORDS + key_words * 3
    n = rng.choice((1, 1, 1, 2, 3))
    sep = rng.choice(("-", " ", "_", "."))
    text = sep.join(rng.choice(pool) for _ in range(n))
    max_len = schema.get("maxLength")
    return text[:max_len] if isinstance(max_len, int) and max_len > 0 else text


def instance(schema, root, rng: random.Random, key: str = "", depth: int = 0):
    """One document valid for `schema` in the common cases (a best effort, not a solver)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 5:
        return rng.choice(WORDS)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key_name in ("examples",):
        ex = schema.get(key_name)
        if isinstance(ex, list) and ex and rng.random() < 0.5:
            return rng.choice(ex)
    if "default" in schema and rng.random() < 0.3:
        return schema["default"]
    for comb in ("oneOf", "anyOf"):
        if isinstance(schema.get(comb), list) and schema[comb]:
            return instance(rng.choice(schema[comb]), root, rng, key, depth + 1)
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict = {}
        for part in schema["allOf"]:
            part = _resolve(part, root)
            if isinstance(part, dict):
                for k, v in part.items():
                    if k == "properties" and isinstance(v, dict):
                        merged.setdefault("properties", {}).update(v)
                    else:
                        merged.setdefault(k, v)
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        merged.update(rest)
        return instance(merged, root, rng, key, depth + 1)
    typ = schema.get("type")
    if isinstance(typ, list):
        typ = rng.choice([t for t in typ if t != "null"] or ["null"])
    if typ is None:
        typ = "object" if "properties" in schema else "string"
    if typ == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required") or [])
        out = {}
        # keep documents small: fewer optional keys the deeper we are, at most 8 keys per object
        p_optional = 0.5 / (1 + depth)
        for name, sub in props.items():
            if len(out) >= 8:
                break
            if name in required or rng.random() < p_optional:
                out[name] = instance(sub, root, rng, name, depth + 1)
        return out
    if typ == "array":
        items = schema.get("items", {})
        if isinstance(items, list):
            return [instance(s, root, rng, key, depth + 1) for s in items]
        lo = schema.get("minItems", 1) if isinstance(schema.get("minItems"), int) else 1
        n = max(min(lo, 3), rng.choice((1, 1, 2, 3)) if depth < 3 else 1)
        return [instance(items, root, rng, key, depth + 1) for _ in range(n)]
    if typ == "integer":
        lo = schema.get("minimum", 0) if isinstance(schema.get("minimum"), (int, float)) else 0
        hi = schema.get("maximum", lo + 100) if isinstance(schema.get("maximum"), (int, float)) else lo + 100
        return rng.randint(int(lo), int(max(lo, hi)))
    if typ == "number":
        return round(rng.uniform(0, 100), rng.choice((0, 1, 2)))
    if typ == "boolean":
        return rng.random() < 0.5
    if typ == "null":
        return None
    return _string(schema, key, rng)


def schema_title(schema: dict, fallback: str) -> str:
    title = schema.get("title") if isinstance(schema, dict) else None
    if isinstance(title, str) and 0 < len(title) < 80:
        return title
    return fallback


def schema_prompt(schema: dict, title: str) -> str:
    """The user turn that asks for a document (shared by training, calibration and benchmarks)."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    keys = ", ".join(list(props)[:12])
    line = f'Write a JSON document for the schema "{title}".'
    if keys:
        line += f" Keys: {keys}."
    return f"User: {line}\nAssistant: "
