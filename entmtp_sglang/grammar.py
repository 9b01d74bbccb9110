"""Constrained generation through xgrammar: JSON Schema, JSON object mode, regex and EBNF.

A `GrammarSpec` is compiled once per request (errors name the problem before generation starts). A
`RequestGrammar` holds one request's matcher, which has accepted every emitted token, and answers:

* `root_mask()`                 - legal next tokens now (for prefill and plain decoding);
* `tree_masks(tree, tokens)`    - legal tokens after every node of a draft tree (verification);
* `path_mask(path_tokens)`      - legal tokens after a path below the root (grammar-aware drafting);
* `forced_span(path, spell, n)` - the tokens the grammar alone decides after a path (jump-forward drafting);
* `advance(tokens)`             - accept emitted tokens; False on a dead end.

A dead end is a state where no token of the vocabulary is allowed (all masks False) although the grammar
is not complete, e.g. it needs a character that no token spells. The engine then ends the request with
finish_reason "grammar_dead_end: ..." instead of emitting a token the grammar forbids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from .tree import Tree, build_buffers

# xgrammar's compact layout: one space after ',' and ':' and no newlines (see training.json_docs)
COMPACT_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # json_schema | json | regex | ebnf
    source: str = ""
    compact: bool = True  # JSON: fixed compact layout instead of any whitespace

    def __post_init__(self):
        if self.kind not in ("json_schema", "json", "regex", "ebnf"):
            raise GrammarError(f"unknown grammar kind {self.kind!r}; use json_schema, json, regex or ebnf")
        if self.kind != "json" and not self.source.strip():
            raise GrammarError(f"empty {self.kind}")


@lru_cache(maxsize=4)
def _compiler(tokenizer_path: str, vocab_size: int):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1)


def compile_grammar(spec: GrammarSpec, tokenizer_path: str, vocab_size: int):
    comp = _compiler(str(tokenizer_path), vocab_size)
    ws = dict(any_whitespace=not spec.compact, separators=COMPACT_SEPARATORS if spec.compact else None)
    try:
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.source)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object or a boolean")
            return comp.compile_json_schema(json.dumps(schema), strict_mode=True, **ws)
        if spec.kind == "json":
            return comp.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return comp.compile_regex(spec.source)
        return comp.compile_grammar(spec.source)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        msg = re.sub(r"^\[[^\]]*\]\s*", "", msg)  # xgrammar's [time] prefix
        msg = re.sub(r"^\S+\.cc:\d+:\s*", "", msg)  # and its source location
        raise GrammarError(f"cannot compile the {spec.kind.replace('_', ' ')}: {msg}") from None


def _bool_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack xgrammar's int32 bitmask (rows, ceil(V/32)) to bool (rows, V)."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = ((bitmask.unsqueeze(-1) >> bits) & 1).bool()  # (rows, words, 32)
    return unpacked.flatten(1)[:, :vocab_size]


def _only_legal(bitmask: torch.Tensor, vocab_size: int) -> int | None:
    """The one legal token of a one-row xgrammar bitmask, None where none or several are (read off the packed
    words: one nonzero word with one bit set; unpacking the whole vocabulary costs a millisecond)."""
    n, rem = (vocab_size + 31) // 32, vocab_size % 32
    words = bitmask[0, :n]
    if rem:   # bits past the vocabulary in its last word are no tokens
        words = words.clone()
        words[-1] &= (1 << rem) - 1
    nz = torch.nonzero(words).flatten()
    if nz.numel() != 1:
        return None
    w = int(words[nz[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(nz[0]) * 32 + w.bit_length() - 1


class RequestGrammar:
    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar 0.2.7
        self.vocab_size = vocab_size
        self.dead_end = False
        self.rejected_token: int | None = None
        self.lookup = None   # a forced_spans.HistoryLookup over the request's text: lookup spans (None: off)
        self.join = None     # a forced_spans.RequestSpanEnds: the token a span ends in (None: as spelled)
        self.last_guessed: tuple[bool, ...] = ()   # the last span's tokens: whether the lookup guessed each

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def root_mask(self) -> torch.Tensor:
        if self.matcher.is_terminated():  # nothing may follow the stop token
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        bm = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bm)
        return _bool_mask(bm, self.vocab_size)[0]

    def tree_masks(self, tree: Tree, tokens: list[int]) -> torch.Tensor:
        """(N, V) legal tokens after each node (node 0 = now); nodes the grammar rejects get no legal
        tokens."""
        buf = _tree_layout(tree)
        bm = self.xgr.allocate_token_bitmask(tree.num_nodes, self.vocab_size)
        bm.zero_()
        self.matcher.traverse_draft_tree(buf[0], buf[1], torch.tensor(tokens, dtype=torch.int64), bm)
        return _bool_mask(bm, self.vocab_size)

    def path_mask(self, path: list[int]) -> torch.Tensor:
        """Legal tokens after accepting `path` (tokens below the root); all False if the path is illegal."""
        accepted = 0
        for t in path:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            accepted += 1
        if accepted < len(path):
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        else:
            mask = self.root_mask()
        if accepted:
            self.matcher.rollback(accepted)
        return mask

    def forced_span(self, path: list[int], spell, max_tokens: int) -> list[int]:
        """The tokens the grammar alone decides after `path` (tokens below the root), at most `max_tokens`:
        [] where the path is illegal or nothing is decided (`jump_forward_span` on this request's matcher); with
        `lookup` set, where the grammar decides nothing the span goes on with the request's own text repeating."""
        guessed: list[bool] = []
        out = jump_forward_span(self.matcher, path, spell, max_tokens, self.vocab_size, self.lookup, guessed,
                                self.join)
        self.last_guessed = tuple(guessed)
        return out

    def advance(self, tokens: list[int]) -> bool:
        for t in tokens:
            if self.matcher.is_terminated():
                return True  # tokens after the stop token are cut by the engine
            if not self.matcher.accept_token(int(t)):
                self.dead_end, self.rejected_token = True, int(t)
                return False
        return True


def token_allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    """xgrammar's packed bitmask: bit (token % 32) of int32 word token // 32."""
    if token < 0 or token // 32 >= bitmask_row.shape[-1]:
        return False
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def _joined(m, token: int, join, vocab_size: int) -> int:
    """The last token of a spelled jump-forward text, or the token `join` picks instead where the grammar decides
    nothing after it: one the grammar allows here whose text goes on from it (`forced_spans.RequestSpanEnds`)."""
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(1, vocab_size)
    m.fill_next_token_bitmask(bm)
    if not m.accept_token(int(token)):
        return token
    try:
        decided = m.find_jump_forward_string().strip() if not m.is_terminated() else "end"
    finally:
        m.rollback(1)
    if decided:
        return token
    other = join(int(token), lambda u: token_allowed(bm[0], u))
    return token if other is None else int(other)


def jump_forward_span(matcher, path: list[int], spell, max_tokens: int, vocab_size: int,
                      lookup=None, guessed: list | None = None, join=None) -> list[int]:
    """The tokens an xgrammar `GrammarMatcher` alone decides after `path` (tokens below its current state), at most
    `max_tokens`: [] where the path is illegal or nothing is decided. The matcher is left as found.

        accept path
        while fewer than max_tokens and not terminated:
            text = the grammar's jump-forward string (xgrammar: the text every legal continuation starts with),
                   less trailing whitespace (a tokenizer joins it to the next word: `": ` is spelled `":` ` 1`)
            if text:  take spell(text) (the tokenizer's spelling) up to its first token the grammar refuses;
                      with `join`, where the grammar decides nothing after the spelling's last token, that token
                      may give way to one that goes on from it as the model writes it (`"` -> `":`, `join`)
            elif lookup(path + taken) names a token the grammar allows: take it (the request's own text
                 repeating, `forced_spans.HistoryLookup`; a guess, not the grammar's decision, except where it
                 is the only legal token, which the next line would take anyway)
            elif exactly one token is legal (a stop token, a token only one spelling reaches): take it
            else: stop
        roll everything back

    `guessed`, if given, gets one bool per returned token: whether the lookup guessed it (else the grammar decided it).
    `join(token, allowed) -> token | None` (`forced_spans.RequestSpanEnds`): where a spelled text ends and the grammar
    decides nothing after it, a token the grammar allows there (`allowed(u)`) whose text goes on from `token`'s,
    which the model writes in place of the spelling's last token: under free whitespace the grammar's text after
    a key ends at its closing quote, but the model writes the quote and the colon as one token.
    `spell(text) -> list[int]` is the tokenizer's ordinary encoding of `text` (no special tokens). The model may
    spell the same text otherwise: the span is a draft, verified like any other. Shared by the reference engine
    (`RequestGrammar.forced_span`) and SGLang's grammar objects (`sglang/forced_draft.py`)."""
    import xgrammar as xgr

    m = matcher
    accepted = 0
    for t in path:
        if m.is_terminated() or not m.accept_token(int(t)):
            if accepted:
                m.rollback(accepted)
            return []
        accepted += 1
    out: list[int] = []
    bm = None
    try:
        while len(out) < max_tokens and not m.is_terminated():
            text = m.find_jump_forward_string().rstrip()
            took = 0
            if text:
                spelled = spell(text)
                taken = spelled[: max_tokens - len(out)]
                for j, t in enumerate(taken):
                    if join is not None and j == len(spelled) - 1:   # the whole text spelled: its last token
                        t = _joined(m, int(t), join, vocab_size)
                    if not m.accept_token(int(t)):
                        break
                    out.append(int(t))
                    took += 1
                    if guessed is not None:
                        guessed.append(False)
            else:
                guess = lookup(list(path) + out) if lookup is not None else None
                if guess is not None and m.accept_token(int(guess)):
                    out.append(int(guess))
                    took = 1
                    if guessed is not None:
                        guessed.append(True)
                else:
                    if bm is None:
                        bm = xgr.allocate_token_bitmask(1, vocab_size)
                    m.fill_next_token_bitmask(bm)
                    only = _only_legal(bm, vocab_size)
                    if only is not None and m.accept_token(only):
                        out.append(only)
                        took = 1
                        if guessed is not None:
                            guessed.append(False)
            if not took:
                break
    finally:
        if accepted + len(out):
            m.rollback(accepted + len(out))
    return out


class GrammarDraftMasks:
    """The draft mask of a batch's grammars (`RequestGrammar` or None per request), for grammar-aware drafting:
    legal(parent_idx, tokens) -> (B, M, V): tokens each request's grammar allows after each parent."""

    def __init__(self, grammars, root_masks: dict, vocab: int):
        self.grammars, self.root_masks, self.vocab = grammars, root_masks, vocab
        self.parents: torch.Tensor | None = None  # (B, N) of the padded trees being drafted

    def __call__(self, parent_idx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b, m = parent_idx.shape
        out = torch.ones((b, m, self.vocab), dtype=torch.bool)
        for i, g in enumerate(self.grammars):
            if g is None or i not in self.root_masks:
                continue
            for j, u in enumerate(parent_idx[i].tolist()):
                if u == 0:
                    out[i, j] = self.root_masks[i]
                else:
                    path = self._path(i, u, tokens)
                    out[i, j] = g.path_mask(path)
        return out

    def _path(self, i: int, u: int, tokens: torch.Tensor) -> list[int]:
        # parents are found through the padded tree rows the drafter is expanding
        path = []
        while u > 0:
            path.append(int(tokens[i, u]))
            u = int(self.parents[i, u])
        return path[::-1]


@lru_cache(maxsize=256)
def _tree_layout(tree: Tree):
    b = build_buffers(tree)
    return b.retrieve_next_token, b.retrieve_next_sibling


def schema_prompt_grammars(items: list[dict], tokenizer_path: str, vocab_size: int, limit: int | None = None):
    """The shipped JSON prompts whose schema xgrammar compiles (at most `limit`), and a factory:
    `make(i)` is a fresh `RequestGrammar` for kept item i. Returns (kept items, make)."""
    from .tasks import load_schema

    kept, compiled = [], []
    for it in items:
        if limit is not None and len(kept) >= limit:
            break
        try:
            compiled.append(compile_grammar(GrammarSpec("json_schema", json.dumps(load_schema(it))),
                                            str(tokenizer_path), vocab_size))
            kept.append(it)
        except GrammarError:
            continue
    return kept, lambda i: RequestGrammar(compiled[i], vocab_size)
