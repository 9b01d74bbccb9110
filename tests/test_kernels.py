"""Kernels: Triton backend vs pure-torch reference, plus hand-written cases with written-out answers.

Without a GPU, Triton runs through its CPU interpreter, which must be switched on before triton is
imported (neither torch nor the kernels package imports triton eagerly, so setting it here is early enough).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from entmtp_sglang.kernels import (  # noqa: E402
    softmax_entropy,
    softmax_entropy_torch,
    tree_ancestor_mask,
    tree_ancestor_mask_torch,
    triton_available,
    verify_tree_greedy,
    verify_tree_greedy_torch,
)
from entmtp_sglang.kernels._backend import resolve_backend, triton_interpret  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not triton_interpret() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_available() or (DEVICE == "cpu" and not triton_interpret()),
    reason="needs triton and either a CUDA device or TRITON_INTERPRET=1",
)
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------- helpers


def random_trees(gen: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents (B, N), num_nodes (B,)): parents[i] = randint(0, i-1), nodes >= num_nodes padded with -1."""
    parents = torch.full((b, n), -1, dtype=torch.int64)  # (B, N)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (b,), generator=gen)
    num_nodes = torch.randint(1, n + 1, (b,), generator=gen)  # (B,)
    parents[torch.arange(n)[None, :] >= num_nodes[:, None]] = -1
    return parents, num_nodes


def oracle_ancestor_mask(parents: list[int], n_valid: int, n: int) -> tuple[list[list[bool]], list[int]]:
    """Plain-python walk up the parent chain, one tree."""
    mask = [[i == j for j in range(n)] for i in range(n)]
    depths = [0] * n
    for i in range(n_valid):
        j = i
        while j > 0:
            j = parents[j]
            mask[i][j] = True
            depths[i] += 1
    return mask, depths


def oracle_verify(parents: list[int], n_valid: int, draft: list[int], target: list[int]) -> tuple[int, list[int], int]:
    """Plain-python greedy descent, one tree."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [v for v in range(1, n_valid) if parents[v] == cur and draft[v] == target[cur]]
        if not kids:
            break
        path.append(min(kids))
    return len(path) - 1, path + [-1] * (len(parents) - len(path)), target[path[-1]]


def random_logits(gen: torch.Generator, n: int, v: int, dtype: torch.dtype, masked: bool) -> torch.Tensor:
    x = torch.randn(n, v, generator=gen) * 4.0  # (N, V)
    if masked:  # grammar-style mask: most tokens forbidden, at least one allowed per row
        forbid = torch.rand(n, v, generator=gen) < 0.8
        forbid[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] = False
        x[forbid] = NEG_INF
    return x.to(dtype)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-4, atol=1e-4),
       torch.bfloat16: dict(rtol=1e-4, atol=1e-4)}


def check_entropy_backends(x: torch.Tensor, temperature: float, block_v: int | None = None) -> None:
    from entmtp_sglang.kernels.entropy_triton import softmax_entropy_triton

    ref = softmax_entropy_torch(x, temperature)
    got = softmax_entropy_triton(x, temperature, block_v=block_v)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0],)
    torch.testing.assert_close(got.cpu(), ref.cpu(), equal_nan=True, **TOL[x.dtype])


def check_tree_backends(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    m_ref, d_ref = tree_ancestor_mask_torch(parents, num_nodes)
    m_got, d_got = tree_ancestor_mask(parents, num_nodes, backend="triton")
    assert m_got.dtype == torch.bool and d_got.dtype == torch.int64
    assert torch.equal(m_got.cpu(), m_ref.cpu())
    assert torch.equal(d_got.cpu(), d_ref.cpu())


def check_verify_backends(*args: torch.Tensor) -> None:
    ref = verify_tree_greedy_torch(*args)
    got = verify_tree_greedy(*args, backend="triton")
    for g, r in zip(got, ref):
        assert g.dtype == torch.int64
        assert torch.equal(g.cpu(), r.cpu())


def random_verify_inputs(gen: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, ...]:
    parents, num_nodes = random_trees(gen, b, n)
    target = torch.randint(0, 3, (b, n), generator=gen)  # (B, N), tiny vocab: frequent ties
    draft = torch.randint(0, 3, (b, n), generator=gen)  # (B, N)
    force = torch.rand(b, n, generator=gen) < 0.6  # make ~60% of nodes match their parent's argmax
    draft = torch.where(force, target.gather(1, parents.clamp(min=0)), draft)
    return parents, num_nodes, draft, target


# ----------------------------------------------------------------------------------------------- entropy


def test_entropy_torch_matches_categorical() -> None:
    gen = torch.Generator().manual_seed(0)
    for v in (1, 2, 17, 1000):
        for temperature in (0.3, 1.0, 2.5):
            x = torch.randn(6, v, generator=gen) * 3.0  # (6, V)
            got = softmax_entropy_torch(x, temperature)  # (6,)
            cat = torch.distributions.Categorical(logits=x / temperature)
            torch.testing.assert_close(got, cat.entropy(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, -(cat.probs * cat.probs.log()).sum(-1), rtol=1e-5, atol=1e-6)


def test_entropy_hand_cases() -> None:
    x = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],  # uniform over 4 -> log 4
        [5.0, NEG_INF, NEG_INF, NEG_INF],  # one allowed token -> 0
        [1.0, NEG_INF, 1.0, NEG_INF],  # uniform over the 2 allowed -> log 2
        [0.0, math.log(3.0), NEG_INF, NEG_INF],  # p = (1/4, 3/4)
    ])
    h13 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expect = torch.tensor([math.log(4.0), 0.0, math.log(2.0), h13])
    torch.testing.assert_close(softmax_entropy(x, backend="torch"), expect)
    # temperature 2 on logits (0, 2 log 3) gives the same p = (1/4, 3/4)
    y = torch.tensor([[0.0, 2.0 * math.log(3.0)]])
    torch.testing.assert_close(softmax_entropy(y, temperature=2.0, backend="torch"), torch.tensor([h13]))


def test_entropy_masked_equals_restricted() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 50, generator=gen)
    keep = torch.rand(50, generator=gen) < 0.3
    masked = torch.where(keep, x, torch.full_like(x, NEG_INF))
    torch.testing.assert_close(softmax_entropy_torch(masked), softmax_entropy_torch(x[:, keep]))


def test_entropy_bad_args() -> None:
    with pytest.raises(ValueError):
        softmax_entropy(torch.zeros(2, 3), temperature=0.0)
    with pytest.raises(TypeError):
        softmax_entropy(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError):
        softmax_entropy(torch.zeros(2, 3), backend="cuda")  # type: ignore[arg-type]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_entropy_triton_vs_torch_small(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    wide = random_logits(gen, 3, 2 * 300, dtype, masked=False).to(DEVICE)
    check_entropy_backends(wide[:, ::2], 1.0, block_v=64)  # non-contiguous: column stride 2, 5 V-blocks
    assert not wide[:, ::2].is_contiguous()
    check_entropy_backends(random_logits(gen, 4, 97, dtype, masked=True).to(DEVICE), 0.7, block_v=32)
    check_entropy_backends(random_logits(gen, 2, 1, dtype, masked=False).to(DEVICE), 1.3)  # V = 1 -> 0


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns on log(0) for the NaN row
def test_entropy_triton_edge_rows() -> None:
    x = torch.randn(4, 40)
    x[0] = NEG_INF  # nothing allowed -> NaN in both backends
    x[1, 1:] = NEG_INF  # only the first token allowed -> 0
    x[2, :39] = NEG_INF  # only the last token allowed (and it sits in the last block) -> 0
    x[3, :33] = NEG_INF  # whole first block masked, then finite
    x = x.to(DEVICE)
    check_entropy_backends(x, 1.0, block_v=32)
    got = softmax_entropy(x, backend="triton").cpu()
    assert torch.isnan(got[0]) and got[1] == 0 and got[2] == 0


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_entropy_triton_vs_torch_sweep(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for b, v in ((1, 5000), (2, 4096), (3, 4999), (4, 1000), (5, 257)):
        for masked in (False, True):
            for temperature in (0.5, 1.0, 1.7):
                x = random_logits(gen, 2 * b, v + 3, dtype, masked).to(DEVICE)[::2, 3:]  # strided rows, offset
                check_entropy_backends(x, temperature)
                check_entropy_backends(x, temperature, block_v=512)


# ----------------------------------------------------------------------------------------------- tree mask

#            0
#          /   \
#         1     2
#        / \     \
#       3   4     5          (+ 2 padding slots: N = 8, num_nodes = 6)
HAND_PARENTS = [-1, 0, 0, 1, 1, 2, -1, -1]
HAND_MASK = [
    # 0  1  2  3  4  5  6  7
    [1, 0, 0, 0, 0, 0, 0, 0],  # 0
    [1, 1, 0, 0, 0, 0, 0, 0],  # 1
    [1, 0, 1, 0, 0, 0, 0, 0],  # 2
    [1, 1, 0, 1, 0, 0, 0, 0],  # 3
    [1, 1, 0, 0, 1, 0, 0, 0],  # 4
    [1, 0, 1, 0, 0, 1, 0, 0],  # 5
    [0, 0, 0, 0, 0, 0, 1, 0],  # 6 padding: self only
    [0, 0, 0, 0, 0, 0, 0, 1],  # 7 padding: self only
]
HAND_DEPTHS = [0, 1, 1, 2, 2, 2, 0, 0]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_tree_mask_hand_case(backend: str) -> None:
    parents = torch.tensor([HAND_PARENTS, [-1, 0, 1, 2, 3, 4, 5, 6]], device=DEVICE)  # row 1: a chain
    num_nodes = torch.tensor([6, 8], device=DEVICE)
    mask, depths = tree_ancestor_mask(parents, num_nodes, backend=backend)
    assert mask[0].cpu().tolist() == [[bool(c) for c in r] for r in HAND_MASK]
    assert depths[0].cpu().tolist() == HAND_DEPTHS
    assert torch.equal(mask[1].cpu(), torch.ones(8, 8, dtype=torch.bool).tril())  # chain: lower triangle
    assert depths[1].cpu().tolist() == list(range(8))


def test_tree_mask_torch_vs_oracle() -> None:
    gen = torch.Generator().manual_seed(4)
    for b, n in ((1, 1), (3, 7), (5, 33)):
        parents, num_nodes = random_trees(gen, b, n)
        mask, depths = tree_ancestor_mask_torch(parents, num_nodes)
        for r in range(b):
            m, d = oracle_ancestor_mask(parents[r].tolist(), int(num_nodes[r]), n)
            assert mask[r].tolist() == m and depths[r].tolist() == d


@needs_triton
def test_tree_mask_triton_vs_torch_small() -> None:
    gen = torch.Generator().manual_seed(5)
    for b, n in ((1, 1), (2, 5), (3, 16)):
        parents, num_nodes = random_trees(gen, b, n)
        check_tree_backends(parents.to(DEVICE), num_nodes.to(DEVICE))
    parents, num_nodes = random_trees(gen, 3, 12)
    parents = parents.t().contiguous().t().to(DEVICE)  # non-contiguous (column-major) parents
    assert not parents.is_contiguous()
    check_tree_backends(parents, num_nodes.to(DEVICE))


@needs_triton
@pytest.mark.slow
def test_tree_mask_triton_vs_torch_sweep() -> None:
    gen = torch.Generator().manual_seed(6)
    for b in range(1, 6):
        for n in (2, 13, 31, 50, 64):
            parents, num_nodes = random_trees(gen, b, n)
            check_tree_backends(parents.to(DEVICE), num_nodes.to(DEVICE))


# ----------------------------------------------------------------------------------------------- verify

#   node:token (tokens: A=10 B=11 C=12 D=13 E=14 F=15 G=16 Q=17 Y=18)
#
#              0
#            /   \
#         1:A     2:B
#         / \       \
#      3:C   4:D     5:E
#             |
#            6:F
V_PARENTS = [-1, 0, 0, 1, 1, 2, 4]
V_DRAFT = [0, 10, 11, 12, 13, 14, 15]
# target_argmax[v] = target's next token after node v
V_TARGET = [10, 13, 14, 0, 15, 0, 16]  # root->A, after 1: D, after 2: E, after 4: F, after 6: G


def hand_verify_inputs() -> tuple[torch.Tensor, ...]:
    rows = [
        # (num_nodes, draft, target)                       expected path / bonus
        (7, V_DRAFT, V_TARGET),  # 0 -1(A) -4(D) -6(F), bonus G=16
        (7, V_DRAFT, [17] + V_TARGET[1:]),  # root wants Q: nothing accepted, bonus Q=17
        (7, [0, 10, 10, 12, 13, 14, 15], [10, 18, 14, 0, 15, 0, 16]),  # 1 and 2 both A: lowest (1) wins,
        #                                          after 1 the target wants Y: stop, bonus Y=18
        (6, V_DRAFT, V_TARGET),  # node 6 is padding: 0 -1 -4, bonus F=15
    ]
    parents = torch.tensor([V_PARENTS] * len(rows))
    parents[3, 6] = -1
    num_nodes = torch.tensor([r[0] for r in rows])
    draft = torch.tensor([r[1] for r in rows])
    target = torch.tensor([r[2] for r in rows])
    return parents, num_nodes, draft, target


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_verify_hand_case(backend: str) -> None:
    args = [t.to(DEVICE) for t in hand_verify_inputs()]
    accept_len, accepted, bonus = verify_tree_greedy(*args, backend=backend)
    assert accept_len.cpu().tolist() == [3, 0, 1, 2]
    assert accepted.cpu().tolist() == [
        [0, 1, 4, 6, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1],
        [0, 1, -1, -1, -1, -1, -1],
        [0, 1, 4, -1, -1, -1, -1],
    ]
    assert bonus.cpu().tolist() == [16, 17, 18, 15]


def test_verify_torch_vs_oracle() -> None:
    gen = torch.Generator().manual_seed(7)
    lens = set()
    for b, n in ((1, 1), (4, 9), (5, 40)):
        parents, num_nodes, draft, target = random_verify_inputs(gen, b, n)
        accept_len, accepted, bonus = verify_tree_greedy_torch(parents, num_nodes, draft, target)
        for r in range(b):
            a, path, bo = oracle_verify(parents[r].tolist(), int(num_nodes[r]), draft[r].tolist(), target[r].tolist())
            assert (int(accept_len[r]), accepted[r].tolist(), int(bonus[r])) == (a, path, bo)
            lens.add(a)
    assert len(lens) >= 3  # the inputs exercise several accept lengths


@needs_triton
def test_verify_triton_vs_torch_small() -> None:
    gen = torch.Generator().manual_seed(8)
    for b, n in ((1, 1), (2, 6), (4, 16)):
        check_verify_backends(*(t.to(DEVICE) for t in random_verify_inputs(gen, b, n)))
    parents, num_nodes, draft, target = random_verify_inputs(gen, 3, 10)
    wide = torch.stack([target, target], dim=-1).reshape(3, 20)[:, ::2]  # non-contiguous (stride 2)
    assert not wide.is_contiguous()
    check_verify_backends(parents.to(DEVICE), num_nodes.to(DEVICE), draft.to(DEVICE), wide.to(DEVICE))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_verify_self_parented_node_is_never_accepted(backend: str) -> None:
    # V_PARENTS with node 4 linked to no parent (its own parent): the path stops at 1, and node 6
    # (a child of 4) is unreachable too. This is how verify_tree_greedy_cpu marks unlinked nodes.
    parents = torch.tensor([V_PARENTS])
    parents[0, 4] = 4
    args = [t.to(DEVICE) for t in (parents, torch.tensor([7]), torch.tensor([V_DRAFT]), torch.tensor([V_TARGET]))]
    accept_len, accepted, bonus = verify_tree_greedy(*args, backend=backend)
    assert accept_len.cpu().tolist() == [1]
    assert accepted.cpu().tolist() == [[0, 1, -1, -1, -1, -1, -1]]
    assert bonus.cpu().tolist() == [13]


@needs_triton
@pytest.mark.slow
def test_verify_triton_vs_torch_sweep() -> None:
    gen = torch.Generator().manual_seed(9)
    for b in range(1, 6):
        for n in (2, 13, 31, 50, 64):
            check_verify_backends(*(t.to(DEVICE) for t in random_verify_inputs(gen, b, n)))


# ----------------------------------------------------------------------------------------------- dispatch


def test_auto_backend_on_cpu_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 2)
    assert resolve_backend("auto", x) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_available():
        with pytest.raises(ValueError):  # explicit triton on CPU needs the interpreter
            resolve_backend("triton", x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_available():
        assert resolve_backend("triton", x) == "triton"
