"""policy/guard.py: speculation judged by the tokens per second it delivered against resting, per batch size."""

import pytest

from entmtp_sglang.policy.guard import GuardConfig, SpeculationGuard, bucket_of


def test_batch_sizes_fall_into_power_of_two_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32)] == [1, 2, 2, 4, 4, 8, 8, 16, 16, 32]
    with pytest.raises(ValueError, match="at least one row"):
        bucket_of(0)


def _feed(guard, rows, rested, tokens, seconds, n):
    for _ in range(n):
        guard.observe(rows, rested, tokens, seconds)


def test_it_measures_resting_where_the_policy_never_rests_then_leaves_a_faster_speculation_alone():
    g = SpeculationGuard(GuardConfig(min_steps=4, explore_every=4, measure_rest_every=3))
    _feed(g, 8, False, 16, 0.2, 10)                       # speculating: 80 tok/s; resting never measured
    forced = [g.force_rest(8) for _ in range(9)]
    assert forced == [False, False, True] * 3              # one step in three explores a rest
    assert g.judged(8) is None
    _feed(g, 8, True, 8, 0.2, 4)                           # resting: 40 tok/s
    assert g.judged(8) is False
    assert not any(g.force_rest(8) for _ in range(16))     # speculation delivers more: never overridden
    assert g.judged(4) is None and not g.force_rest(4)     # another bucket knows nothing yet


def test_where_speculation_delivers_less_it_rests_but_lets_speculation_try_now_and_then():
    g = SpeculationGuard(GuardConfig(min_steps=3, explore_every=5, margin=0.05))
    _feed(g, 16, False, 20, 0.4, 3)                        # 50 tok/s speculating
    _feed(g, 16, True, 16, 0.25, 3)                        # 64 tok/s resting
    assert g.judged(16) is True and g.judged(20) is True   # 16-31 rows share the bucket
    forced = [g.force_rest(16) for _ in range(15)]
    # a try after 5 steps, then after 10: the gap doubles while speculation keeps losing
    assert forced == [True] * 4 + [False] + [True] * 9 + [False]
    # within the margin speculation is left alone (48.5 vs 50: 3% less)
    h = SpeculationGuard(GuardConfig(min_steps=1, margin=0.05))
    h.observe(4, False, 97, 2.0)
    h.observe(4, True, 100, 2.0)
    assert h.judged(4) is False and not h.force_rest(4)
    # below min_rows requests the policy decides alone, whatever the arms say
    h.observe(2, False, 1, 2.0)
    h.observe(2, True, 100, 2.0)
    assert h.judged(2) is True and not any(h.force_rest(2) for _ in range(20))


def test_an_arms_rate_follows_its_recent_steps():
    g = SpeculationGuard(GuardConfig(min_steps=2, decay=0.9))
    _feed(g, 4, True, 4, 0.1, 20)                          # resting: 40 tok/s
    _feed(g, 4, False, 2, 0.1, 20)                         # speculating slowly: 20 tok/s
    assert g.judged(4) is True
    _feed(g, 4, False, 10, 0.1, 40)                        # then 100 tok/s (the content got predictable)
    assert g.judged(4) is False
    s = g.summary()["4"]
    assert s["rest_steps"] == 20 and s["speculate_steps"] == 60 and s["speculate_tok_s"] > 90


def test_steps_without_time_are_ignored_and_bad_settings_are_refused():
    g = SpeculationGuard(GuardConfig(min_steps=1))
    g.observe(2, False, 3, 0.0)
    assert "2" not in g.summary()
    for bad, match in (({"margin": 1.0}, "margin"), ({"min_steps": 0}, "min_steps"),
                       ({"explore_every": 1}, "explore_every"), ({"decay": 0.0}, "decay"),
                       ({"explore_every": 8, "max_explore_every": 4}, "max_explore_every"),
                       ({"measure_rest_every": 1}, "measure_rest_every"),
                       ({"min_rows": 0}, "min_rows")):
        with pytest.raises(ValueError, match=match):
            GuardConfig(**bad)


def test_a_losing_speculation_is_tried_less_and_less_often_and_as_often_as_before_once_it_wins():
    """While speculation keeps losing, the steps between its tries double (4, 8, 16, capped at 16 here); once it
    delivers as much as resting again the guard never forces a rest, and should it lose again its tries start at
    the short gap."""
    g = SpeculationGuard(GuardConfig(min_steps=2, explore_every=4, max_explore_every=16, decay=1.0))
    _feed(g, 8, False, 8, 0.2, 2)                          # speculating: 40 tok/s
    _feed(g, 8, True, 12, 0.2, 2)                          # resting: 60 tok/s
    tries = [i for i in range(1, 61) if not g.force_rest(8)]
    assert [b - a for a, b in zip([0] + tries, tries)] == [4, 8, 16, 16, 16]
    assert g.summary()["8"]["try_every"] == 16
    _feed(g, 8, False, 40, 0.2, 10)                        # speculation got better: now it wins
    assert g.judged(8) is False and not any(g.force_rest(8) for _ in range(40))
    assert g.summary()["8"]["try_every"] is None
    _feed(g, 8, True, 400, 0.2, 10)                        # and resting better again: tries from the short gap
    assert [g.force_rest(8) for _ in range(4)] == [True, True, True, False]


def test_by_default_a_fresh_batch_size_is_judged_within_a_few_steps():
    """Defaults: while a batch size's resting arm has too few steps, every other step rests, so a server where the
    policy speculates on every step at 8 requests (and speculation delivers half of resting's rate there) rests
    from about the 8th step on."""
    g = SpeculationGuard()
    for i in range(40):
        rested = g.force_rest(8)
        g.observe(8, rested, 8 if rested else 6, 0.1 if rested else 0.15)   # rest 80 tok/s, speculate 40
        if g.judged(8):
            break
    assert g.judged(8) is True and i < 2 * g.config.min_steps
    assert sum(g.force_rest(8) for _ in range(64)) >= 60
