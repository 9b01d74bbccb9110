"""What earlier requests wrote, as drafts for later ones: a bounded, server-wide n-gram index of finished outputs.

An agent's tenth call to a tool repeats the structure, and often the values, of the nine before it; a request's own
text (`forced_spans.HistoryLookup`) has not seen them yet. `SharedNgrams` keeps, for the outputs of requests that
finished (never a request aborted or retracted: a half-written text is not indexed), each n-gram of 2 to 4 tokens
and the token that followed its latest occurrence, as Suffix Decoding's global tree and SGLang's NGRAM corpus do.
A request's lookup asks its own history first at each length and this index after it, so a longer match here beats
a shorter one of its own (`HistoryLookup.__call__`):

    finished:  ... {"name": "get_weather", "arguments": {"city": "Paris"}}
    later:     ... {"name": "get_weather", "arguments": {"
               -> `city`: what followed `"arguments": {"` last time

Bounded: at most `max_entries` n-grams (each an n-tuple and a token), the least recently written evicted first;
an output is indexed from its last `max_tokens` tokens (with the prompt's last tokens before it, so its first
tokens have a context). Safe under concurrent inserts and lookups (one lock; SGLang releases requests on the
scheduler thread, which under overlap scheduling is not the forward's). A guess from here is a draft like any
other: the target verifies it, so the output stays the target's.

No SGLang import.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_ENTRIES = 200_000   # about 40 MB of Python tuples at the most
DEFAULT_MAX_TOKENS = 2048       # of one output, its last tokens


class SharedNgrams:
    """n-gram (n in `min_n..max_n`) -> the token after its latest occurrence in the indexed texts; bounded (LRU)."""

    def __init__(self, min_n: int = 2, max_n: int = 4, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_entries < 1 or max_tokens < 2:
            raise ValueError(f"max_entries must be >= 1 and max_tokens >= 2, got {max_entries}, {max_tokens}")
        self.min_n, self.max_n = min_n, max_n
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._next: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._lock = threading.Lock()
        self.texts = 0       # texts indexed since the last clear
        self.evicted = 0     # n-grams evicted since the last clear

    def insert(self, output: Sequence[int], context: Sequence[int] = ()) -> None:
        """Index `output` (its last `max_tokens` tokens), each n-gram's next token; `context` (the prompt) gives its
        first tokens their preceding n-grams. Later texts overwrite earlier ones' next tokens."""
        out = [int(t) for t in output[-self.max_tokens:]]
        if not out:
            return
        ctx = [int(t) for t in context[-(self.max_n):]] if len(output) <= self.max_tokens else []
        toks = ctx + out
        first = len(ctx)   # n-grams whose next token is an output token
        items = []
        for e in range(max(first - 1, 0), len(toks) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if e + 1 >= n:
                    items.append((tuple(toks[e + 1 - n:e + 1]), toks[e + 1]))
        with self._lock:
            nxt = self._next
            for key, token in items:
                nxt[key] = token
                nxt.move_to_end(key)
            while len(nxt) > self.max_entries:
                nxt.popitem(last=False)
                self.evicted += 1
            self.texts += 1

    def get(self, key: tuple[int, ...]) -> int | None:
        """The token after the latest indexed occurrence of the n-gram `key` (None where none)."""
        with self._lock:
            return self._next.get(key)

    def lookup(self, tail: Sequence[int]) -> tuple[int, int] | None:
        """(n, token) for the longest n-gram ending `tail` that the index has, n from `max_n` down; None."""
        tail = [int(t) for t in tail[-self.max_n:]]
        with self._lock:
            for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
                token = self._next.get(tuple(tail[-n:]))
                if token is not None:
                    return n, token
        return None

    def clear(self) -> None:
        with self._lock:
            self._next.clear()
            self.texts = self.evicted = 0

    def __len__(self) -> int:
        return len(self._next)

    def census(self) -> dict:
        """What it holds (a server reports it in `/server_info`)."""
        with self._lock:
            return {"shared_ngrams": len(self._next), "shared_texts": self.texts, "shared_evicted": self.evicted}
