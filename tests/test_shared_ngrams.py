"""What earlier requests wrote, as drafts (entmtp_sglang/shared_ngrams.py): matches, the cap and its eviction,
concurrent inserts and lookups, a request's own history before the shared index, and only finished requests indexed
(never an aborted or retracted one's half-written text). The server side: tests/test_sglang_forced.py."""

from __future__ import annotations

import random
import threading

import pytest

from entmtp_sglang.forced_spans import HistoryLookup
from entmtp_sglang.shared_ngrams import SharedNgrams


def test_the_longest_indexed_ngram_gives_the_token_after_its_latest_occurrence():
    s = SharedNgrams(min_n=2, max_n=4)
    s.insert([1, 2, 3, 4, 5, 1, 2, 9])
    assert s.lookup([7, 3, 4]) == (2, 5)            # `3 4` -> 5
    assert s.lookup([1, 2]) == (2, 9)               # latest occurrence wins: `1 2` -> 9 (was 3)
    assert s.lookup([5, 1, 2]) == (3, 9) and s.lookup([8, 3, 4, 5]) == (3, 1) and s.lookup([8, 4, 5]) == (2, 1)
    assert s.lookup([4]) is None and s.lookup([6, 6]) is None and s.lookup([]) is None
    s.insert([7, 7, 1, 2, 3])                       # a later text overwrites
    assert s.lookup([1, 2]) == (2, 3)
    s.clear()
    assert len(s) == 0 and s.lookup([1, 2]) is None and s.census()["shared_texts"] == 0


def test_the_prompt_tail_gives_the_outputs_first_tokens_a_context():
    s = SharedNgrams(min_n=2, max_n=3)
    s.insert([10, 11, 12], context=[1, 2, 3, 4])
    assert s.lookup([3, 4]) == (2, 10)              # the prompt's last n-gram -> the output's first token
    assert s.lookup([2, 3]) is None                 # the prompt itself is not indexed
    s.insert([])                                    # nothing to index: nothing changes
    assert s.census()["shared_texts"] == 1


def test_the_cap_evicts_the_least_recently_written_ngrams():
    s = SharedNgrams(min_n=2, max_n=2, max_entries=5)
    s.insert([1, 2, 3, 4, 5, 6])                    # 4 bigrams: 12 23 34 45 (56 has no next)
    s.insert([7, 8, 9])                             # 78 -> 5 entries
    assert len(s) == 5 and s.evicted == 0
    s.insert([10, 11, 12])                          # 10-11: 6 > 5, the oldest (1 2) goes
    assert len(s) == 5 and s.evicted == 1
    assert s.lookup([1, 2]) is None and s.lookup([2, 3]) == (2, 4) and s.lookup([10, 11]) == (2, 12)
    s.insert([2, 3, 4])                             # rewriting `2 3` makes it the newest: `3 4` goes next
    s.insert([20, 21, 22])
    assert s.lookup([2, 3]) == (2, 4) and s.lookup([3, 4]) is None
    big = SharedNgrams(max_entries=10_000, max_tokens=50)
    big.insert(list(range(1000)))                   # only the output's last 50 tokens are indexed
    assert big.lookup([100, 101]) is None and big.lookup([990, 991]) == (2, 992)
    assert len(big) <= 3 * 50
    with pytest.raises(ValueError):
        SharedNgrams(max_entries=0)
    with pytest.raises(ValueError):
        SharedNgrams(min_n=3, max_n=2)


def test_concurrent_inserts_and_lookups_stay_within_the_cap_and_answer_from_inserted_texts():
    s = SharedNgrams(min_n=2, max_n=3, max_entries=2000)
    texts = [[random.Random(k).randrange(50) for _ in range(200)] for k in range(16)]
    allowed = {t for text in texts for t in text}
    errors: list[BaseException] = []

    def writer(k):
        try:
            for _ in range(5):
                s.insert(texts[k])
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    def reader(k):
        rng = random.Random(100 + k)
        try:
            for _ in range(2000):
                got = s.lookup([rng.randrange(50) for _ in range(3)])
                assert got is None or (got[0] in (2, 3) and got[1] in allowed)
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(16)]
    threads += [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert len(s) <= 2000 and s.texts == 80
    last = texts[-1]
    s.insert(last)
    assert s.lookup(last[10:12]) is not None


def test_a_requests_own_history_comes_first_at_each_length_and_a_longer_shared_match_wins():
    shared = SharedNgrams(min_n=2, max_n=4)
    shared.insert([5, 6, 7, 8, 40])       # `6 7 8` -> 40 (three tokens)
    shared.insert([1, 2, 30])             # `1 2` -> 30
    own = HistoryLookup(shared=shared)
    own.sync([9, 1, 2, 3, 9, 7, 8, 50, 1, 2], [])
    assert own([]) == 3                   # own `1 2` -> 3 beats the shared `1 2` -> 30 (same length)
    own.sync([9, 1, 2, 3, 9, 7, 8, 50, 6, 7, 8], [])
    assert own([]) == 40                  # shared `6 7 8` (3) beats own `7 8` -> 50 (2)
    alone = HistoryLookup()
    alone.sync([9, 1, 2, 3, 9, 7, 8, 50, 6, 7, 8], [])
    assert alone([]) == 50                # without the shared index: its own shorter match
    fresh = HistoryLookup(shared=shared)
    fresh.sync([11, 5, 6], [])
    assert fresh([]) == 7 and fresh([7, 8]) == 40   # nothing of its own: the shared index, below a path too


class FINISH_LENGTH:   # noqa: N801 - SGLang's class names
    pass


class FINISH_ABORT:   # noqa: N801
    pass


class Req:
    def __init__(self, rid, output, reason, retracted=False):
        self.rid, self.output_ids, self.origin_input_ids = rid, output, [1, 2]
        self.finished_reason, self.is_retracted = reason, retracted


def test_only_requests_that_finished_are_indexed_when_sglang_releases_them():
    """Through the request table's release (SGLang's release_kv_cache hook): a finished request's output goes in; an
    aborted one's (finish reason FINISH_ABORT) and a retracted one's (no finish reason yet) never do."""
    from entmtp_sglang.sglang.forced_draft import ForcedDraft, finished_normally
    from entmtp_sglang.sglang.requests import RequestTable

    assert finished_normally(Req("a", [], FINISH_LENGTH()))
    assert not finished_normally(Req("b", [], FINISH_ABORT())) and not finished_normally(Req("c", [], None))
    assert not finished_normally(Req("d", [], FINISH_LENGTH(), retracted=True))

    table = RequestTable()
    draft = ForcedDraft.__new__(ForcedDraft)   # the span machinery is not needed to index: only its table
    draft.requests, draft.shared = table, SharedNgrams()
    table.on_release(draft.index_finished)
    done, aborted, retracted = (Req("a", [7, 8, 9, 10], FINISH_LENGTH()), Req("b", [7, 8, 66, 67], FINISH_ABORT()),
                                Req("c", [7, 8, 77], None))
    for r in (done, aborted, retracted):
        table.of(r)
        table.release(r)
    assert draft.shared.lookup([7, 8]) == (2, 9) and draft.shared.census()["shared_texts"] == 1
    assert draft.shared.lookup([8, 66]) is None and draft.shared.lookup([8, 77]) is None
    assert len(table) == 0
    draft.clear_shared()
    assert len(draft.shared) == 0
