"""The adapter's per-request table (entmtp_sglang/sglang/requests.py) and the resting part's debts in it
(resting.py), without a server: one entry per live request, made on first sight, dropped when SGLang releases the
request, a repeated rid inheriting nothing, and owed positions that keep only their own row's tensors alive."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from entmtp_sglang.sglang import requests as requests_mod
from entmtp_sglang.sglang.requests import RequestTable
from entmtp_sglang.sglang.resting import Resting


def req(rid: str, **kw):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(), output_ids=[], **kw)


def test_an_entry_lives_from_first_sight_to_release():
    dropped = []
    table = RequestTable(on_drop=dropped.append)
    a, b = req("a"), req("b")
    st = table.of(a)
    assert table.of(a) is st and table.get(a) is st and table.get(b) is None and len(table) == 1
    st.signal = 1.5
    table.of(b)
    table.release(a)
    assert "a" not in table and "b" in table and dropped == ["a"]
    table.release(a)   # twice: nothing more
    assert dropped == ["a"]


def test_a_repeated_rid_is_another_request_and_inherits_nothing():
    dropped = []
    table = RequestTable(on_drop=dropped.append)
    first, again = req("r"), req("r")
    table.of(first).owed.append((torch.tensor(1), torch.zeros(4)))
    assert table.get(again) is None   # not the first request's entry
    st = table.of(again)
    assert st.owed == [] and st.owner is again and dropped == ["r"]
    table.release(first)   # the first request's release (late) leaves the new one alone
    assert table.get(again) is st and dropped == ["r"]


def test_release_reaches_every_live_table_and_the_census_counts_what_they_hold():
    t1, t2 = RequestTable(), RequestTable()
    a = req("a")
    t1.of(a).owed.extend([(torch.tensor(3), torch.zeros(8)), (torch.tensor(4), torch.zeros(8))])
    t2.of(a)
    t1.counted["policy"] = lambda: 7
    assert t1.census() == {"requests": 1, "owed_positions": 2, "owed_bytes": 2 * (8 + 8 * 4), "policy": 7}
    requests_mod.released(a)
    assert len(t1) == len(t2) == 0
    assert t1.census()["owed_bytes"] == 0


def test_owed_positions_keep_only_their_rows_tensors_alive():
    """A resting step's verify result is one (bs * width, hidden) tensor; each request's owed positions copy their
    own row's accepted part, so a request that finishes owing positions holds no other row's (or the step's) memory."""
    table = RequestTable()
    resting = Resting(table, never_drafts=lambda r: r.rid == "never")
    reqs = [req("a"), req("b"), req("never")]
    bs, width, hidden = 3, 4, 16
    result = SimpleNamespace(next_token_ids=torch.arange(bs * width), accept_lens=torch.tensor([2, 4, 3]),
                             logits_output=SimpleNamespace(hidden_states=torch.randn(bs * width, hidden)))
    resting.owe(SimpleNamespace(reqs=reqs), result)
    a, b, never = (table.get(r) for r in reqs)
    assert [int(t) for t, _ in a.owed] == [0, 1] and [int(t) for t, _ in b.owed] == [4, 5, 6, 7]
    assert never.owed == [] and resting.owed(reqs) == 4
    for st, n in ((a, 2), (b, 4)):
        for _, h in st.owed:
            assert h.untyped_storage().nbytes() == n * hidden * 4   # the row's copy, not the step's tensor
    torch.testing.assert_close(b.owed[3][1], result.logits_output.hidden_states[7])
    table.release(reqs[1])
    assert resting.owed(reqs) == 2 and table.census()["owed_positions"] == 2


def test_an_unexpected_layout_forgets_the_debts():
    table = RequestTable()
    resting = Resting(table, never_drafts=lambda r: False)
    r = req("a")
    table.of(r).owed.append((torch.tensor(1), torch.zeros(4)))
    resting.owe(SimpleNamespace(reqs=[r]), SimpleNamespace(next_token_ids=None, accept_lens=None,
                                                           logits_output=SimpleNamespace(hidden_states=None)))
    assert table.get(r).owed == []
