"""The grammar's mask on a draft node's logits inside SGLang (`sglang/grammar_draft.masked_logits`), as shipped
against the way it ran before 2026-12-06: per call, on SmolLM2's tokenizer and real grammar states.

    .venv/bin/python bench/experiments/grammar_mask.py        # about 20 s; prints the table (nothing written)

ENTMTP masks every drafted node's candidates of a constrained request, and the root's signal, with the grammar
state after the node's path (one call per expanded node and step). `now`: over a draft vocabulary (SmolLM2's drafters
have one), xgrammar's packed bitmask read at each logit's target id, one gather and a shift. `before`: the draft
vocabulary's logits scattered into a target-vocabulary row of -inf, masked there by the grammar object's own
`apply_vocab_mask`, read back at the map's ids (`_masked_by_grammar`). Over the whole vocabulary both are that
path (the rows show the spread of two identical calls). Both give the same values (asserted). The grammar object
is SGLang's own (`XGrammarGrammarBackend`) where SGLang is installed, else an xgrammar matcher with xgrammar's
masking kernel, as SGLang's calls it. Median of 9 repeats of 200 calls, the two interleaved; states: the start of a
JSON object under a held-out schema, and inside a string value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from entmtp_sglang.model.load import draft_token_map
from entmtp_sglang.model.prepare import resolve_alias
from entmtp_sglang.sglang.grammar_draft import _masked_by_grammar, masked_logits, path_bitmask
from entmtp_sglang.tasks import load_prompts, load_schema


def grammar_object(tokenizer, vocab: int, schema: str):
    try:
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    except ImportError:
        XGrammarGrammarBackend = None
    if XGrammarGrammarBackend is not None:
        backend = XGrammarGrammarBackend(tokenizer, vocab_size=vocab, model_eos_token_ids=[tokenizer.eos_token_id],
                                         any_whitespace=False)
        return backend.dispatch_json(schema), "SGLang's XGrammarGrammar"
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)

    class Grammar:   # SGLang's XGrammarGrammar as masked_logits and path_bitmask call it
        matcher = xgr.GrammarMatcher(compiled)

        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return xgr.allocate_token_bitmask(batch_size, vocab_size)

        def fill_vocab_mask(self, mask, idx):
            self.matcher.fill_next_token_bitmask(mask, idx)

        def accept_token(self, token):
            assert self.matcher.accept_token(token)

        def rollback(self, k):
            self.matcher.rollback(k)

        def is_terminated(self):
            return self.matcher.is_terminated()

        @staticmethod
        def apply_vocab_mask(logits, vocab_mask):
            xgr.apply_token_bitmask_inplace(logits, vocab_mask)

    return Grammar(), "an xgrammar matcher (SGLang not installed)"


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    model = resolve_alias("smollm2")
    tok = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    hot = torch.tensor(torch.load(draft_token_map(model / "eagle")), dtype=torch.long)
    item = next(it for it in load_prompts("json", "test") if load_schema(it).get("properties"))
    g, what = grammar_object(tok, vocab, json.dumps(load_schema(item)))
    key = next(iter(load_schema(item)["properties"]))
    inside = tok.encode('{"' + key + '": "', add_special_tokens=False)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {what}; us per call")
    print("| grammar state | logits | before (us) | now (us) | before / now, paired |")
    print("|---|---|---|---|---|")
    for state, path in (("start of the object", []), ("inside a string value", inside)):
        bitmask = path_bitmask(g, path, vocab)
        for name, ids in (("draft vocabulary (8,192, SmolLM2's EAGLE token map)", hot), ("whole vocabulary", None)):
            logits = torch.randn(hot.numel() if ids is not None else vocab, generator=gen)
            now = masked_logits(logits, g, bitmask, ids)
            assert torch.equal(now, _masked_by_grammar(logits, g, bitmask, ids)), (state, name)
            runs = {"before": [], "now": []}
            for _ in range(args.repeats):
                runs["before"].append(timed(lambda: _masked_by_grammar(logits, g, bitmask, ids), args.calls))
                runs["now"].append(timed(lambda: masked_logits(logits, g, bitmask, ids), args.calls))
            paired = statistics.median(b / n for b, n in zip(runs["before"], runs["now"]))
            print(f"| {state} ({int(torch.isfinite(now).sum())} allowed) | {name} | "
                  f"{statistics.median(runs['before']):.0f} | {statistics.median(runs['now']):.0f} | {paired:.1f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
