"""Long prompts: ENTMTP against stock SGLang at batch 1 with 1k to 4k tokens of context, and a follow-up question.

Each conversation is about a long document: Python source files and project READMEs of packages that SGLang's own
install brings (requests, jinja2, openai, tqdm: text none of the drafters was trained on, which saw CPython's
standard library, ShareGPT and JSON documents), cut at a line boundary to the context length in tokens, through
SmolLM2's chat template. Every system answers every document in two turns in a row, as a user reads a document with
the model: **cold**, the document and a first question after emptying its radix cache (the prefill of the whole
document is in the time, as for a new document), then **follow-up**, a second, different question on the same
document after the model's first answer: the conversation [user: document and first question, assistant: the first
answer, user: the second question], whose prefix (the document and the first turn) the radix cache holds from the
cold pass and whose new question (and answer) it does not. The first answer in every system's follow-up is stock
SGLang's, from its cold pass on that document (cut at --max-new-tokens, as the user read it): every system then
gets the very same follow-up prompt, so its follow-up output can be compared with stock's token for token, where a
system's own first answer would give a system whose answer drifted a prompt of its own (and nothing to compare its
output with); the radix cache of a system whose cold answer equals stock's holds that answer too. Greedy, float32,
batch 1, the servers measured interleaved (stock first: its cold answers make the follow-ups), the median over
repeats and the paired ratio (median of the per-repeat ratios); every output is compared with stock SGLang's. The
table gives the share of prompt tokens the radix cache served in each pass: none cold, most but not all on the
follow-up (its new question and the template's turn markers are not in the cache).

A third server decodes plainly (no speculation) with this package (its CPU linear layers) on ENTMTP's attention
backend (`entmtp_torch`) instead of SGLang's `torch_native`: at long context the attention over the prompt is much
of a decode step, and the two backends read it differently, so the table separates what ENTMTP's layers and
attention give from what speculation adds on them.

    .venv/bin/python bench/sglang_long_context.py     # about 35 minutes on 2 cores; bench/results/sglang_long_context/
    .venv/bin/python bench/sglang_long_context.py --contexts 512 --max-new-tokens 16 --repeats 1 --out /tmp/lc
                                                       # a smoke run (a few minutes)

Stock SGLang is the baseline (`plain-stock`: this package's general plugin not loaded; see
entmtp_sglang/bench/sglang_benchmark.py); ENTMTP runs as `make serve` starts it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path

from entmtp_sglang.bench.sglang_benchmark import (
    STOCK,
    Row,
    ServerPool,
    SystemSpec,
    compare,
    machine,
    measure,
    medians,
    paired_ratio,
    timed_pass,
    write,
)
from entmtp_sglang.model.prepare import resolve_alias

ROOT = Path(__file__).resolve().parent.parent
ENTMTP = SystemSpec("entmtp", "ENTMTP")
# plain decoding (no speculation) with this package (its CPU layers), on ENTMTP's attention backend instead of SGLang's
# torch_native: what ENTMTP's layers and attention give at long context, so that the table can say what speculation
# adds on top
PLAIN_ENTMTP_ATTENTION = SystemSpec("plain-entmtp-attention", None, attention="entmtp_torch")
# each document with its first question after emptying the radix cache, then at once the second question after the
# first answer (the document and first turn cached)
HOW = ("cold", "follow-up")
LIMIT = 8000   # tokens a conversation may reach: SmolLM2 reads 8,192, the rest for the template and the questions


@dataclass(frozen=True)
class Document:
    """A long document and the two questions a user asks about it: the first with the document, the second (a
    different one) after reading the model's answer to the first."""

    dist: str        # the installed distribution it comes from
    file: str        # a file inside it, or "README" for its long description
    question: str
    follow_up: str


DOCUMENTS = (
    Document("requests", "requests/sessions.py", "Explain what the code above does, function by function.",
             "Which function above would you test first, and how?"),
    Document("jinja2", "jinja2/lexer.py", "Rewrite the first function defined above with type hints and a docstring.",
             "Which regular expressions does the code above compile, and what does each match, with an example?"),
    Document("openai", "README", "Summarize the document above in a few sentences.",
             "Which Python versions does the document above say the library supports, and what are its clients "
             "built on?"),
    Document("tqdm", "README",
             "List the main ways the document above says the library can be used, with an example of each.",
             "How does the document above use tqdm in a shell pipe, and what does its `--bytes` option do there?"),
)


def document(dist: str, file: str) -> str:
    """A source file of an installed distribution, or its long description (the README on PyPI)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"{dist} is not installed: the long-context documents come from SGLang's own install "
                         "(make sglang)") from None
    if file == "README":
        text = d.metadata.get_payload() or d.metadata.get("Description") or ""
    else:
        text = Path(d.locate_file(file)).read_text()
    if not text.strip():
        raise SystemExit(f"{dist}: {file} is empty")
    return text


def cut(tokenizer, text: str, tokens: int) -> str:
    """The longest run of whole lines from the start of `text` within `tokens` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"a document holds {len(ids)} tokens, under the context asked for ({tokens})")
    head = tokenizer.decode(ids[:tokens])
    return head[:head.rfind("\n")] if "\n" in head else head


def documents(tokenizer, context: int) -> list[str]:
    """DOCUMENTS' texts, each cut to `context` tokens (`cut`), in their order."""
    return [cut(tokenizer, document(d.dist, d.file), context) for d in DOCUMENTS]


def conversation(doc: str, about: Document, answer: str | None = None) -> list[dict]:
    """The chat about `doc`: the user's document and first question; with the model's `answer` to it, that answer
    and the user's follow-up question after it."""
    turns = [{"role": "user", "content": f"{doc}\n\n{about.question}"}]
    if answer is not None:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": about.follow_up}]
    return turns


def payload(tokenizer, turns: list[dict], max_new: int) -> dict:
    """A greedy /generate request for the model's next turn in `turns`, through the model's chat template."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}}


def answer(tokenizer, ids: list[int]) -> str:
    """An output's text as the server returns it to a client (special tokens, the end of turn among them, left out):
    what goes back into the conversation as the assistant's turn."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def follow_up(tokenizer, doc: str, about: Document, first_ids: list[int], max_new: int) -> dict:
    """The second turn on `doc`: the request for the answer to `about.follow_up`, after the first question and the
    model's answer to it (`first_ids`: stock SGLang's output token ids on the first turn, the same for every system)."""
    return payload(tokenizer, conversation(doc, about, answer(tokenizer, first_ids)), max_new)


def add(row: Row, one: Row) -> None:
    """Sum one request's measurement into `row` (the same workload's total over its documents)."""
    row.tokens, row.seconds, row.requests = row.tokens + one.tokens, row.seconds + one.seconds, row.requests + 1
    row.prompt_tokens += one.prompt_tokens
    row.cached_tokens += one.cached_tokens
    row.accept_lengths += one.accept_lengths
    if one.equal_to_stock is not None:
        row.equal_to_stock = (row.equal_to_stock or 0) + one.equal_to_stock
    for attr in ("forced", "lookup"):
        a, b = getattr(row, attr), getattr(one, attr)
        if b:
            setattr(row, attr, [x + y for x, y in zip(a or [0, 0, 0], b)])


def table(rows: list[Row], contexts: list[int]) -> str:
    """Per context and turn (cold, follow-up): stock, plain decoding on ENTMTP's attention backend and ENTMTP, each
    ratio over stock (ratio of medians, then paired), and ENTMTP over the plain run on its own backend (what
    speculation adds)."""
    by = {(r.task, r.system): r for r in rows}
    lines = ["| context (tokens) | turn | prompt tokens cached (stock / ENTMTP) | stock tok/s | "
             "plain on ENTMTP's attention, vs stock (paired) | ENTMTP tok/s | ENTMTP vs stock (paired) | "
             "ENTMTP vs plain on its attention | mean accepted length | greedy = stock | ENTMTP's spans |",
             "|---" * 11 + "|"]
    for ctx in contexts:
        for how in HOW:
            task = f"{ctx}-{how}"
            base, mid, ent = (by.get((task, s.name)) for s in (STOCK, PLAIN_ENTMTP_ATTENTION, ENTMTP))
            if base is None or ent is None:
                continue

            def vs(r: Row | None) -> str:
                if r is None:
                    return ""
                paired = paired_ratio(r, base)
                return f"{r.tokens_per_s / base.tokens_per_s:.2f}x" + ("" if paired is None else f" ({paired:.2f}x)")

            cached = " / ".join(f"{r.cached_tokens / max(r.prompt_tokens, 1):.0%}" for r in (base, ent))
            over = "" if mid is None else f"{ent.tokens_per_s / mid.tokens_per_s:.2f}x"
            lines.append(f"| {ctx} | {how} | {cached} | {base.tokens_per_s:.1f} | "
                         f"{'' if mid is None else f'{mid.tokens_per_s:.1f}, {vs(mid)}'} | {ent.tokens_per_s:.1f} | "
                         f"{vs(ent)} | {over} | {ent.mean_accept or 0:.2f} | {ent.equal_to_stock}/{ent.requests} | "
                         f"{ent.forced_summary} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model directory or alias (default: smollm2)")
    ap.add_argument("--contexts", default="1024,4096", help="document lengths in tokens, comma-separated "
                    "(default: 1024,4096; SmolLM2 reads 8,192)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sglang_long_context")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    # the follow-up holds the document, the first answer and the second answer
    if not contexts or min(contexts) < 64 or max(contexts) + 2 * args.max_new_tokens > LIMIT:
        ap.error(f"--contexts {args.contexts!r} with --max-new-tokens {args.max_new_tokens}: each context between 64 "
                 f"and {LIMIT - 2 * args.max_new_tokens} tokens")
    if args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--repeats and --max-new-tokens must be at least 1")
    from transformers import AutoTokenizer

    model = resolve_alias(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = {ctx: documents(tokenizer, ctx) for ctx in contexts}
    first = {ctx: [payload(tokenizer, conversation(doc, about), args.max_new_tokens)
                   for doc, about in zip(docs[ctx], DOCUMENTS)] for ctx in contexts}
    # (context, document) -> the follow-up request, made from stock SGLang's first answer on its first cold pass
    follow_ups: dict[tuple[int, int], dict] = {}
    # a conversation (the document, two questions, two answers: under a context and two answers) with room to spare
    kv = ("--max-total-tokens", str(2 * (max(contexts) + args.max_new_tokens) + 1024))
    systems = [dataclasses.replace(s, args=s.args + kv) for s in (STOCK, PLAIN_ENTMTP_ATTENTION, ENTMTP)]
    runs: dict[tuple[str, str, int], list[Row]] = collections.defaultdict(list)
    stock_tps: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    reference: dict = {}
    stock: dict = {}
    t0 = time.time()
    with ServerPool(ROOT / "runs" / "sglang-long-context", model=model, starts_at_once=2) as pool:
        for spec in systems:
            pool.add(spec)
        pool.start()
        for rep in range(args.repeats):
            for ctx in contexts:
                for spec in systems:   # stock first: its outputs are the ones every other is compared with
                    srv = pool[spec.name]
                    cold, again = passes = [Row(spec.name, 1, 0, 0.0, task=f"{ctx}-{how}") for how in HOW]
                    for k, (doc, about) in enumerate(zip(docs[ctx], DOCUMENTS)):
                        srv.flush_cache()   # each document cold (its prefill in the time), then at once its follow-up
                        one, ids = timed_pass(srv, spec, [first[ctx][k]], 1, f"{cold.task}-{k}")
                        compare(spec, one, ids, reference, stock)
                        add(cold, one)
                        if spec.name == STOCK.name:
                            follow_ups.setdefault((ctx, k), follow_up(tokenizer, doc, about, ids[0],
                                                                      args.max_new_tokens))
                        if (ctx, k) not in follow_ups:
                            raise RuntimeError(f"{spec.name} reached the follow-up on {about.dist}: {about.file} "
                                               "before stock SGLang answered its first question")
                        add(again, measure(srv, spec, [follow_ups[(ctx, k)]], 1, reference, f"{again.task}-{k}",
                                           stock))
                    for row in passes:
                        runs[(spec.name, row.task, 1)].append(row)
                        if spec.name == STOCK.name:
                            for other in systems[1:]:
                                stock_tps[(other.name, row.task, 1)].append(round(row.tokens_per_s, 2))
                        print(f"repeat {rep} {row.task} {spec.name}: {row.tokens_per_s:.1f} tok/s, accept "
                              f"{row.mean_accept or 0:.2f}, equal to stock {row.equal_to_stock} of {row.requests}, "
                              f"prompt cached {row.cached_tokens / max(row.prompt_tokens, 1):.0%}", flush=True)
    rows = medians(runs, systems, [(f"{ctx}-{how}", 1) for ctx in contexts for how in HOW], stock_tps)
    config = {"model": model.name, "contexts": contexts, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "documents": [f"{d.dist}:{d.file}" for d in DOCUMENTS],
              "questions": [[d.question, d.follow_up] for d in DOCUMENTS],
              "versions": {d.dist: importlib.metadata.version(d.dist) for d in DOCUMENTS},
              "systems": [s.name for s in systems], "baseline": STOCK.name, "duration_s": round(time.time() - t0)}
    write(rows, args.out, config, name="long_context")
    m = machine()
    text = (f"{table(rows, contexts)}\n\nSmolLM2-135M-Instruct + EAGLE, batch 1, greedy, float32, {len(DOCUMENTS)} "
            f"documents ({', '.join(config['documents'])}), {args.max_new_tokens} new tokens, median of "
            f"{args.repeats} repeats; {m.get('processor', '')}; commit {m.get('commit', '')}.")
    (args.out / "long_context.md").write_text(text + "\n")
    print(text)
    print(f"duration {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
