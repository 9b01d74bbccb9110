"""Everything the ENTMTP adapter keeps per request, in one table with one owner and one end.

SGLang's `Req` lives from arrival to finish or abort; the adapter's state for it lives exactly as long:

    arrival (the first decode step that sees it)   ->  RequestTable.of(req)    a fresh RequestState
    every step                                     ->  RequestTable.of(req)    the same RequestState
    finish, abort, retraction                      ->  release_kv_cache hook   RequestTable.release(req): dropped

SGLang gives a request's KV back through `sglang.srt.mem_cache.common.release_kv_cache` whatever ends it (a finish
of any kind, an abort, a retraction that will prefill it again); the plugin hooks it (`register_hooks`) and every live
table drops that request. A request whose `rid` repeats one still in the table is another request (the entry is
keyed by the `Req` object, not by the rid alone): it starts from a fresh entry and inherits nothing.

Listeners (`on_drop`) drop what other parts keep by rid (the policy's acceptance feedback, calibration records),
so a server that runs for a month holds what its live requests need and nothing else. `/server_info` reports what
the tables hold (`entmtp_requests`, `census`).

No SGLang import: `Req` objects are read through `rid` alone.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .patches import RELEASE, SPECULATIVE_STATE, hooked


@dataclass(eq=False)
class RequestState:
    """One request's state in the adapter. `signal`/`probs`: its drafter's latest root signal and depth-1 top-k
    probabilities (what the policy chooses its next tree by); `root_logits`: the drafter's root logits, kept for a
    constrained request (its grammar-masked signal and drafts); `owed`: the positions it rested through, each (the
    token the target chose, the target's hidden state there), which the drafter has not seen yet (caught up when it
    speculates again); `forced_stats`/`lookup`/`join`: its forced spans' statistics, its own text as an n-gram index
    and its side of the span ends (forced_draft.py)."""

    owner: Any                        # the SGLang Req this entry belongs to
    signal: float | None = None
    probs: tuple = ()
    root_logits: torch.Tensor | None = None
    owed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    forced_stats: Any = None
    lookup: Any = None
    join: Any = None


class RequestTable:
    """rid -> RequestState for the requests the worker has seen and SGLang has not released. Thread-safe: SGLang
    releases requests on the scheduler thread, which under overlap scheduling is not the forward's."""

    def __init__(self, on_drop: Callable[[str], None] | None = None):
        self._entries: dict[str, RequestState] = {}
        self._listeners: list[Callable[[str], None]] = [on_drop] if on_drop is not None else []
        self._released: list[Callable[[Any, RequestState], None]] = []
        self._lock = threading.Lock()
        self.counted: dict[str, Callable[[], int]] = {}
        _TABLES.add(self)

    def listen(self, on_drop: Callable[[str], None]) -> None:
        """Call `on_drop(rid)` whenever a request's entry is dropped (its other per-request state goes with it)."""
        self._listeners.append(on_drop)

    def on_release(self, fn: Callable[[Any, RequestState], None]) -> None:
        """Call `fn(req, state)` when SGLang releases a request the table holds, before its entry is dropped (the
        request as SGLang ends it: its output and finish reason, or none for a retraction)."""
        self._released.append(fn)

    def of(self, req) -> RequestState:
        """The request's entry, made on first sight; an entry of another request under the same rid is dropped
        first (a repeated rid inherits nothing)."""
        rid = req.rid
        with self._lock:
            st = self._entries.get(rid)
            if st is not None and st.owner is req:
                return st
        if st is not None:
            self.drop(rid)
        with self._lock:
            st = self._entries[rid] = RequestState(owner=req)
        return st

    def get(self, req) -> RequestState | None:
        """The request's entry if it has one (never makes one)."""
        st = self._entries.get(req.rid)
        return st if st is not None and st.owner is req else None

    def release(self, req) -> None:
        """SGLang gave the request's KV back (finished, aborted or retracted): drop its entry."""
        st = self._entries.get(getattr(req, "rid", None))
        if st is not None and st.owner is req:
            for fn in self._released:
                fn(req, st)
            self.drop(req.rid)

    def drop(self, rid: str) -> None:
        with self._lock:
            st = self._entries.pop(rid, None)
        if st is not None:
            for listener in self._listeners:
                listener(rid)

    def clear_owed(self) -> None:
        """Forget every request's owed positions (its drafter then starts cold: fewer drafts accepted, the same
        output)."""
        with self._lock:
            for st in self._entries.values():
                st.owed = []

    def rids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def census(self) -> dict:
        """What the table holds: requests, owed positions and the bytes of their tensors, and what the parts that
        keep state by rid hold (`counted`: name -> a function counting its entries); a server reports it in
        `/server_info` (`entmtp_requests`), so a test can read that finished requests left nothing behind."""
        with self._lock:
            entries = list(self._entries.values())
        owed = [pair for st in entries for pair in st.owed]
        return {"requests": len(entries), "owed_positions": len(owed),
                "owed_bytes": sum(t.numel() * t.element_size() + h.numel() * h.element_size() for t, h in owed),
                **{name: count() for name, count in self.counted.items()}}


_TABLES: "weakref.WeakSet[RequestTable]" = weakref.WeakSet()


def released(req) -> None:
    """SGLang released `req`'s KV: every live table drops it."""
    for table in list(_TABLES):
        table.release(req)


def census() -> dict | None:
    """The census of this process's tables summed (None: no ENTMTP worker here)."""
    tables = list(_TABLES)
    if not tables:
        return None
    out: dict = {}
    for t in tables:
        for k, v in t.census().items():
            out[k] = out.get(k, 0) + v
    return out


# --- the SGLang hooks (the plugin registers them in every scheduler process) -------------------------------------
def _after_release(result, req, *args, **kwargs):
    released(req)
    return result


def _after_speculative_state(result, controller, state, *args, **kwargs):
    c = census()
    if c is not None:
        state["entmtp_requests"] = c
    return result


def register_hooks(check_signature) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for dotted, params in hooked(RELEASE, SPECULATIVE_STATE).items():
        check_signature(dotted, params)
    HookRegistry.register(RELEASE, _after_release, HookType.AFTER)
    HookRegistry.register(SPECULATIVE_STATE, _after_speculative_state, HookType.AFTER)
