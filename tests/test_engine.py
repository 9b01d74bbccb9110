"""The reference engine on a small random model: lossless greedy speculation, batching, bad input."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.engine.engine import Engine, RequestError, static_chooser
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.engine.sampling import SamplingParams
from entmtp_sglang.policy.chooser import StepView
from entmtp_sglang.tree import Tree, TreeError, from_medusa_choices, from_sglang

TREES = [Tree.chain(d) for d in range(1, 6)] + [
    from_sglang(3, 4, 10),
    from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]),
    Tree((-1, 0, 0, 0, 0, 1, 1, 2, 5, 8)),
]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle3"])
def test_greedy_equals_plain_every_tree_batch1_and_batch4(random_models, kind):
    target, drafters = random_models
    prompts = _prompts(4)
    ref = [generate_plain(target, p, 24) for p in prompts]
    engine = Engine(target, kind, drafters[kind])
    for tree in TREES:
        batch = engine.generate(prompts, 24, static_chooser(tree))
        assert [r.output_ids for r in batch] == ref, tree.name
        single = engine.generate(prompts[:1], 24, static_chooser(tree))
        assert single[0].output_ids == ref[0], tree.name


def test_each_request_its_own_tree(random_models):
    target, drafters = random_models
    prompts = _prompts(5, seed=1)
    ref = [generate_plain(target, p, 20) for p in prompts]

    def chooser(view: StepView) -> Tree:  # a different tree per request and per step
        return TREES[(view.index + len(view.history)) % len(TREES)]

    for kind in ("medusa", "eagle"):
        out = Engine(target, kind, drafters[kind]).generate(prompts, 20, chooser)
        assert [r.output_ids for r in out] == ref
        names = {s.tree for r in out for s in r.steps}
        assert len(names) > 3


def test_step_records(random_models):
    target, drafters = random_models
    out = Engine(target, "hydra", drafters["hydra"]).generate(_prompts(2), 16, static_chooser(TREES[5]))
    for r in out:
        assert len(r.output_ids) == 16 and r.finish_reason == "length"
        for s in r.steps:
            assert s.tree == TREES[5].name and s.num_nodes == TREES[5].num_nodes
            assert 0 <= s.accepted <= TREES[5].max_depth
            assert len(s.target_entropy) == s.accepted + 1
            assert all(e >= 0 for e in s.target_entropy) and s.seconds > 0
        assert sum(s.accepted + 1 for s in r.steps) + 1 >= 16


def test_eos_stops_request(random_models):
    target, drafters = random_models
    prompt = _prompts(1, seed=3)[0]
    ref = generate_plain(target, prompt, 30)
    eos = ref[7]
    first = ref.index(eos)
    out = Engine(target, "medusa", drafters["medusa"], eos_token_id=eos).generate([prompt], 30,
                                                                                 static_chooser(TREES[6]))
    assert out[0].output_ids == ref[: first + 1]
    assert out[0].finish_reason == "eos"


def test_bad_requests_get_clear_errors(random_models):
    target, drafters = random_models
    engine = Engine(target, "medusa", drafters["medusa"])
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate([[]], 8, static_chooser(Tree.chain(2)))
    with pytest.raises(RequestError, match="exceeds the model context of 256"):
        engine.generate([[1, 2, 3]], 300, static_chooser(Tree.chain(2)))
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate([[1, 2, 3]], 0, static_chooser(Tree.chain(2)))
    with pytest.raises(TreeError, match="depth 6, beyond the 5 draft positions"):
        engine.generate([[1, 2, 3]], 8, static_chooser(Tree.chain(6)))


def test_near_context_end_falls_back_to_plain_decoding(random_models):
    target, drafters = random_models
    prompt = _prompts(1, seed=4)[0]
    n = 256 - len(prompt)  # fill the whole context
    ref = generate_plain(target, prompt, n)
    out = Engine(target, "hydra", drafters["hydra"]).generate([prompt], n, static_chooser(Tree.chain(5)))
    assert out[0].output_ids == ref
    assert out[0].steps[-1].tree == "chain:0"


def test_sampled_speculation_matches_plain_sampling_distribution(random_models):
    """End to end: the distribution of the 3rd generated token matches plain sampling (two-sample)."""
    target, drafters = random_models
    prompt = [5, 17, 42]
    params = SamplingParams(temperature=1.0)
    engine = Engine(target, "medusa", drafters["medusa"])
    spec = torch.zeros(97)
    plain = torch.zeros(97)
    for seed in range(300):
        r = engine.generate([prompt], 3, static_chooser(Tree.chain(2)), params, seed=seed)[0]
        spec[r.output_ids[2]] += 1
        g = torch.Generator().manual_seed(10_000 + seed)
        plain[generate_plain(target, prompt, 3, params, generator=g)[2]] += 1
    # two-sample chi-square over bins with enough mass
    keep = (spec + plain) >= 10
    other = torch.tensor([(spec[~keep]).sum(), (plain[~keep]).sum()])
    a = torch.cat([spec[keep], other[:1]])
    b = torch.cat([plain[keep], other[1:]])
    stat = float((((a - b) ** 2) / (a + b).clamp(min=1)).sum())
    dof = int(keep.sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))
    assert p_value > 0.01


def test_dynamic_eagle2_trees_are_lossless(random_models):
    from entmtp_sglang.policy.eagle2 import DynamicTree

    target, drafters = random_models
    prompts = _prompts(3, seed=7)
    ref = [generate_plain(target, p, 20) for p in prompts]
    wide = from_sglang(4, 5, 30)
    for kind in ("medusa", "hydra", "eagle"):
        out = Engine(target, kind, drafters[kind]).generate(prompts, 20,
                                                            lambda v: DynamicTree(wide, 8))
        assert [r.output_ids for r in out] == ref
        assert all(s.num_nodes <= 8 for r in out for s in r.steps)


def test_prune_by_confidence_keeps_a_prefix_closed_subtree():
    from entmtp_sglang.policy.eagle2 import prune_by_confidence, subtree

    #      0
    #    /   \        log-probs: 1: -0.1, 2: -1.0, 3: -0.2, 4: -3.0, 5: -0.1
    #   1     2       cumulative: 1 -0.1, 3 -0.3, 2 -1.0, 5 -1.1, 4 -3.1
    #  / \    |
    # 3   4   5
    tree = Tree((-1, 0, 0, 1, 1, 2))
    nodes = prune_by_confidence(tree, [0.0, -0.1, -1.0, -0.2, -3.0, -0.1], 4)
    assert nodes == [0, 1, 2, 3]
    assert subtree(tree, nodes).parents == (-1, 0, 0, 1)


def _staged_tree_set():
    """chain:0..4 and a branching tree with its prefix; drafts believed (deep table 0.95) until drafted, then
    a node counts only if its own draft probability is at least 0.95: the chosen trees are deep, staging
    cuts them."""
    from entmtp_sglang.tree.acceptance import AcceptancePredictor, IsotonicMap
    from entmtp_sglang.tree.treeset import TreeEntry, TreeSet

    trees = [Tree.chain(d) for d in range(5)] + [Tree((-1, 0, 0)), Tree((-1, 0, 0, 1, 1, 3))]
    q = AcceptancePredictor(tuple(IsotonicMap((0.0, 0.95), (0.0, 0.9)) for _ in range(4)),
                            tuple(((0.95, 0.5),) for _ in range(4)), ())
    cost = {1: 1.0, 4: 2.0}
    entries = tuple(TreeEntry(t, (0.0,), {b: c + 0.02 * c * (t.num_nodes + t.max_depth) for b, c in cost.items()})
                    for t in trees)
    prov = {"step_cost_model": {"1": {"base": 1.0, "per_node": 0.02, "per_depth": 0.02}}}
    return TreeSet("m", "eagle", "t", "draft_margin", (), entries, provenance=prov, predictor=q.to_json())


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle3"])
def test_staged_decisions_are_lossless_and_cut_trees(random_models, kind):
    from entmtp_sglang.policy.policies import entmtp_policy

    target, drafters = random_models
    prompts = _prompts(4, seed=3)
    ref = [generate_plain(target, p, 24) for p in prompts]
    ts = _staged_tree_set()
    engine = Engine(target, kind, drafters[kind])
    for batch in (prompts, prompts[:1]):
        policy = entmtp_policy(ts, "entmtp-staged")
        out = engine.generate(batch, 24, policy, observer=policy.observe)
        assert [r.output_ids for r in out] == ref[: len(batch)]
        names = [s.tree for r in out for s in r.steps]
        # the deep trees were chosen, and staged decisions verified smaller ones on some steps
        assert any(n not in ("chain:4", "tree:n6d3") for n in names), names
        for r in out:
            for s in r.steps:
                assert s.num_nodes == next(t.tree.num_nodes for t in ts.trees if t.tree.name == s.tree)
    # without staging the same policy verifies the trees it chose
    policy = entmtp_policy(ts, "entmtp-predictor")
    out = engine.generate(prompts, 24, policy, observer=policy.observe)
    assert [r.output_ids for r in out] == ref


class _Schedule:
    """chain:3, except on steps k with k % 4 in (1, 2): chain:0 (the drafter still runs)."""

    def __init__(self):
        self.step, self.logits = 0, {}

    def plain_now(self) -> bool:
        return self.step % 4 in (1, 2)

    def observe(self, state, lens, drafting, active) -> None:
        self.step += 1
        self.logits[self.step] = state.root_logits.clone()

    def __call__(self, view: StepView) -> Tree:
        return Tree.chain(0) if self.plain_now() else Tree.chain(3)


class _RestingSchedule(_Schedule):
    """The same steps, but the chain:0 ones rest the drafter (the engine's `rests` hook)."""

    def rests(self, active) -> bool:
        self.step += 1
        return self.plain_now()

    def observe(self, state, lens, drafting, active) -> None:
        self.logits[self.step] = state.root_logits.clone()


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle3"])
def test_resting_the_drafter_is_lossless_and_catches_its_cache_up(random_models, kind):
    """Steps that skip the drafter decode plainly; afterwards the drafter sees exactly what it would have seen
    had it run on every step (EAGLE's draft cache takes the skipped tokens in one pass)."""
    target, drafters = random_models
    prompts = _prompts(4, seed=5)
    ref = [generate_plain(target, p, 30) for p in prompts]
    engine = Engine(target, kind, drafters[kind])
    runs = {}
    for chooser in (_RestingSchedule(), _Schedule()):
        out = engine.generate(prompts, 30, chooser, observer=chooser.observe)
        assert [r.output_ids for r in out] == ref
        runs[type(chooser)] = (chooser.logits, out)
    (with_rest, out_rest), (without, out_plain) = runs[_RestingSchedule], runs[_Schedule]
    assert sum(s.rested for r in out_rest for s in r.steps) > 0
    assert not any(s.rested for r in out_plain for s in r.steps)
    assert set(with_rest) <= set(without) and len(with_rest) > 3
    for k, logits in with_rest.items():
        torch.testing.assert_close(logits, without[k], rtol=1e-4, atol=1e-4)
