"""Tree rejection sampling in torch (`entmtp_sglang.sglang.cpu.sampling`), SGLang's CUDA kernel semantics, without
SGLang: every emitted token keeps the target distribution (fixed-seed chi-square tests), and the outputs are
consistent with the tree."""

from __future__ import annotations

import pytest
import torch
from helpers.testing import chi_square_pvalue

from entmtp_sglang.sglang.cpu.sampling import (
    top_k_renorm_prob,
    top_p_renorm_prob,
    tree_speculative_sampling_target_only,
)
from entmtp_sglang.tree import Tree, build_buffers

VOCAB = 8
#        0
#      / | \
#     1  2  3
#    / \
#   4   5
#   |
#   6
TREE = Tree((-1, 0, 0, 0, 1, 1, 4))
TOKENS = [0, 2, 5, 7, 1, 3, 6]   # node -> drafted token (siblings distinct)


def chi2_pvalue(counts: dict[int, int], probs: torch.Tensor) -> float:
    return chi_square_pvalue(counts, dict(enumerate(probs.tolist())))


def run(probs: torch.Tensor, trials: int, seed: int, depth: int | None = None):
    """`trials` independent verifications of TREE under `probs` (n, vocab); returns each trial's token list."""
    n = TREE.num_nodes
    buf = build_buffers(TREE)
    spec = (depth if depth is not None else TREE.max_depth) + 1
    g = torch.Generator().manual_seed(seed)
    cand = torch.tensor(TOKENS).expand(trials, n).contiguous()
    ridx = (torch.arange(trials).view(-1, 1) * n + torch.arange(n)).contiguous()
    predicts = torch.zeros(trials * n, dtype=torch.int32)
    accept_index = torch.full((trials, spec), -1, dtype=torch.int32)
    num = torch.zeros(trials, dtype=torch.int32)
    tree_speculative_sampling_target_only(
        predicts, accept_index, num, cand, ridx, buf.retrieve_next_token.expand(trials, n).contiguous(),
        buf.retrieve_next_sibling.expand(trials, n).contiguous(), torch.rand(trials, n, generator=g),
        torch.rand(trials, generator=g), probs.expand(trials, n, VOCAB).contiguous(),
        torch.zeros(trials, n, VOCAB))
    out = []
    for b in range(trials):
        k = int(num[b])
        path = [int(i) - b * n for i in accept_index[b, : k + 1]]
        assert all(p >= 0 for p in path) and int((accept_index[b, k + 1:] == -1).sum()) == spec - k - 1
        assert [TREE.parents[c] for c in path[1:]] == path[:-1], "accepted nodes must form a root path"
        toks = [int(predicts[b * n + i]) for i in path]
        assert toks[:-1] == [TOKENS[c] for c in path[1:]], "accepted tokens are the drafted ones"
        out.append((path, toks))
    return out


@pytest.fixture(scope="module")
def probs():
    torch.manual_seed(7)
    p = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.6)).sample((TREE.num_nodes,))
    p[0] = torch.tensor([0.1, 0.05, 0.35, 0.05, 0.05, 0.2, 0.05, 0.15])  # root: its drafted children likely
    p[1] = torch.tensor([0.05, 0.1, 0.02, 0.4, 0.03, 0.2, 0.1, 0.1])     # node 1: both drafted children likely
    return p


def test_every_position_keeps_the_target_distribution(probs):
    trials = run(probs, 12000, seed=1)
    first = {}
    after = {1: {}, 4: {}}   # node accepted -> next token's counts
    for path, toks in trials:
        first[toks[0]] = first.get(toks[0], 0) + 1
        for i, node in enumerate(path[1:]):
            if node in after:
                after[node][toks[i + 1]] = after[node].get(toks[i + 1], 0) + 1
    assert chi2_pvalue(first, probs[0]) > 1e-3
    assert sum(after[1].values()) > 1000 and chi2_pvalue(after[1], probs[1]) > 1e-3
    assert sum(after[4].values()) > 100 and chi2_pvalue(after[4], probs[4]) > 1e-3
    # drafts are accepted at their target probability: node 1 is accepted as often as p0(token 2)
    accepted_1 = sum(1 for path, _ in trials if len(path) > 1 and path[1] == 1) / len(trials)
    assert abs(accepted_1 - float(probs[0, TOKENS[1]])) < 0.02


def test_argmax_in_place_of_sampling_fails_the_same_test(probs):
    """The test above has power: the greedy fallback SGLang uses on CPU (argmax at the root) is rejected."""
    counts = {int(probs[0].argmax()): 12000}
    assert chi2_pvalue(counts, probs[0]) < 1e-6


def test_depth_limit_samples_the_bonus_from_the_target(probs):
    """With room for one draft only (accept buffer of width 2), a root child is accepted or the bonus drawn."""
    trials = run(probs, 3000, seed=2, depth=1)
    assert all(len(path) <= 2 for path, _ in trials)
    first = {}
    for _, toks in trials:
        first[toks[0]] = first.get(toks[0], 0) + 1
    assert chi2_pvalue(first, probs[0]) > 1e-3


def test_certain_draft_is_always_accepted():
    p = torch.zeros(TREE.num_nodes, VOCAB)
    p[:, 6] = 1.0
    p[0] = torch.nn.functional.one_hot(torch.tensor(TOKENS[1]), VOCAB).float()   # root: token of node 1
    p[1] = torch.nn.functional.one_hot(torch.tensor(TOKENS[4]), VOCAB).float()   # node 1: token of node 4
    for path, toks in run(p, 50, seed=3):
        assert path == [0, 1, 4, 6] and toks == [TOKENS[1], TOKENS[4], TOKENS[6], 6]


def test_renormalisations_match_sglang_torch_sampler():
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]])
    k = top_k_renorm_prob(p, torch.tensor([2, 3]))
    assert torch.allclose(k[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    assert torch.allclose(k[1], torch.tensor([0, 0, 0.15, 0.2, 0.5]) / 0.85)
    q = top_p_renorm_prob(p, torch.tensor([0.6, 0.5]))
    # a token is kept while the mass before it is <= top_p
    assert torch.allclose(q[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    assert torch.allclose(q[1], torch.tensor([0, 0, 0, 0.2, 0.5]) / 0.7)
