"""Verification: hand-drawn greedy cases and the statistical exactness of rejection sampling."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.engine.sampling import SamplingParams, probs_from_logits
from entmtp_sglang.engine.verify import verify_greedy, verify_node_sampling, verify_sampling
from entmtp_sglang.policy.signals import entropy_nats
from entmtp_sglang.tree import Tree, build_buffers

#        0 (root, token 7)
#       / \
#      1   2          node tokens: 1->3, 2->5
#     / \   \
#    3   4   5        3->8, 4->9, 5->4
SMALL = Tree((-1, 0, 0, 1, 1, 2))
TOKENS = [7, 3, 5, 8, 9, 4]


@pytest.mark.parametrize(
    "argmax, path, nxt",
    [
        # target argmax per node: root wants 3 (node 1), node 1 wants 9 (node 4), node 4 wants 11
        ([3, 9, 0, 0, 11, 0], (0, 1, 4), 11),
        # root wants 5 (node 2), node 2 wants 4 (node 5), node 5 is a leaf: bonus = argmax[5]
        ([5, 0, 4, 0, 0, 6], (0, 2, 5), 6),
        # root wants 1: no child matches, nothing accepted, the correction token is 1
        ([1, 0, 0, 0, 0, 0], (0,), 1),
        # root wants 3, node 1 wants 2: one accepted
        ([3, 2, 0, 0, 0, 0], (0, 1), 2),
    ],
)
def test_greedy_hand_cases(argmax, path, nxt):
    acc = verify_greedy(SMALL, TOKENS, argmax)
    assert acc.nodes == path
    assert acc.next_token == nxt
    assert acc.num_accepted == len(path) - 1


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value (scipy-free: regularized upper gamma via torch)."""
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _sample_with_drafts(p, q, num_children, trials, seed, correct=True):
    """Draw num_children sibling drafts from q without replacement, verify against p; count outputs."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p, dtype=torch.float64)
    for _ in range(trials):
        cands, qs = [], []
        q_left = q.clone()
        for _ in range(num_children):
            x = int(torch.multinomial(q_left, 1, generator=gen))
            cands.append(x)
            qs.append(q_left.clone())
            q_left[x] = 0
            q_left = q_left / q_left.sum()
        if correct:
            idx, tok = verify_node_sampling(p, cands, qs, gen)
        else:  # broken: on rejection, sample from p itself instead of the residual
            idx, tok = verify_node_sampling(p, cands, qs, gen)
            if idx is None:
                tok = int(torch.multinomial(p, 1, generator=gen))
        counts[cands[idx] if idx is not None else tok] += 1
    return counts


def _synthetic(seed: int, vocab: int = 8):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0).double()
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0).double()
    return p, q


@pytest.mark.parametrize("num_children", [1, 3])
def test_rejection_sampling_keeps_target_distribution(num_children):
    p, q = _synthetic(1)
    counts = _sample_with_drafts(p, q, num_children, trials=6000, seed=2)
    assert _chi_square_p(counts, p) > 0.01


@pytest.mark.parametrize("num_children", [1, 3])
def test_chi_square_detects_a_missing_correction_step(num_children):
    p, q = _synthetic(1)
    counts = _sample_with_drafts(p, q, num_children, trials=6000, seed=2, correct=False)
    assert _chi_square_p(counts, p) < 1e-6


def test_point_mass_drafts_keep_target_distribution():
    """Deterministic (top-k) drafts, as the engine drafts them: q is a point mass on each candidate."""
    p, _ = _synthetic(3)
    gen = torch.Generator().manual_seed(4)
    cands = torch.argsort(p, descending=True)[:2].tolist()
    counts = torch.zeros_like(p)
    for _ in range(6000):
        idx, tok = verify_node_sampling(p, cands, [None, None], gen)
        counts[cands[idx] if idx is not None else tok] += 1
    assert _chi_square_p(counts, p) > 0.01


def test_tree_sampling_second_token_distribution():
    """Through a depth-2 tree: the second emitted token follows p(. | first) exactly."""
    tree = Tree((-1, 0, 0, 1))
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(4, 6, generator=g) * 1.5, -1).double()
    first, second = torch.argsort(probs[0], descending=True)[:2].tolist()
    tokens = [0, first, second, int(probs[1].argmax())]
    gen = torch.Generator().manual_seed(6)
    counts = torch.zeros(6, dtype=torch.float64)
    trials = 0
    for _ in range(5000):
        acc = verify_sampling(tree, tokens, probs, gen)
        emitted = [tokens[n] for n in acc.nodes[1:]] + [acc.next_token]
        if emitted[0] == first:  # node 1 was accepted (a rejected draft is removed from the residual)
            counts[emitted[1]] += 1
            trials += 1
    assert trials > 1000
    assert _chi_square_p(counts, probs[1]) > 0.01


def test_probs_from_logits_truncation():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the first token alone holds >= 0.5 of the mass
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_entropy_nats_matches_categorical_and_handles_masks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_nats(logits), ref, atol=1e-6)
    masked = logits.clone()
    masked[:, 3:] = float("-inf")
    ref = torch.distributions.Categorical(logits=logits[:, :3]).entropy()
    assert torch.allclose(entropy_nats(masked), ref, atol=1e-6)
    one = torch.full((1, 11), float("-inf"))
    one[0, 4] = 0.0
    assert entropy_nats(one).item() == 0.0


# ----------------------------------------------------------------------------------------------------------
# One greedy verifier (`kernels.verify_tree_greedy`) behind the engine's `verify_greedy` and the SGLang CPU op
# ----------------------------------------------------------------------------------------------------------
def _plain_walk(tree: Tree, tokens, argmax):
    """The engine's former pure-python walk: first matching child in index order."""
    path, node = [0], 0
    while True:
        nxt = next((c for c in tree.children[node] if tokens[c] == argmax[node]), None)
        if nxt is None:
            return tuple(path), argmax[node]
        path.append(nxt)
        node = nxt


def _linked_list_walk(candidates, ridx, first_child, sibling, target, num_spec_step):
    """verify_tree_greedy_cpu's former linked-list walk: (predicts, accept_index, accept_token_num)."""
    bs, n = len(candidates), len(candidates[0])
    predicts, accept_index, num = [0] * (bs * n), [[-1] * num_spec_step for _ in range(bs)], []
    for b in range(bs):
        last, path, cur = ridx[b][0], [ridx[b][0]], 0
        for _ in range(1, num_spec_step):
            cur = first_child[b][cur]
            while cur != -1:
                if candidates[b][cur] == target[last]:
                    predicts[last] = target[last]
                    last = ridx[b][cur]
                    path.append(last)
                    break
                cur = sibling[b][cur]
            if cur == -1:
                break
        predicts[last] = target[last]
        accept_index[b][: len(path)] = path
        num.append(len(path) - 1)
    return predicts, accept_index, num


def _random_tree(gen: torch.Generator, n: int) -> Tree:
    return Tree(tuple([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_plain_walk_on_random_trees(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        tree = _random_tree(gen, int(torch.randint(1, 24, (1,), generator=gen)))
        n = tree.num_nodes
        tokens = torch.randint(0, 3, (n,), generator=gen).tolist()  # 3 tokens: many matches, duplicate siblings
        argmax = torch.randint(-1, 3, (n + 2,), generator=gen).tolist()  # -1 = NO_TOKEN; padded past n
        acc = verify_greedy(tree, tokens, argmax)
        assert (acc.nodes, acc.next_token) == _plain_walk(tree, tokens, argmax)


@pytest.mark.parametrize("seed", range(4))
def test_sglang_cpu_op_matches_linked_list_walk(seed):
    from entmtp_sglang.sglang.cpu.ops import verify_tree_greedy_cpu

    gen = torch.Generator().manual_seed(100 + seed)
    bs, n = 3, int(torch.randint(1, 16, (1,), generator=gen))
    trees = [_random_tree(gen, n) for _ in range(bs)]
    first_child = torch.stack([build_buffers(t).retrieve_next_token for t in trees])  # (bs, n)
    sibling = torch.stack([build_buffers(t).retrieve_next_sibling for t in trees])
    if n > 2:  # unlink node k of request 0 from its parent's list: k and its subtree become unreachable
        k, p = n - 1, trees[0].parents[n - 1]
        kids = [c for c in trees[0].children[p] if c != k]
        first_child[0, p] = kids[0] if kids else -1
        for a, b in zip(kids, kids[1:] + [-1]):
            sibling[0, a] = b
        sibling[0, k] = -1
    ridx = torch.arange(bs * n).view(bs, n)
    for num_spec_step in range(1, max(t.max_depth for t in trees) + 2):
        for _ in range(5):
            candidates = torch.randint(0, 2, (bs, n), generator=gen)
            target = torch.randint(0, 2, (bs, n), generator=gen)
            predicts = torch.zeros(bs * n, dtype=torch.int32)
            accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32)
            accept_token_num = torch.empty(bs, dtype=torch.int32)
            verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                                   candidates=candidates, retrive_index=ridx, retrive_next_token=first_child,
                                   retrive_next_sibling=sibling, target_predict=target)
            want = _linked_list_walk(candidates.tolist(), ridx.tolist(), first_child.tolist(), sibling.tolist(),
                                     target.view(-1).tolist(), num_spec_step)
            assert (predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()) == want


def test_sglang_cpu_op_rejects_descending_sibling_lists():
    from entmtp_sglang.sglang.cpu.ops import verify_tree_greedy_cpu

    # root's children 1 and 2 listed as 2 -> 1: the shared verifier would pick 1 where the list walk picks 2
    z = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="ascending"):
        verify_tree_greedy_cpu(predicts=z.view(-1).int(), accept_index=torch.full((1, 2), -1, dtype=torch.int32),
                               accept_token_num=torch.empty(1, dtype=torch.int32), candidates=z,
                               retrive_index=torch.arange(3).view(1, 3),
                               retrive_next_token=torch.tensor([[2, -1, -1]]),
                               retrive_next_sibling=torch.tensor([[-1, -1, 1]]), target_predict=z)
